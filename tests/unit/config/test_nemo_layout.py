"""NeMo RL's config layout read into relayrl's: keys mapped to their relayrl meaning, engine-only keys named once on
one line, values relayrl cannot honour refused with one line naming the key, unknown keys still refused, and a
relayrl config untouched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from relayrl.config import MasterConfig
from relayrl.config.nemo_layout import PASSTHROUGH_TEMPLATE, NemoLayoutError, notice_line, translate_nemo_layout
from relayrl.utils import config_io
from relayrl.utils.config_io import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "configs" / "nemo_layout_grpo.yaml"


def translate(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    out = translate_nemo_layout(raw)
    return out.config, out.unused


def test_keys_with_a_relayrl_meaning_move_there() -> None:
    cfg, unused = translate(
        {
            "cluster": {"gpus_per_node": 4, "num_nodes": 1},
            "logger": {"log_dir": "logs"},
            "checkpointing": {"model_save_format": "safetensors", "save_consolidated": True},
            "policy": {
                "tokenizer": {"chat_template_kwargs": {"enable_thinking": False}},
                "train_micro_batch_size": 32,
                "dtensor_cfg": {"enabled": True, "activation_checkpointing": True, "tensor_parallel_size": 1},
                "generation": {
                    "backend": "vllm",
                    "top_k": -1,
                    "vllm_cfg": {"kv_cache_dtype": "fp8", "precision": "float32", "gpu_memory_utilization": 0.6},
                    "colocated": {"enabled": False, "resources": {"gpus_per_node": 2, "num_nodes": 1}},
                },
            },
        }
    )
    m = MasterConfig.model_validate(cfg)
    assert (m.cluster.workers_per_node, m.cluster.num_nodes, m.logger.log_dir) == (4, 1, "logs")
    assert m.policy.tokenizer.chat_template_kwargs == {"enable_thinking": False}
    assert m.policy.activation_checkpointing is True
    g = m.policy.generation
    assert (g.backend, g.top_k, g.kv_cache_dtype, g.colocated.resources.workers_per_node) == ("hf", None, "fp8", 2)
    assert "checkpointing" not in cfg or cfg["checkpointing"] == {}  # honoured: relayrl writes consolidated safetensors
    assert unused == [
        "policy.dtensor_cfg.enabled",
        "policy.generation.backend=vllm (relayrl's own engine samples)",
        "policy.generation.vllm_cfg",
    ]


def test_async_grpo_keeps_its_keys_and_names_the_engine_only_ones() -> None:
    block = {
        "enabled": True,
        "max_trajectory_age_steps": 2,
        "in_flight_weight_updates": False,
        "max_generation_failures": 0,
        "recompute_kv_cache_after_weight_updates": True,
    }
    cfg, unused = translate({"grpo": {"async_grpo": block}, "data_plane": {"enabled": True}})
    a = MasterConfig.model_validate(cfg).grpo.async_grpo
    assert (a.enabled, a.max_trajectory_age_steps, a.in_flight_weight_updates) == (True, 2, False)
    assert unused == [
        "grpo.async_grpo.max_generation_failures",
        "grpo.async_grpo.recompute_kv_cache_after_weight_updates",
    ]
    with pytest.raises(NemoLayoutError, match=r"^grpo.async_grpo.max_generation_failures=3: relayrl's producer"):
        translate({"grpo": {"async_grpo": {**block, "max_generation_failures": 3}}})
    assert translate({"grpo": {"async_grpo": None}})[0] == {"grpo": {}}  # the single-controller spelling of "off"


def test_warmup_scheduler_list_becomes_relayrl_warmup() -> None:
    linear = {"name": "torch.optim.lr_scheduler.LinearLR", "kwargs": {"start_factor": 0.1, "end_factor": 1.0}}
    linear["kwargs"]["total_iters"] = 50  # type: ignore[index]
    constant = {"name": "torch.optim.lr_scheduler.ConstantLR", "kwargs": {"factor": 1.0, "total_iters": 10**10}}
    cfg, _ = translate({"policy": {"scheduler": [linear, constant, {"milestones": [50]}]}})
    s = MasterConfig.model_validate(cfg).policy.scheduler
    assert (s.name, s.warmup_steps, s.warmup_start_factor) == ("constant", 50, 0.1)
    cfg, _ = translate({"policy": {"scheduler": {**constant}}})
    assert MasterConfig.model_validate(cfg).policy.scheduler.warmup_steps == 0
    for bad in (
        [{**linear, "kwargs": {"start_factor": 0.1, "end_factor": 0.5, "total_iters": 50}}],  # decays: not relayrl's
        [linear, constant, {"milestones": [20]}],  # switches before the warm-up ends
        [{"name": "torch.optim.lr_scheduler.ExponentialLR", "kwargs": {"gamma": 0.9}}],
        {"name": "torch.optim.lr_scheduler.ConstantLR", "kwargs": {}},  # torch's default factor is 1/3
    ):
        with pytest.raises(NemoLayoutError, match=r"^policy\.scheduler: relayrl's schedule is a linear warm-up"):
            translate({"policy": {"scheduler": bad}})


def test_validation_sampling_keys_mean_sampled_validation_or_are_refused() -> None:
    gen = {"temperature": 0.7, "top_p": 1.0, "val_temperature": 0.7, "val_top_p": 1.0, "val_top_k": -1}
    cfg, _ = translate({"policy": {"generation": gen}})
    assert MasterConfig.model_validate(cfg).grpo.val_greedy is False
    with pytest.raises(NemoLayoutError, match=r"^policy\.generation\.val_temperature=0\.3 differs from"):
        translate({"policy": {"generation": {**gen, "val_temperature": 0.3}}})


def test_nemo_chat_template_null_means_concatenation_only_in_that_layout() -> None:
    nemo, _ = translate({"policy": {"tokenizer": {"chat_template": None}, "generation": {"backend": "vllm"}}})
    assert nemo["policy"]["tokenizer"]["chat_template"] == PASSTHROUGH_TEMPLATE
    relayrl = {"policy": {"tokenizer": {"chat_template": None}}}  # relayrl's own null: the tokenizer's template
    assert translate(relayrl) == (relayrl, [])
    default, _ = translate({"policy": {"tokenizer": {"chat_template": "default"}, "dtensor_cfg": {"_v2": True}}})
    assert "chat_template" not in default["policy"]["tokenizer"]


@pytest.mark.parametrize(
    ("raw", "line"),
    [
        ({"policy": {"dtensor_cfg": {"tensor_parallel_size": 2}}}, "policy.dtensor_cfg.tensor_parallel_size=2: "),
        ({"policy": {"dtensor_cfg": {"lora_cfg": {"enabled": True}}}}, "policy.dtensor_cfg.lora_cfg.enabled=true: "),
        ({"policy": {"megatron_cfg": {"enabled": True}}}, "policy.megatron_cfg.enabled=true: relayrl has no Megatron"),
        ({"policy": {"generation": {"vllm_cfg": {"precision": "fp8"}}}}, "policy.generation.vllm_cfg.precision='fp8'"),
        ({"policy": {"generation": {"vllm_cfg": {"max_model_len": 32}}}}, "policy.generation.vllm_cfg.max_model_len"),
        ({"checkpointing": {"model_save_format": "torch_save"}}, "checkpointing.model_save_format='torch_save': "),
        ({"reward_penalties": {"penalize_unwanted_tokens": True}}, "reward_penalties.penalize_unwanted_tokens=True"),
        ({"data": {"train": {"dataset_name": "squad"}}}, "data.train.dataset_name='squad': relayrl knows NeMo RL's"),
        ({"on_policy_distillation": {"teachers": []}}, "on_policy_distillation={'teachers': []}: "),
        ({"cluster": {"gpus_per_node": 2, "workers_per_node": 1}}, "cluster.gpus_per_node (2) and cluster.workers"),
        ({"policy": {"precision": "${nope.key}"}}, "policy.precision: ${nope.key} names nope.key, which the config"),
    ],
)
def test_values_relayrl_cannot_honour_are_refused_with_one_line(raw: dict[str, Any], line: str) -> None:
    with pytest.raises(NemoLayoutError) as exc:
        translate(raw)
    assert str(exc.value).startswith(line) and "\n" not in str(exc.value), str(exc.value)


def test_keys_in_neither_layout_stay_refused(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("policy:\n  dtensor_cfg:\n    enabled: true\n  generation:\n    backend: vllm\n  modle_name: x\n")
    with pytest.raises(ConfigError, match=r"^unknown config key: policy\.modle_name$"):
        load_config(path)


def test_relayrl_configs_pass_through_unchanged() -> None:
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        raw.pop("defaults", None)
        if path != EXAMPLE:
            assert translate(raw) == (raw, []), path.name
    dumped = MasterConfig().model_dump(mode="json")  # what a run directory records
    assert translate(dumped) == (dumped, [])


def test_the_unused_notice_is_one_line_printed_once(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setattr(config_io, "_ANNOUNCED", set())
    first = load_config(EXAMPLE)
    err = capsys.readouterr().err
    assert err.count("not used by relayrl: ") == 1 and err.count("\n") == 1, err
    line = err.strip()
    assert "policy.generation.backend=vllm (relayrl's own engine samples)" in line
    for key in ("policy.megatron_cfg", "policy.generation.vllm_cfg", "policy.dtensor_cfg.{", "logger.{monitor_gpus"):
        assert key in line, key
    assert load_config(EXAMPLE) == first and capsys.readouterr().err == ""  # the same process: not again
    assert notice_line(["a.b.c", "a.b.d", "x"]) == "not used by relayrl: a.b.{c,d}, x"


def test_example_maps_to_the_intended_relayrl_run() -> None:
    cfg = load_config(EXAMPLE)
    p = cfg.policy
    assert p.model_name == "builtin:tiny-arith" and p.tokenizer.name == "builtin:tiny-arith"
    assert (p.scheduler.name, p.scheduler.warmup_steps, p.scheduler.warmup_start_factor) == ("constant", 10, 0.1)
    assert p.sequence_packing.enabled and p.sequence_packing.train_mb_tokens == 64 * 64
    assert p.generation.backend == "hf" and cfg.cluster.workers_per_node == 1 and not cfg.data_plane.enabled
    assert cfg.grpo.use_leave_one_out_baseline and cfg.grpo.adv_estimator.use_leave_one_out_baseline
    assert cfg.data.train.default_task == "math" and cfg.loss_fn.reference_policy_kl_penalty == 0.01
