"""NeMo RL values read with NeMo RL's meaning: `model_save_format: null`, `max_new_tokens` at the sequence length
(a cap), the PPO keys (dynamic sampling, batch_multiplier, async PPO, critic epochs, the critic's DTensor block,
optimizer kwargs and list schedules), and `dapo_math_verify` scoring as DAPO's check does."""

from __future__ import annotations

from typing import Any

import pytest

from relayrl.config import MasterConfig, MathEnvConfig
from relayrl.config.nemo_base import NemoLayoutError
from relayrl.config.nemo_layout import translate_nemo_layout
from relayrl.environments.dapo_verify import dapo_score, normalize_final_answer
from relayrl.environments.math_env import MathEnvironment

NEMO = {"cluster": {"gpus_per_node": 1}}  # marks the NeMo RL layout
CONSTANT = [{"name": "torch.optim.lr_scheduler.ConstantLR", "kwargs": {"factor": 1.0, "total_iters": 10**10}}]
PPO: dict[str, Any] = {
    "ppo": {"ppo_epochs": 2, "critic_ppo_epochs": 2, "use_dynamic_sampling": False, "batch_multiplier": 1},
    "value": {
        "model_name": "builtin:tiny-arith",
        "tokenizer": {"name": "builtin:tiny-arith", "chat_template_kwargs": None},
        "optimizer": {"kwargs": {"lr": 1e-5, "foreach": False, "fused": False}},
        "scheduler": [*CONSTANT, {"milestones": []}],
        "dtensor_cfg": {"enabled": True, "activation_checkpointing": True, "tensor_parallel_size": 1},
        "reward_model_cfg": {"enabled": True, "reward_model_type": "regression"},
        "make_sequence_length_divisible_by": 1,
    },
    "value_loss_fn": {"cliprange": 0.2},
    "policy": {"dtensor_cfg": {"enabled": True}},
}


def load(raw: dict[str, Any]) -> MasterConfig:
    return MasterConfig.model_validate(translate_nemo_layout({**NEMO, **raw}).config)


def test_model_save_format_null_is_relayrl_default() -> None:
    assert load({"checkpointing": {"model_save_format": None}}).checkpointing == MasterConfig().checkpointing


def test_max_new_tokens_at_the_sequence_length_is_a_cap() -> None:
    cfg = load({"policy": {"max_total_sequence_length": 64, "generation": {"max_new_tokens": 64}}})
    assert (cfg.policy.generation.max_new_tokens, cfg.max_prompt_length) == (63, 63)
    given = load({"policy": {"max_total_sequence_length": 64, "generation": {"max_new_tokens": 64}}, "data": {}})
    assert given.policy.generation.max_new_tokens == 63
    kept = load({"policy": {"generation": {"max_new_tokens": 64}}, "data": {"max_input_seq_length": 20}})
    assert kept.data.max_input_seq_length == 20
    with pytest.raises(ValueError, match="must be < policy.max_total_sequence_length"):  # relayrl's layout: unchanged
        MasterConfig.model_validate({"policy": {"max_total_sequence_length": 64, "generation": {"max_new_tokens": 64}}})


def test_a_nemo_ppo_config_maps_its_keys() -> None:
    out = translate_nemo_layout({**NEMO, **PPO})
    cfg = MasterConfig.model_validate(out.config)
    assert cfg.algorithm == "ppo" and cfg.ppo.ppo_epochs == 2
    assert (cfg.value.scheduler.name, cfg.value.activation_checkpointing, cfg.value_loss_fn.value_clip) == (
        "constant",
        True,
        0.2,
    )
    assert "value.optimizer.kwargs.foreach" in out.unused
    assert (cfg.ppo.use_dynamic_sampling, cfg.ppo.batch_multiplier) == (False, 1)  # relayrl's PPO keys too


def test_nemo_ppo_dynamic_sampling_is_relayrls() -> None:
    """`ppo.use_dynamic_sampling`, its generation-batch limit and `batch_multiplier` pass through with GRPO's
    meaning; the loader then draws num_prompts_per_step x batch_multiplier prompts per generation batch."""
    keys = {"use_dynamic_sampling": True, "dynamic_sampling_max_gen_batches": 3, "batch_multiplier": 2}
    cfg = load({**PPO, "ppo": {**PPO["ppo"], **keys}})
    assert (cfg.ppo.dynamic_sampling_max_gen_batches, cfg.rollout.prompts_per_batch) == (
        3,
        2 * cfg.ppo.num_prompts_per_step,
    )
    with pytest.raises(ValueError, match="ppo.batch_multiplier must be 1 unless ppo.use_dynamic_sampling is true"):
        load({**PPO, "ppo": {**PPO["ppo"], "batch_multiplier": 2}})
    with pytest.raises(ValueError, match="ppo.use_dynamic_sampling=true needs ppo.num_generations_per_prompt >= 2"):
        MasterConfig.model_validate(
            {
                "algorithm": "ppo",
                "ppo": {"use_dynamic_sampling": True, "num_generations_per_prompt": 1, "num_prompts_per_step": 128},
            }
        )


@pytest.mark.parametrize(
    ("ppo", "line"),
    [
        ({"async_ppo": {"enabled": True}}, "ppo.async_ppo.enabled=true: relayrl's asynchronous trainer"),
        ({"critic_ppo_epochs": 3}, "ppo.critic_ppo_epochs=3: relayrl trains the critic"),
        ({"warm_start_value_checkpoint": "/ckpt/step_5"}, "ppo.warm_start_value_checkpoint='/ckpt/step_5': relayrl"),
    ],
)
def test_ppo_keys_relayrl_cannot_honour_are_refused(ppo: dict[str, Any], line: str) -> None:
    with pytest.raises(NemoLayoutError) as exc:
        translate_nemo_layout({**NEMO, **PPO, "ppo": {**PPO["ppo"], **ppo}})
    assert str(exc.value).startswith(line) and exc.value.key == line.split("=", 1)[0]


def test_dapo_math_verify_is_the_dapo_answer_check() -> None:
    assert dapo_score("work... Answer: $\\frac12$", "\\frac{1}{2}") == (1.0, "\\frac{1}{2}")
    assert dapo_score("Answer: 1,000 dollars", "1000")[0] == 1.0
    assert dapo_score("\\boxed{7}", "7") == (0.0, None)  # DAPO reads `Answer:` lines, not boxes
    assert dapo_score("Answer: 3\n" + "x" * 400, "3") == (0.0, None)  # only the last 300 characters count
    assert normalize_final_answer("x = \\text{5 units}") == "5"
    env = MathEnvironment(MathEnvConfig(math_verify_impl="dapo_math_verify"))
    rewards, answers, counts = env.score_batch(["Answer: 12", "Answer: 13"], ["12", "12"])
    assert (rewards, answers, sum(counts.values())) == ([1.0, 0.0], ["12", "13"], 0)
    env.shutdown()
