from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from rich.console import Console

from relayrl.config import LoggerConfig, MasterConfig
from relayrl.utils import logger as logger_mod
from relayrl.utils.logger import Logger, as_scalar, flatten_metrics


def _cfg(**kw: Any) -> LoggerConfig:
    return LoggerConfig(**{"tensorboard_enabled": False, "progress_bar": False, **kw})


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _plain_console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=False, width=200), buf


def test_flatten_and_scalar_helpers() -> None:
    assert flatten_metrics({"a": 1, "b": {"c": 2, "d": {"e": 3}}}, "train") == {
        "train/a": 1,
        "train/b/c": 2,
        "train/b/d/e": 3,
    }
    assert flatten_metrics({"x": 1}) == {"x": 1}
    assert as_scalar(3) == 3.0 and as_scalar(True) == 1.0
    assert as_scalar(torch.tensor(2.5)) == 2.5 and as_scalar(torch.tensor([4.0])) == 4.0
    assert as_scalar(np.float32(0.5)) == 0.5 and as_scalar(np.array([[7]])) == 7.0
    for non_scalar in ([1, 2], torch.ones(2), np.ones(3), "text", None, {"a": 1}, np.array(["s"])):
        assert as_scalar(non_scalar) is None


def test_metrics_jsonl_rows_per_call(tmp_path: Path) -> None:
    with Logger(_cfg(), tmp_path, console=_plain_console()[0]) as log:
        log.log_metrics({"reward": torch.tensor(0.5), "lengths": torch.tensor([1, 2])}, step=1, prefix="train")
        log.log_metrics({"accuracy": np.float64(0.25)}, step=1, prefix="validation")
        log.log_metrics({"nested": {"a": 1}, "nan": float("nan")}, step=2)
        log.log_metrics({}, step=3)  # nothing to write
    rows = _read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[0] == {"step": 1, "train/reward": 0.5, "train/lengths": [1, 2]}
    assert rows[1] == {"step": 1, "validation/accuracy": 0.25}
    assert rows[2]["nested/a"] == 1 and math.isnan(rows[2]["nan"])
    assert len(rows) == 3


def test_metrics_jsonl_appends_on_resume(tmp_path: Path) -> None:
    with Logger(_cfg(), tmp_path, console=_plain_console()[0]) as log:
        log.log_metrics({"loss": 1.0}, step=1, prefix="train")
    with Logger(_cfg(), tmp_path, console=_plain_console()[0]) as log:
        log.log_metrics({"loss": 0.5}, step=2, prefix="train")
    assert [r["step"] for r in _read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full (every write fails: no space left)")
def test_a_failed_write_names_its_file_and_closing_leaves_that_error_alone(tmp_path: Path) -> None:
    """A full disk: the OSError names the file (a flushed buffer's has no name); closing, which tries the buffered
    tail once more, raises nothing after it, so the first error is the one reported."""
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    log = Logger(_cfg(), tmp_path, console=_plain_console()[0])
    with pytest.raises(OSError, match="No space left on device") as failed:
        log.log_metrics({"loss": 1.0}, step=1, prefix="train")
    assert failed.value.filename == str(tmp_path / "metrics.jsonl")
    log.close()


def test_tensorboard_scalars_only(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = Logger(_cfg(tensorboard_enabled=True), tmp_path, console=_plain_console()[0])
    with pytest.warns(UserWarning, match="not a scalar") as record:
        log.log_metrics({"reward": 0.5, "hist": [1, 2, 3], "name": "x", "vec": torch.ones(3)}, step=1, prefix="train")
    assert sorted(str(w.message).split("'")[1] for w in record) == ["train/hist", "train/name", "train/vec"]
    log.log_metrics({"reward": 0.75, "hist": [4]}, step=2, prefix="train")  # warned only once per key
    log.log_hyperparams(MasterConfig().model_dump())
    log.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["train/reward"]
    assert [(e.step, e.value) for e in acc.Scalars("train/reward")] == [(1, 0.5), (2, 0.75)]


def test_log_jsonl_appends_rows_with_tensors(tmp_path: Path) -> None:
    with Logger(_cfg(), tmp_path, console=_plain_console()[0]) as log:
        path = log.log_jsonl(
            [{"step": 1, "prompt": "1+1=", "tokens": torch.tensor([3, 4]), "reward": 1.0}], "samples.jsonl"
        )
        log.log_jsonl(
            [{"step": 2, "prompt": "2+2=", "tokens": np.array([5]), "reward": torch.tensor(0.0)}], "samples.jsonl"
        )
        log.log_jsonl([{"x": 1}], "sub/other.jsonl")
    assert path == tmp_path / "samples.jsonl"
    rows = _read_jsonl(path)
    assert rows == [
        {"step": 1, "prompt": "1+1=", "tokens": [3, 4], "reward": 1.0},
        {"step": 2, "prompt": "2+2=", "tokens": [5], "reward": 0.0},
    ]
    assert _read_jsonl(tmp_path / "sub" / "other.jsonl") == [{"x": 1}]


def _log_step(log: Logger, step: int, reward: float, step_time: float = 2.0) -> None:
    log.log_metrics({"reward": reward}, step=step, prefix="train")
    log.log_metrics({"total_step_time": step_time}, step=step, prefix="timing/train")


def test_plain_console_prints_one_line_per_step(tmp_path: Path) -> None:
    console, buf = _plain_console()
    log = Logger(_cfg(progress_bar=True), tmp_path, total_steps=10, print_interval_s=0.0, console=console)
    _log_step(log, 1, 0.25)
    log.log_metrics({"accuracy": 0.5}, step=2, prefix="validation")
    _log_step(log, 2, 0.5, step_time=4.0)
    log.print_message("a [bold]message[/bold]")
    log.close()
    lines = buf.getvalue().splitlines()
    assert lines[0] == "step 1/10 | reward 0.25 | 2 s/step | ETA 0:18"
    assert lines[1] == "step 2/10 | reward 0.5 | val acc 0.5 | 4 s/step | ETA 0:24"  # 8 steps x mean(2, 4)
    assert lines[2] == "a [bold]message[/bold]"
    assert len(lines) == 3


def test_plain_console_rate_limited_and_final_line_on_close(tmp_path: Path) -> None:
    console, buf = _plain_console()
    log = Logger(_cfg(), tmp_path, total_steps=100, print_interval_s=3600.0, console=console)
    for step in range(1, 6):
        _log_step(log, step, reward=step / 10)
    assert len(buf.getvalue().splitlines()) == 1  # step 1 only; later steps fall inside the interval
    log.close()
    log.close()  # idempotent
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("step 5/100 | reward 0.5")


def test_progress_bar_on_terminal(tmp_path: Path) -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=160, color_system=None)
    log = Logger(_cfg(progress_bar=True), tmp_path, total_steps=5, start_step=1, console=console)
    assert log._progress is not None and log._progress.tasks[0].completed == 1
    _log_step(log, 2, 0.75)
    _log_step(log, 3, 1.0)
    log.print_message("hello")
    log.close()
    out = buf.getvalue()
    assert "1/5" in out and "3/5" in out and "reward 1" in out and "ETA 0:04" in out and "hello" in out
    assert log.eta_seconds() == pytest.approx(4.0)


def test_progress_bar_disabled_when_not_a_terminal(tmp_path: Path) -> None:
    with Logger(_cfg(progress_bar=True), tmp_path, console=_plain_console()[0]) as log:
        assert log._progress is None
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True)
    with Logger(_cfg(progress_bar=False), tmp_path, console=console) as log:
        assert log._progress is None


def test_eta_unknown_without_total(tmp_path: Path) -> None:
    console, buf = _plain_console()
    with Logger(_cfg(), tmp_path, print_interval_s=0.0, console=console) as log:
        _log_step(log, 1, 0.0)
        assert log.eta_seconds() is None
    assert buf.getvalue().splitlines()[0] == "step 1 | reward 0 | 2 s/step"


@pytest.mark.parametrize(
    ("flag", "module", "extra"), [("wandb_enabled", "wandb", "wandb"), ("mlflow_enabled", "mlflow", "mlflow")]
)
def test_missing_optional_backend_names_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: str, module: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes `import <module>` raise ImportError
    with pytest.raises(ImportError, match=rf"relayrl\[{extra}\]"):
        Logger(_cfg(**{flag: True}), tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # fails before creating anything


class _FakeWandb:
    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, float], int]] = []
        self.config = type("Cfg", (), {"update": lambda _self, d, allow_val_change=False: setattr(self, "cfg", d)})()
        self.finished = False

    def init(self, **kwargs: Any) -> None:
        self.init_kwargs = kwargs

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((metrics, step))

    def finish(self) -> None:
        self.finished = True


def test_wandb_receives_scalars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = Logger(_cfg(wandb_enabled=True), tmp_path, console=_plain_console()[0])
    assert fake.init_kwargs["project"] == "relayrl" and fake.init_kwargs["dir"] == str(tmp_path)
    with pytest.warns(UserWarning, match="train/texts"):
        log.log_metrics({"reward": torch.tensor(0.5), "texts": ["a"]}, step=3, prefix="train")
    log.log_hyperparams({"grpo": {"seed": 1}})
    log.close()
    assert fake.logged == [({"train/reward": 0.5}, 3)]
    assert fake.cfg == {"grpo": {"seed": 1}} and fake.finished
    assert logger_mod.STEP_TIME_KEY == "timing/train/total_step_time"


class _FakeMlflow:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def test_mlflow_receives_finite_scalars_and_chunked_params(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeMlflow()
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    log = Logger(_cfg(mlflow_enabled=True), tmp_path, console=_plain_console()[0])
    log.log_metrics({"loss": 0.5, "bad": float("inf")}, step=2, prefix="train")
    log.log_hyperparams({"p": {f"k{i}": i for i in range(150)}, "long": "x" * 600})
    log.close()
    names = [c[0] for c in fake.calls]
    assert names[:3] == ["set_tracking_uri", "set_experiment", "start_run"]
    assert fake.calls[0][1][0] == (tmp_path / "mlflow").resolve().as_uri()
    assert fake.calls[2][2] == {"run_name": None}
    assert [c[1:] for c in fake.calls if c[0] == "log_metrics"] == [(({"train/loss": 0.5},), {"step": 2})]
    params = [c[1][0] for c in fake.calls if c[0] == "log_params"]
    assert [len(p) for p in params] == [100, 51]
    merged = {k: v for p in params for k, v in p.items()}
    assert merged["p.k149"] == "149" and len(merged["long"]) == 500
    assert names[-1] == "end_run"
