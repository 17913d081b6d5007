"""NeMo RL's config layout (the one its `grpo_math_1B.yaml` uses) read into relayrl's.

The config loader runs `translate_nemo_layout` on every raw config before pydantic validation. Every rule acts on a
key only NeMo RL's layout has, so a relayrl config passes through unchanged. Each such key ends one of three ways:

* mapped: it has a relayrl meaning and moves there (`cluster.gpus_per_node` -> `cluster.workers_per_node`,
  `policy.dtensor_cfg.activation_checkpointing` -> `policy.activation_checkpointing`, a LinearLR warm-up list ->
  `policy.scheduler`, `vllm_cfg.kv_cache_dtype: fp8` -> `policy.generation.kv_cache_dtype`, ...);
* not used: it only describes something relayrl does not have (vLLM, Megatron, DTensor sharding, GPU monitors, ...)
  and cannot change results: dropped, and named in the one "not used by relayrl: ..." line (`Translation.unused`);
* refused: a value that would change results and relayrl cannot honour (LoRA, tensor parallelism, a Megatron
  backend, a Hugging Face dataset name): `NemoLayoutError`, one line naming the key and the fix.

Keys in neither layout are left for pydantic, which refuses them as unknown. docs/nemo_rl_configs.md has the table.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

from relayrl.config.interpolation import has_interpolation, resolve_interpolations

__all__ = ["NemoLayoutError", "Translation", "notice_line", "translate_nemo_layout"]

#: NeMo RL's `tokenizer.chat_template: null`: the message contents concatenated, no template markup.
PASSTHROUGH_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
_OFF: tuple[Any, ...] = (None, False, 0, {}, [], "")  # a feature left off
_ONE = (None, 1)  # a parallel size that means "none"
_LR = "torch.optim.lr_scheduler."
#: NeMo RL's `policy.dtensor_cfg` keys that only describe its DTensor sharding (accepted as not used).
_DTENSOR_KEYS = frozenset(
    "_v2 enabled cpu_offload sequence_parallel automodel_kwargs expert_parallel_size defer_fsdp_grad_sync "
    "moe_parallelizer env_vars clear_cache_every_n_steps".split()
)


#: `get`'s default when `has` asks: no config value is this object.
_ABSENT = object()


class NemoLayoutError(ValueError):
    """A NeMo RL key whose value would change results and relayrl cannot honour (one line: the key and the fix)."""


@dataclasses.dataclass
class Translation:
    config: dict[str, Any]
    """The config in relayrl's layout (still to be validated)."""
    unused: list[str]
    """NeMo RL keys accepted and not used, in the order met (a block is named once)."""


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
    cfg = copy.deepcopy(raw)
    if has_interpolation(cfg):
        try:
            cfg = resolve_interpolations(cfg)
        except ValueError as exc:
            raise NemoLayoutError(str(exc)) from None
    t = _Translator(cfg)
    t.run()
    return Translation(t.cfg, t.unused)


class _Translator:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.unused: list[str] = []
        self.section = str(cfg.get("algorithm", "grpo"))  # the rollout block: grpo or ppo

    # ------------------------------------------------------------------ primitives
    def has(self, key: str) -> bool:
        return self.get(key, _ABSENT) is not _ABSENT

    def get(self, key: str, default: Any = None) -> Any:
        node: Any = self.cfg
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def pop(self, key: str) -> Any:
        *parents, leaf = key.split(".")
        node: Any = self.cfg
        for part in parents:
            node = node[part]
        return node.pop(leaf)

    def put(self, key: str, value: Any, source: str) -> None:
        """Set relayrl's `key` from NeMo RL's `source`, unless the config already sets it to something else."""
        if self.has(key) and self.get(key) != value:
            raise NemoLayoutError(f"{source} ({value!r}) and {key} ({self.get(key)!r}) disagree; set one of them")
        *parents, leaf = key.split(".")
        node = self.cfg
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[leaf] = value

    def move(self, source: str, target: str) -> None:
        if self.has(source):
            self.put(target, self.pop(source), source)

    def drop(self, *keys: str, allowed: tuple[Any, ...] | None = None, why: str = "") -> None:
        """Accept `keys` as not used (any value, or only `allowed` ones: another is refused with `why`)."""
        for key in keys:
            if not self.has(key):
                continue
            value = self.get(key)
            if allowed is not None and value not in allowed:
                raise NemoLayoutError(f"{key}={value!r}: {why}")
            self.pop(key)
            self.unused.append(key)

    def block(self, key: str, *, enabled: str = "enabled", why: str = "") -> None:
        """A whole block relayrl lacks: not used while its `enabled` flag is off, refused when on."""
        if not self.has(key):
            return
        value = self.get(key)
        if isinstance(value, dict) and value.get(enabled) not in _OFF:
            raise NemoLayoutError(f"{key}.{enabled}=true: {why}")
        if not isinstance(value, dict) and value not in _OFF:
            raise NemoLayoutError(f"{key} is set: {why}")
        self.pop(key)
        self.unused.append(key)

    def require(self, key: str, allowed: tuple[Any, ...], why: str) -> None:
        """A key relayrl honours only at `allowed` values (where it needs no key of its own): dropped there."""
        if self.has(key):
            value = self.get(key)
            if value not in allowed:
                raise NemoLayoutError(f"{key}={value!r}: {why}")
            self.pop(key)

    # ------------------------------------------------------------------ rules
    def run(self) -> None:
        before = copy.deepcopy(self.cfg)
        self._infra()
        self._policy()
        self._generation()
        self._rollout()
        self._data()
        if self.cfg != before or self.unused:  # a NeMo RL config: its `chat_template: null` means concatenation
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
        self.require("checkpointing.model_save_format", ("safetensors",), "relayrl writes safetensors checkpoints only")
        self.require("checkpointing.save_consolidated", (True, False), "must be true or false")  # always consolidated
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
        self.drop(f"{p}.optimizer.kwargs.foreach", f"{p}.optimizer.kwargs.fused")
        self.block(f"{p}.megatron_cfg", why="relayrl has no Megatron backend; use policy.dtensor_cfg (or remove both)")
        self.block(f"{p}.draft", why="relayrl trains no Eagle draft model; set policy.draft.enabled=false")
        d = f"{p}.dtensor_cfg"
        if self.has(d):
            self.move(f"{d}.activation_checkpointing", f"{p}.activation_checkpointing")
            for what in ("tensor", "context", "expert"):
                self.require(
                    f"{d}.{what}_parallel_size",
                    _ONE,
                    f"relayrl has no {what} parallelism; set 1 (scale with cluster.gpus_per_node: data parallelism)",
                )
            self.require(f"{d}.dp_replicate_size", _ONE, "relayrl has no HSDP replication; set 1")
            self.require(f"{d}.custom_parallel_plan", (None,), "relayrl has no tensor parallelism; set null")
            self.block(f"{d}.lora_cfg", why="relayrl has no LoRA; set policy.dtensor_cfg.lora_cfg.enabled=false")
            for key in list(self.get(d)):
                if key not in _DTENSOR_KEYS:  # in neither layout
                    raise NemoLayoutError(f"unknown config key: {d}.{key}")
                self.drop(f"{d}.{key}")
            self.pop(d)
        self._scheduler(f"{p}.scheduler")

    def _scheduler(self, key: str) -> None:
        """NeMo RL's torch scheduler list (LinearLR warm-up, then ConstantLR at factor 1) as relayrl's warm-up."""
        value = self.get(key)
        items = value if isinstance(value, list) else [value] if isinstance(value, dict) and "kwargs" in value else None
        if items is None:
            return
        why = (
            f"{key}: relayrl's schedule is a linear warm-up (LinearLR to end_factor 1.0) then constant or cosine; "
            "write it as policy.scheduler.{name, warmup_steps, warmup_start_factor}"
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

    def _data(self) -> None:
        if self.has("data.train.dataset_name"):
            raise NemoLayoutError(
                f"data.train.dataset_name={self.get('data.train.dataset_name')!r}: relayrl reads local files; set "
                "data.train.source=file and data.train.path (or remove data.train for the built-in arithmetic task)"
            )
        seed = self.get(f"{self.section}.seed", 42)
        self.drop("data.train.seed", allowed=(seed,), why=f"relayrl splits with {self.section}.seed; make them equal")
        self.drop("data.use_multiple_dataloader", allowed=_OFF, why="relayrl has one train loader; set false")
        d = "data.default"
        if not self.has(d):
            return
        for key, target in (("prompt_file", "data.prompt_template"), ("system_prompt_file", "data.system_prompt")):
            path = self.get(f"{d}.{key}")
            if path is not None:
                if not Path(str(path)).expanduser().is_file():
                    raise NemoLayoutError(f"{d}.{key}: no such file {path}")
                text = Path(str(path)).expanduser().read_text()
                self.put(target, text.replace("{}", "{problem}") if key == "prompt_file" else text, f"{d}.{key}")
            if self.has(f"{d}.{key}"):
                self.pop(f"{d}.{key}")
        self.require(
            f"{d}.processor", ("math_hf_data_processor",), "relayrl renders prompts as math_hf_data_processor does"
        )
        if self.has(f"{d}.env_name"):
            self.put("data.train.default_task", self.pop(f"{d}.env_name"), f"{d}.env_name")
        if self.get(d) == {}:
            self.pop(d)
