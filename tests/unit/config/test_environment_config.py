"""`env.environment_factory` and friends: defaults they set, combinations refused in one line, bad paths."""

from __future__ import annotations

import pytest

from relayrl.algorithms.api import build_run_config
from relayrl.config import MasterConfig
from relayrl.environments.registry import build_tool_environments
from relayrl.utils.config_io import ConfigError


class Tiny:
    def reset(self, **row: object) -> None:
        return None

    def ping(self, x: int) -> int:
        """Echo.

        Args:
            x: a number
        """
        return x


def test_one_class_is_the_default_task_several_are_routed_by_the_environment_column() -> None:
    one = MasterConfig(env={"environment_factory": "mod:Cls"})
    assert one.data.train.default_task == "environment"
    several = MasterConfig(env={"environment_factory": {"a": "mod:A", "b": "pkg.mod:B"}})
    assert several.data.train.task_field == "environment" and several.data.train.default_task == "math"
    given = MasterConfig(env={"environment_factory": "mod:Cls"}, data={"train": {"default_task": "math"}})
    assert given.data.train.default_task == "math"  # a key the user set wins


#: What async GRPO on Ray needs besides the environment class (dedicated generation workers).
ASYNC_ON_RAY_GENERATION = {
    "generation": {"colocated": {"enabled": False, "resources": {"num_nodes": 1, "workers_per_node": 1}}}
}


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"env": {"environment_factory": "no_colon"}}, "must look like module:Class"),
        ({"env": {"environment_factory": {}}}, "empty mapping"),
        ({"env": {"tool_call_parser": "nope"}}, "must be 'hermes' or module:function"),
    ],
)
def test_refused_in_one_line(keys: dict, message: str) -> None:
    raw = {"env": {"environment_factory": "mod:Cls"}, **keys}
    if "env" in keys:
        raw["env"] = {"environment_factory": "mod:Cls", **keys["env"]}
    with pytest.raises(ValueError, match=message):
        MasterConfig(**raw)


def test_async_grpo_on_ray_takes_environment_classes_and_message_penalties() -> None:
    cfg = MasterConfig(
        env={"environment_factory": "mod:Cls"},
        grpo={"async_grpo": {"enabled": True}, "invalid_tool_call_advantage": -1.0},
        cluster={"executor": "ray"},
        policy=ASYNC_ON_RAY_GENERATION,
    )
    assert cfg.data.train.default_task == "environment" and cfg.data_plane.backend == "ray"


def test_python_classes_set_the_same_defaults_and_refusals() -> None:
    cfg, _, _ = build_run_config(environment_factory=Tiny, train_dataset=[{"prompt": "p"}], reward_fns=[len])
    assert cfg.data.train.default_task == "environment"
    on_async, _, _ = build_run_config(environment_factory=Tiny, overrides={"grpo.async_grpo.enabled": True})
    assert on_async.grpo.async_grpo.enabled and on_async.data.train.default_task == "environment"
    with pytest.raises(ConfigError, match="must be a class"):
        build_run_config(environment_factory=Tiny())  # type: ignore[arg-type]


def test_classes_load_by_path_and_bad_ones_fail_before_any_model(tmp_path, monkeypatch) -> None:
    (tmp_path / "envs.py").write_text(
        "class Good:\n    def reset(self, **row):\n        return None\n\n"
        "class Bad:\n    def lookup(self, key):\n        return key\n"
    )
    monkeypatch.chdir(tmp_path)
    good = build_tool_environments(MasterConfig(env={"environment_factory": "envs.py:Good"}))
    assert list(good) == ["environment"] and good["environment"].tools is None  # no tools: no tools= either
    with pytest.raises(ValueError, match=r"Bad\.lookup is a public method, so a tool, but has no usable schema"):
        build_tool_environments(MasterConfig(env={"environment_factory": {"b": "envs.py:Bad"}}))
    with pytest.raises(ValueError, match="env.environment_factory entry 'envs.py:Nope': .* has no class 'Nope'"):
        build_tool_environments(MasterConfig(env={"environment_factory": "envs.py:Nope"}))
    with pytest.raises(ValueError, match="given twice"):
        build_tool_environments(MasterConfig(env={"environment_factory": "envs.py:Good"}), given=Tiny)
    several = build_tool_environments(MasterConfig(), given={"x": Tiny, "y": Tiny})
    assert [e.metric_prefix for e in several.values()] == ["env/x", "env/y"]


def test_rows_are_routed_by_their_environment_column_and_keep_columns_and_conversation(char_tokenizer) -> None:
    from relayrl.experience.data import PromptDataset
    from relayrl.experience.records import records_from_rows

    cfg = MasterConfig(env={"environment_factory": {"a": "m:A", "b": "m:B"}}, data={"system_prompt": "Be brief."})
    rows = [{"prompt": "1+1=", "environment": "a", "answer": "2"}, {"prompt": "2+2=", "environment": "b", "k": 3}]
    records = records_from_rows(rows, cfg.data.train, "rows", episode_tasks=frozenset({"a", "b"}))
    assert [r.task for r in records] == ["a", "b"] and [r.row for r in records] == [1, 2]
    assert records[1].columns == {"environment": "b", "k": 3}
    dataset = PromptDataset(records, char_tokenizer, max_prompt_length=64, system_prompt="Be brief.")
    info = dataset[1]["extra_env_info"]
    assert info["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    assert info["columns"] == {"environment": "b", "k": 3} and info["row"] == 2
    plain = records_from_rows(rows, cfg.data.train, "rows")  # not environment tasks: no columns kept
    assert plain[0].columns is None
