"""Prompt datasets and their loaders, over the records of `experience.records` (the arithmetic task, a file, a
`datasets` dataset or rows handed over in Python).

Every row is tokenized when the dataset is built, so an over-long prompt fails at start-up with the row named, not
hours into a run; nothing is truncated. Each item is one prompt in the form the rollout consumes: a message log
whose token ids are exactly the chat-template rendering of the prompt.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import Dataset, Subset
from torchdata.stateful_dataloader import StatefulDataLoader

from relayrl.config import REWARD_FNS_TASK, MasterConfig
from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.experience.chat_render import no_gc_pauses, render_prompts
from relayrl.experience.records import GivenRows, PromptRecord, load_records

_CHUNK = 1024  # prompts rendered and tokenized per call


# ---------------------------------------------------------------------------------------------------- dataset
class PromptDataset(Dataset):
    """Tokenized prompts. Items: `message_log` (one message holding the rendered prompt and all its token ids),
    `length`, `extra_env_info` ({"ground_truth": answer}), `task_name`, `loss_multiplier` 1.0 and `idx`.

    Prompts over `max_prompt_length` tokens raise, or with `skip_overlong_prompts` are dropped and counted in
    `num_skipped_overlong`.
    """

    def __init__(
        self,
        records: list[PromptRecord],
        tokenizer: Any,
        *,
        max_prompt_length: int,
        system_prompt: str | None = None,
        prompt_template: str | None = None,
        skip_overlong_prompts: bool = False,
        name: str = "dataset",
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if not records:
            raise ValueError(f"{name} is empty")
        _check_template(prompt_template)
        self.name = name
        self.num_skipped_overlong = 0
        self._items: list[tuple[str, torch.Tensor, PromptRecord]] = []  # (rendered, ids [P], record)
        self._conversations: dict[int, list[dict[str, str]]] = {}  # item -> its conversation (episode rows)
        conversations = []
        for rec in records:
            if rec.messages is not None:
                messages = [{"role": r, "content": c} for r, c in rec.messages]
            else:
                content = prompt_template.format(problem=rec.prompt) if prompt_template else rec.prompt
                messages = [{"role": "user", "content": content}]
            if system_prompt is not None and messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": system_prompt})
            conversations.append(messages)
        for start, rendered, token_ids in render_prompts(tokenizer, conversations, chat_template_kwargs, _CHUNK):
            for k, (text, ids) in enumerate(zip(rendered, token_ids)):
                n = start + k + 1
                if len(ids) > max_prompt_length:
                    if skip_overlong_prompts:
                        self.num_skipped_overlong += 1
                        continue
                    raise ValueError(
                        f"{name} row {n}: prompt is {len(ids)} tokens, over the limit of {max_prompt_length} "
                        "(data.max_input_seq_length, else policy.max_total_sequence_length - "
                        "policy.generation.max_new_tokens); set data.skip_overlong_prompts to skip such rows"
                    )
                rec = records[n - 1]
                if rec.columns is not None and rec.task != REWARD_FNS_TASK:  # an environment class re-renders it
                    self._conversations[len(self._items)] = conversations[n - 1]
                self._items.append((text, torch.tensor(ids, dtype=torch.long), rec))
        if not self._items:
            raise ValueError(f"{name}: all {len(records)} prompts are over the limit of {max_prompt_length} tokens")
        #: Every task (environment) name the rows use, for building the task -> environment map.
        self.task_names: list[str] = sorted({item[2].task for item in self._items})

    def __len__(self) -> int:
        return len(self._items)

    def fingerprint_items(self) -> list[str]:
        """Each row as its rendered prompt, task and answer: what a resume compares with its checkpoint's data."""
        return [f"{text}\0{rec.task}\0{rec.answer}" for text, _, rec in self._items]

    def __getitem__(self, i: int) -> dict[str, Any]:
        rendered, ids, rec = self._items[i]
        return {
            "message_log": [{"role": "user", "content": rendered, "token_ids": ids.clone()}],
            "length": len(ids),
            "extra_env_info": _env_info(rec, self._conversations.get(i)),
            "task_name": rec.task,
            "loss_multiplier": 1.0,
            "idx": i,
        }


def _env_info(rec: PromptRecord, conversation: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """What the row's environment reads: the answer as `ground_truth`; for reward functions also the prompt as the
    dataset gave it (text, or a list of messages), the other columns and the 1-based source row; for environment
    classes also the conversation (system prompt and template applied) the episode re-renders with its tools."""
    info: dict[str, Any] = {"ground_truth": rec.answer} if rec.answer is not None else {}
    if rec.columns is not None:
        info["prompt"] = (
            rec.prompt if rec.prompt is not None else [{"role": r, "content": c} for r, c in rec.messages or ()]
        )
        info["columns"] = dict(rec.columns)
        info["row"] = rec.row
    if conversation is not None:
        info["messages"] = [dict(m) for m in conversation]
    return info


def _check_template(template: str | None) -> None:
    if template is None:
        return
    try:
        template.format(problem="")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"data.prompt_template is not a format string with only a {{problem}} field ({type(e).__name__}: {e}); "
            "write literal braces as {{ and }}"
        ) from None


def rl_collate_fn(rows: list[dict[str, Any]]) -> BatchedDataDict:
    """Stack dataset items into the batch the rollout takes: lists for logs and infos, tensors for numbers."""
    return BatchedDataDict(
        message_log=[r["message_log"] for r in rows],
        length=torch.tensor([r["length"] for r in rows], dtype=torch.long),  # [B]
        extra_env_info=[r["extra_env_info"] for r in rows],
        task_name=[r["task_name"] for r in rows],
        loss_multiplier=torch.tensor([r["loss_multiplier"] for r in rows], dtype=torch.float32),  # [B]
        idx=torch.tensor([r["idx"] for r in rows], dtype=torch.long),  # [B]
    )


# ---------------------------------------------------------------------------------------------------- loaders
def build_datasets(
    cfg: MasterConfig, tokenizer: Any, given: GivenRows = (None, None), episode_tasks: frozenset[str] = frozenset()
) -> tuple[PromptDataset, PromptDataset | None]:
    """The train dataset and, when configured, the validation dataset (a few objects per prompt: built without the
    collector's pauses)."""
    with no_gc_pauses():
        return _build_datasets(cfg, tokenizer, given, episode_tasks)


def _build_datasets(
    cfg: MasterConfig, tokenizer: Any, given: GivenRows, episode_tasks: frozenset[str]
) -> tuple[PromptDataset, PromptDataset | None]:
    train_records, val_records = load_records(cfg, given, episode_tasks)
    common = {
        "max_prompt_length": cfg.max_prompt_length,
        "system_prompt": cfg.data.system_prompt,
        "prompt_template": cfg.data.prompt_template,
        "skip_overlong_prompts": cfg.data.skip_overlong_prompts,
        "chat_template_kwargs": cfg.policy.tokenizer.chat_template_kwargs,
    }
    train = PromptDataset(train_records, tokenizer, name="training set", **common)
    val = PromptDataset(val_records, tokenizer, name="validation set", **common) if val_records is not None else None
    return train, val


def build_dataloaders(
    cfg: MasterConfig, tokenizer: Any, given: GivenRows = (None, None), episode_tasks: frozenset[str] = frozenset()
) -> tuple[StatefulDataLoader, StatefulDataLoader | None]:
    """Train loader (seeded shuffle, whole batches only, resumable mid-epoch) and validation loader (in order).
    `episode_tasks`: the task names of environment classes (their rows keep their columns and conversation)."""
    train, val = build_datasets(cfg, tokenizer, given, episode_tasks)
    g = cfg.rollout
    batch_size = g.prompts_per_batch
    if len(train) < batch_size:
        raise ValueError(
            f"training set has {len(train)} prompts, fewer than one batch of {batch_size} "
            f"({cfg.algorithm}.num_prompts_per_step, times {cfg.algorithm}.batch_multiplier under dynamic sampling)"
        )
    generator = torch.Generator()
    generator.manual_seed(g.seed)
    train_loader = _loader(
        train,
        batch_size=batch_size,
        shuffle=cfg.data.shuffle,
        generator=generator,
        drop_last=True,
        collate_fn=rl_collate_fn,
        num_workers=cfg.data.num_workers,
    )
    val_loader = None
    if val is not None:
        val_subset = Subset(val, range(min(len(val), g.max_val_samples)))
        val_loader = _loader(
            val_subset,
            batch_size=g.val_batch_size,
            shuffle=False,
            collate_fn=rl_collate_fn,
            num_workers=cfg.data.num_workers,
        )
    return train_loader, val_loader


def _loader(dataset: Dataset, **kwargs: Any) -> StatefulDataLoader:
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in newer torch
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(dataset, **kwargs)
