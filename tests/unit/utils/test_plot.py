from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib.image as mpimg
import pytest

from relayrl.utils.plot import main, plot_run, read_metrics, tool_panels


def _write(run_dir: Path, rows: list[dict[str, Any]], tail: str = "") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows) + tail
    (run_dir / "metrics.jsonl").write_text(text)


def _rows(n: int, with_critic: bool = False) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for s in range(1, n + 1):
        row = {
            "step": s,
            "train/reward": s / n,
            "train/kl_penalty": 0.01 * s,
            "train/loss": 1.0 / s,
            "train/mean_gen_tokens_per_sample": 10 + s,
        }
        if with_critic:
            row["critic/loss"] = 2.0 / s
        rows.append(row)
        rows.append({"step": s, "timing/train/total_step_time": 1.5})
    rows.append({"step": n, "validation/accuracy": 0.5})
    return rows


def test_read_metrics_merges_lines_by_step(tmp_path: Path) -> None:
    _write(
        tmp_path,
        [
            {"step": 2, "train/reward": 0.2, "flag": True, "text": "x", "lst": [1]},
            {"step": 1, "train/reward": 0.1},
            {"step": 2, "train/reward": 0.25, "train/loss": 3},
        ],
    )
    series = read_metrics(tmp_path / "metrics.jsonl")
    assert series == {"train/reward": [(1, 0.1), (2, 0.25)], "train/loss": [(2, 3.0)]}


def test_plot_run_writes_png(tmp_path: Path) -> None:
    _write(tmp_path, _rows(12))
    out = plot_run(tmp_path)
    assert out == tmp_path / "metrics.png"
    img = mpimg.imread(out)
    # 6 panels in a 3x2 grid at 100 dpi: 12 x 9.6 inches
    assert img.shape[:2] == (960, 1200)
    assert img.std() > 0.01  # something was drawn


def test_cli_adds_value_loss_panel_when_present(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, _rows(5, with_critic=True))
    out = tmp_path / "figs" / "ppo.png"
    main([str(tmp_path), "-o", str(out)])
    assert capsys.readouterr().out.strip() == str(out)
    assert mpimg.imread(out).shape[:2] == (1280, 1200)  # 7 panels -> 4 rows


def test_plot_run_tolerates_missing_metrics_and_truncated_line(tmp_path: Path) -> None:
    _write(tmp_path, [{"step": 1, "train/reward": 0.5}], tail='{"step": 2, "train/rew')
    with pytest.warns(UserWarning, match="metrics.jsonl:2"):
        out = plot_run(tmp_path)
    assert out.is_file()


def test_missing_metrics_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path / "nope")


def test_empty_metrics_file_names_it(tmp_path: Path) -> None:
    _write(tmp_path, [], tail="\n\n")
    with pytest.raises(ValueError, match=r"no metric rows: .*metrics\.jsonl"):
        plot_run(tmp_path)


def _timed_rows(n: int, producer: bool = False) -> list[dict[str, Any]]:
    rows = _rows(n)
    for s in range(1, n + 1):
        phases = {"generation": 0.5, "policy_training": 0.75, "checkpointing": 0.25 * (s % 2)}
        row = {f"timing/train/{k}": v for k, v in phases.items()}
        row["timing/train/unaccounted"] = 0.01
        if producer:
            row.update({"timing/async/producer_generation": 0.6, "timing/async/producer_idle": 0.1})
            row["timing/async/queue_depth"] = float(s % 2)
        rows.append({"step": s, **row})
    return rows


def test_the_breakdown_is_drawn_under_the_curves_and_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, _timed_rows(6))
    full = mpimg.imread(plot_run(tmp_path))
    assert full.shape[:2] == (960 + 400, 1200)  # the 3x2 curves, then the full-width stacked chart (4 inches)
    main([str(tmp_path), "-o", str(tmp_path / "b.png"), "--breakdown"])
    alone = mpimg.imread(tmp_path / "b.png")
    assert alone.shape[:2] == (520, 1200) and alone.std() > 0.01
    assert capsys.readouterr().out.strip() == str(tmp_path / "b.png")


def test_an_async_breakdown_adds_the_producer_panel(tmp_path: Path) -> None:
    _write(tmp_path, _timed_rows(4, producer=True))
    assert mpimg.imread(plot_run(tmp_path, tmp_path / "a.png", breakdown_only=True)).shape[:2] == (820, 1200)


def test_a_breakdown_of_a_run_without_phase_timings_names_the_file(tmp_path: Path) -> None:
    _write(tmp_path, _rows(3))
    with pytest.raises(ValueError, match="metrics.jsonl has no timing/train/<phase> timings"):
        plot_run(tmp_path, breakdown_only=True)


def test_tool_panels_draw_validity_turns_and_latency_for_environment_runs(tmp_path: Path) -> None:
    """A run of environment classes (issue 26) gets tool-call validity (derived from the counts), turns per episode
    and tool latency; a run without them keeps its six panels (test_plot_run_writes_png)."""
    rows = _rows(4)
    for s, (calls, invalid) in enumerate([(3, 1), (0, 0), (4, 0), (2, 2)], start=1):
        rows.append(
            {
                "step": s,
                "train/env/episodes": 4,
                "train/env/tool_calls": calls,
                "train/env/invalid_tool_calls": invalid,
                "train/env/tool_latency_s": 1e-5,
                "train/avg_turns_per_sample": 1.5,
            }
        )
    _write(tmp_path, rows)
    series = read_metrics(tmp_path / "metrics.jsonl")
    panels = tool_panels(series)
    assert [key for _, key in panels] == [
        "train/avg_turns_per_sample",
        "train/env/tool_call_validity",
        "train/env/tool_latency_s",
    ]
    assert series["train/env/tool_call_validity"] == [(1, 0.75), (3, 1.0), (4, 0.5)]  # step 2 made no call
    assert mpimg.imread(plot_run(tmp_path)).shape[:2] == (1600, 1200)  # 9 panels -> 5 rows
