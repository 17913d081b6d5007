"""NeMo RL's config layout (the one its `grpo_math_1B.yaml` uses) read into relayrl's.

The config loader runs `translate_nemo_layout` on every raw config before pydantic validation. Every rule acts on a
key only NeMo RL's layout has, so a relayrl config passes through unchanged. Each such key ends one of three ways:

* mapped: it has a relayrl meaning and moves there (`cluster.gpus_per_node` -> `cluster.workers_per_node`,
  `policy.dtensor_cfg.activation_checkpointing` -> `policy.activation_checkpointing`, a LinearLR warm-up list ->
  `policy.scheduler`, `vllm_cfg.kv_cache_dtype: fp8` -> `policy.generation.kv_cache_dtype`, ...);
* not used: it only describes something relayrl does not have (vLLM, Megatron, DTensor sharding, GPU monitors, ...)
  and cannot change results: dropped, and named in the one "not used by relayrl: ..." line (`Translation.unused`);
* refused: a value that would change results and relayrl cannot honour (LoRA, tensor parallelism, a Megatron
  backend, async PPO): `NemoLayoutError`, one line naming the key and the fix.

The `data` block has its own module (`nemo_data`: named datasets, ResponseDataset, `data.default`), the primitives
and their records theirs (`nemo_base`), and `nemo_show` classifies every key for `relayrl config show`. Keys in
neither layout are left for pydantic, which refuses them as unknown. docs/nemo_rl_configs.md has the tables.
"""

from __future__ import annotations

import copy
from typing import Any

from relayrl.config.interpolation import has_interpolation, resolve_interpolations
from relayrl.config.nemo_base import OFF as _OFF
from relayrl.config.nemo_base import NemoLayoutError, Rules, Translation
from relayrl.config.nemo_data import translate_data

__all__ = ["NemoLayoutError", "Translation", "notice_line", "translate_nemo_layout"]

#: NeMo RL's `tokenizer.chat_template: null`: the message contents concatenated, no template markup.
PASSTHROUGH_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
_ONE = (None, 1)  # a parallel size that means "none"
_LR = "torch.optim.lr_scheduler."
#: NeMo RL's `policy.dtensor_cfg` keys that only describe its DTensor sharding (accepted as not used).
_DTENSOR_KEYS = frozenset(
    "_v2 enabled cpu_offload sequence_parallel automodel_kwargs expert_parallel_size defer_fsdp_grad_sync "
    "moe_parallelizer env_vars clear_cache_every_n_steps single_rank_consolidation consolidation_timeout_minutes".split()
)
#: Keys whose presence marks a NeMo RL config (relayrl has none of them): there `ppo:` alone means algorithm ppo.
_NEMO_MARKERS = ("policy.dtensor_cfg", "policy.megatron_cfg", "cluster.gpus_per_node", "value.dtensor_cfg")


def notice_line(unused: list[str]) -> str:
    """The one line naming every accepted but unused key, leaves of one block grouped as `block.{a,b}`."""
    groups: dict[str, list[str]] = {}
    for key in unused:
        head, _, leaf = key.rpartition(".") if "=" not in key and "." in key else (key, "", "")
        groups.setdefault(head, []).append(leaf)
    parts = []
    for head, leaves in groups.items():
        named = [leaf for leaf in leaves if leaf]
        if not named:
            parts.append(head)
        else:
            parts.append(f"{head}.{named[0]}" if len(named) == 1 else f"{head}.{{{','.join(named)}}}")
    return "not used by relayrl: " + ", ".join(parts)


def translate_nemo_layout(raw: dict[str, Any]) -> Translation:
    """`raw` with NeMo RL's keys mapped or dropped (see the module docstring); raises NemoLayoutError."""
    cfg = resolved(raw)
    t = _Translator(cfg)
    t.run()
    return Translation(t.cfg, t.unused, t.mapped)


def resolved(raw: dict[str, Any]) -> dict[str, Any]:
    """A copy of `raw` with its `${...}` interpolations resolved (NemoLayoutError naming a bad one)."""
    cfg = copy.deepcopy(raw)
    if has_interpolation(cfg):
        try:
            cfg = resolve_interpolations(cfg)
        except ValueError as exc:
            raise NemoLayoutError(str(exc)) from None
    return cfg


def _section(cfg: dict[str, Any]) -> str:
    """The rollout block: `algorithm`, else ppo for a NeMo RL config holding only a `ppo:` block (NeMo RL has no
    `algorithm` key: its PPO examples are recognised by that block)."""
    if "algorithm" in cfg:
        return str(cfg["algorithm"])
    probe = Rules(cfg)
    if "ppo" in cfg and "grpo" not in cfg and any(probe.has(k) for k in _NEMO_MARKERS):
        cfg["algorithm"] = "ppo"
        return "ppo"
    return "grpo"


class _Translator(Rules):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__(cfg)
        self.section = _section(cfg)  # the rollout block: grpo or ppo

    # ------------------------------------------------------------------ rules
    def run(self) -> None:
        before = copy.deepcopy(self.cfg)
        self._infra()
        self._policy()
        self._generation()
        self._rollout()
        self._value()
        self._data()
        if self.cfg != before or self.unused:  # a NeMo RL config: its `chat_template: null` means concatenation
            self._length_cap()
            period = f"{self.section}.val_period"
            if isinstance(self.get(period), int) and self.get(period) < 0:  # NeMo RL's "no periodic validation"
                self.pop(period)
                self.put(period, 0, period)
                self.mapped[period] = f"{period}: 0 (no periodic validation, as NeMo RL's negative value means)"
            tok = "policy.tokenizer.chat_template"
            if self.has(tok) and self.get(tok) is None:
                self.pop(tok)
                self.put(tok, PASSTHROUGH_TEMPLATE, tok)
            elif self.get(tok) == "default":  # the tokenizer's own template: relayrl's unset
                self.pop(tok)

    def _infra(self) -> None:
        self.move("cluster.gpus_per_node", "cluster.workers_per_node")
        self.drop("cluster.master_port_range_low", "cluster.master_port_range_high", "cluster.segment_size")
        self.drop("logger.monitor_gpus", "logger.gpu_monitoring", "logger.swanlab_enabled", "logger.swanlab")
        self.drop("logger.tensorboard", "logger.wandb.log_nemo_gym_full_result_tables")
        self.require(  # null: NeMo RL's own default, which relayrl's safetensors checkpoints are too
            "checkpointing.model_save_format", ("safetensors", None), "relayrl writes safetensors checkpoints only"
        )
        self.require("checkpointing.save_consolidated", (True, False), "must be true or false")  # always consolidated
        self.require(
            "checkpointing.resume_if_exists",
            (True, None),
            "relayrl resumes a run directory that holds checkpoints; give a new --run-dir to start fresh",
            met="met: relayrl resumes a run directory that holds checkpoints",
        )
        self.drop(
            *(f"checkpointing.{k}" for k in ("ft_save_period", "ft_keep_latest_k", "pretrained_checkpoint")),
            *(f"checkpointing.{k}" for k in ("model_cache_dir", "model_repo_id", "is_peft", "peft_config")),
            "checkpointing.is_async",
            allowed=_OFF,
            why="relayrl has no fault-tolerance saving, Megatron checkpoints, PEFT or async saving; remove the key",
        )
        self.drop("on_policy_distillation", allowed=(None,), why="relayrl has no on-policy distillation; set null")
        for key in ("penalize_duplicated_reasoning", "penalize_empty_final_answer", "penalize_unwanted_tokens"):
            self.drop(f"reward_penalties.{key}", allowed=_OFF, why="a NeMo-Gym reward penalty; set false")
        self.drop("reward_penalties.penalize_malformed_think_tag", allowed=_OFF, why="a NeMo-Gym penalty; set false")
        self.drop("reward_penalties.token_ids", allowed=_OFF, why="a NeMo-Gym penalty's tokens; set null")
        self.drop("env.math.num_workers")  # relayrl verifies in a worker pool of its own
        self.require("env.math.verifier_type", ("math",), "relayrl's math environment verifies math answers only")
        dp = "data_plane"
        self.drop(f"{dp}.impl", f"{dp}.claim_meta_poll_interval_s", f"{dp}.global_segment_size")
        self.drop(f"{dp}.local_buffer_size", f"{dp}.controller_address", f"{dp}.ack_timeout_ms", f"{dp}.observability")
        if self.get(f"{dp}.backend") in ("simple", "mooncake_cpu"):  # TransferQueue's stores; relayrl picks its own
            self.drop(f"{dp}.backend")

    def _policy(self) -> None:
        p = "policy"
        self.drop(f"{p}.tokenizer.use_fastokens", f"{p}.generation_batch_size", f"{p}.offload_optimizer_for_logprob")
        self.block(f"{p}.draft", why="relayrl trains no Eagle draft model; set policy.draft.enabled=false")
        self._model(p)

    def _model(self, p: str) -> None:
        """What the policy and (PPO) value blocks share: the DTensor and Megatron blocks, optimizer and schedule."""
        self.drop(f"{p}.optimizer.kwargs.foreach", f"{p}.optimizer.kwargs.fused")  # kernels only: same numbers
        self.block(f"{p}.megatron_cfg", why=f"relayrl has no Megatron backend; use {p}.dtensor_cfg (or remove both)")
        d = f"{p}.dtensor_cfg"
        if self.has(d):
            self.move(f"{d}.activation_checkpointing", f"{p}.activation_checkpointing")
            for what in ("tensor", "context", "expert"):
                self.require(
                    f"{d}.{what}_parallel_size",
                    _ONE,
                    f"relayrl has no {what} parallelism; set 1 (scale with cluster.gpus_per_node: data parallelism)",
                    met="met: 1 (relayrl has no model parallelism)",
                )
            self.require(
                f"{d}.dp_replicate_size", _ONE, "relayrl has no HSDP replication; set 1", met="met: 1 (no replication)"
            )
            self.require(f"{d}.custom_parallel_plan", (None,), "relayrl has no tensor parallelism; set null")
            self.require(f"{d}.model_save_format", ("safetensors", None), "relayrl writes safetensors checkpoints only")
            self.drop(f"{d}.save_consolidated")  # relayrl's checkpoints are consolidated Hugging Face directories
            self.block(f"{d}.lora_cfg", why=f"relayrl's LoRA is policy.lora; set {d}.lora_cfg.enabled=false")
            for key in list(self.get(d)):
                if key not in _DTENSOR_KEYS:  # in neither layout
                    raise NemoLayoutError(f"unknown config key: {d}.{key}", f"{d}.{key}")
                self.drop(f"{d}.{key}")
            self.pop(d)
        self._scheduler(f"{p}.scheduler")

    def _value(self) -> None:
        """PPO's critic in NeMo RL's layout: its tokenizer is the policy's, its head a regression (relayrl's)."""
        v = "value"
        if self.section != "ppo" or not isinstance(self.get(v), dict):
            return
        self._model(v)
        tok = self.get(f"{v}.tokenizer")
        nemo = any(self.has(k) for k in (*_NEMO_MARKERS, "value.megatron_cfg", "value.reward_model_cfg"))
        if isinstance(tok, dict) and nemo:  # relayrl's own layout refuses value.tokenizer in its validation
            same = tok.get("name") in (None, self.get(f"{v}.model_name"), self.get("policy.tokenizer.name"))
            if not same or tok.get("chat_template_kwargs") is not None or set(tok) - {"name", "chat_template_kwargs"}:
                raise NemoLayoutError(
                    f"{v}.tokenizer: the critic scores the policy's token ids with policy.tokenizer; remove it", v
                )
            self.pop(f"{v}.tokenizer")
            self.mapped[f"{v}.tokenizer"] = "met: the critic reads the policy's tokens"
        rm = self.get(f"{v}.reward_model_cfg")
        if isinstance(rm, dict) and rm.get("reward_model_type", "regression") != "regression":
            raise NemoLayoutError(f"{v}.reward_model_cfg.reward_model_type: relayrl's critic is a regression head", v)
        self.drop(f"{v}.reward_model_cfg")
        self.require(f"{v}.make_sequence_length_divisible_by", _ONE, "relayrl pads to no multiple; set 1")
        self.move("value_loss_fn.cliprange", "value_loss_fn.value_clip")

    def _scheduler(self, key: str) -> None:
        """NeMo RL's torch scheduler list (LinearLR warm-up, then ConstantLR at factor 1) as relayrl's warm-up."""
        value = self.get(key)
        items = value if isinstance(value, list) else [value] if isinstance(value, dict) and "kwargs" in value else None
        if items is None:
            return
        why = (
            f"{key}: relayrl's schedule is a linear warm-up (LinearLR to end_factor 1.0) then constant or cosine; "
            f"write it as {key}" + ".{name, warmup_steps, warmup_start_factor}"
        )
        milestones = [it["milestones"] for it in items if isinstance(it, dict) and "milestones" in it]
        steps = [it for it in items if isinstance(it, dict) and "milestones" not in it]
        names = [str(it.get("name", "")).removeprefix(_LR) for it in steps]
        kwargs = [dict(it.get("kwargs") or {}) for it in steps]
        out: dict[str, Any] = {"name": "constant"}
        if names and names[0] == "LinearLR":
            lin = kwargs.pop(0)
            names.pop(0)
            if float(lin.get("end_factor", 1.0)) != 1.0 or "total_iters" not in lin:
                raise NemoLayoutError(why)
            out.update(warmup_steps=int(lin["total_iters"]), warmup_start_factor=float(lin.get("start_factor", 1 / 3)))
            if names and milestones != [[out["warmup_steps"]]]:
                raise NemoLayoutError(why)
        if names != ["ConstantLR"] * len(names) or any(float(k.get("factor", 1 / 3)) != 1.0 for k in kwargs):
            raise NemoLayoutError(why)
        self.pop(key)
        self.put(key, out, key)

    def _generation(self) -> None:
        g = "policy.generation"
        backend = self.get(f"{g}.backend")
        if backend == "vllm":
            self.pop(f"{g}.backend")
            self.unused.append(f"{g}.backend=vllm (relayrl's own engine samples)")
        elif backend == "megatron":
            raise NemoLayoutError(f"{g}.backend=megatron: relayrl has no Megatron inference; set vllm or hf")
        v = f"{g}.vllm_cfg"
        if self.has(v):
            kv = self.get(f"{v}.kv_cache_dtype", "auto")
            if str(kv).startswith("fp8"):
                self.put(f"{g}.kv_cache_dtype", "fp8", f"{v}.kv_cache_dtype")
            elif kv not in ("auto", None):
                raise NemoLayoutError(f"{v}.kv_cache_dtype={kv!r}: relayrl's KV cache is auto or fp8")
            precision = self.get(f"{v}.precision")
            if precision not in (None, self.get("policy.precision", "float32")):
                raise NemoLayoutError(
                    f"{v}.precision={precision!r}: relayrl generates in policy.precision; remove it or make them equal"
                )
            max_len = self.get(f"{v}.max_model_len")
            if max_len is not None and int(max_len) < int(self.get("policy.max_total_sequence_length", 64)):
                raise NemoLayoutError(
                    f"{v}.max_model_len={max_len} is below policy.max_total_sequence_length: relayrl generates up to "
                    "the latter; make them equal"
                )
            if self.get(f"{v}.logprobs_mode", "processed_logprobs") != "processed_logprobs":
                raise NemoLayoutError(f"{v}.logprobs_mode: relayrl returns processed_logprobs only")
            self.drop(v)
        for key in ("vllm_kwargs", "mcore_generation_config", "refit_cfg", "refit_transport", "model_name"):
            self.drop(f"{g}.{key}")
        self.drop(f"{g}.real_quant_export_cpu_offload", f"{g}.port_range_low", f"{g}.port_range_high")
        self.drop(f"{g}._pad_token_id")
        if self.get(f"{g}.top_k") == -1:  # -1 and null both mean no top-k filter
            self.pop(f"{g}.top_k")
            self.put(f"{g}.top_k", None, f"{g}.top_k")
        self.move(f"{g}.colocated.resources.gpus_per_node", f"{g}.colocated.resources.workers_per_node")
        self._validation_sampling(g)

    def _validation_sampling(self, g: str) -> None:
        """NeMo RL validates with val_temperature / val_top_p / val_top_k, which must equal the training values:
        relayrl then validates by sampling with those (`val_greedy: false`)."""
        train = {"temperature": 1.0, "top_p": 1.0, "top_k": None}
        present = [k for k in train if self.has(f"{g}.val_{k}")]
        for k in present:
            value = self.pop(f"{g}.val_{k}")
            value = None if k == "top_k" and value == -1 else value
            if value != self.get(f"{g}.{k}", train[k]):
                raise NemoLayoutError(
                    f"{g}.val_{k}={value!r} differs from {g}.{k}: relayrl validates with the training sampling "
                    f"settings or greedily ({self.section}.val_greedy); remove it"
                )
        if present:
            self.put(f"{self.section}.val_greedy", False, f"{g}.val_{present[0]}")

    def _rollout(self) -> None:
        r = self.section
        self.drop(f"{r}.calculate_advantages_on_gpu", f"{r}.debug_payload_metrics", f"{r}.deduplicate_multimodal_data")
        self.drop(f"{r}.adv_estimator.reward_weights", allowed=(None,), why="relayrl has no GDPO; set null")
        a = f"{r}.async_grpo"  # enabled, max_trajectory_age_steps and in_flight_weight_updates are relayrl's keys too
        self.drop(
            f"{a}.max_generation_failures",
            allowed=(0,),
            why="relayrl's producer ends the run at its first failure, with the command that resumes; set 0",
        )
        # relayrl refits its generator between batches, so no KV cache ever outlives its weights: either value holds
        self.drop(f"{a}.recompute_kv_cache_after_weight_updates")
        if self.get(a) is None and self.has(a):  # the reference's "no async" spelling
            self.pop(a)
        if r == "ppo":
            self._ppo()

    def _ppo(self) -> None:
        """NeMo RL's PPO keys: dynamic sampling (`use_dynamic_sampling`, `dynamic_sampling_max_gen_batches`,
        `batch_multiplier`) is relayrl's PPO key too and passes through; async PPO is accepted while off and refused
        when on; the critic's epochs must be the policy's (relayrl updates both ppo_epochs times)."""
        r = "ppo"
        self.block(
            f"{r}.async_ppo",
            why="relayrl's asynchronous trainer (grpo.async_grpo) is GRPO's: its producer's partitions hold GRPO's "
            "fields, not the critic's values and returns; set ppo.async_ppo.enabled=false",
        )
        epochs = self.get(f"{r}.ppo_epochs", 1)
        self.require(f"{r}.critic_ppo_epochs", (None, epochs), f"relayrl trains the critic {r}.ppo_epochs times")
        self.drop(f"{r}.warm_start_value_checkpoint", allowed=(None,), why="relayrl starts the critic fresh; set null")

    def _data(self) -> None:
        self.drop("data.use_multiple_dataloader", allowed=_OFF, why="relayrl has one train loader; set false")
        translate_data(self, self.section)
        seed = self.get(f"{self.section}.seed", 42)
        self.drop("data.train.seed", allowed=(seed,), why=f"relayrl splits with {self.section}.seed; make them equal")

    def _length_cap(self) -> None:
        """NeMo RL's `max_new_tokens` is a cap (its examples set it to the whole sequence length): generation stops
        at policy.max_total_sequence_length either way. relayrl caps each row there too and needs max_new_tokens
        below it, so a cap at or above the length becomes length - 1, and prompts may take up to that many tokens
        unless data.max_input_seq_length says otherwise."""
        key, total = "policy.generation.max_new_tokens", int(self.get("policy.max_total_sequence_length", 64))
        if not self.has(key) or int(self.get(key)) < total:
            return
        self.pop(key)
        self.put(key, total - 1, key)
        self.mapped[key] = f"{key}: {total - 1} (a cap at the sequence length, as NeMo RL means it)"
        limit = self.get("data.max_input_seq_length")
        if limit is None or int(limit) >= total:
            self.cfg.setdefault("data", {})["max_input_seq_length"] = total - 1
