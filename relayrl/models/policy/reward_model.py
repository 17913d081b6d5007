"""RewardModelPolicy: a learned reward, scoring whole sequences with a Hugging Face sequence classifier.

A decoder classifier (`*ForSequenceClassification`, `num_labels=1`) scores a sequence with its `score` head at the
last real token. transformers finds that token by looking for the pad id, which breaks when `pad_token_id` is unset
or a real token equals the pad id; here it comes from `input_lengths`, so right-padded batches score correctly
whatever the padding value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from relayrl.distributed.batched_data_dict import BatchedDataDict
from relayrl.models.facade_base import check_batch
from relayrl.models.worker_base import LOAD_LOCK, move_module, read_hf_config
from relayrl.utils import device as dev
from relayrl.utils.paths import resolve_model_path

_SCORE_KEYS = ("input_ids", "input_lengths")


def load_sequence_classifier(model_dir: str | Path) -> PreTrainedModel:
    """A one-label decoder sequence classifier in float32; clear errors for anything else."""
    source = resolve_model_path(str(model_dir))  # FileNotFound / NotADirectory / no config.json
    hf_config = read_hf_config(source)
    archs = list(hf_config.architectures or [])
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(
            f"not a sequence-classification model: {source} has architectures {archs}; a reward model must be "
            "saved as e.g. Qwen2ForSequenceClassification with num_labels=1"
        )
    if hf_config.num_labels != 1:
        raise ValueError(f"reward model at {source} has num_labels={hf_config.num_labels}; a scalar reward needs 1")
    try:
        with LOAD_LOCK:  # transformers' loading patches process-wide state
            model = AutoModelForSequenceClassification.from_pretrained(source, config=hf_config, dtype=torch.float32)
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"cannot load a sequence-classification model from {source}: {exc}") from exc
    if not isinstance(getattr(model, "score", None), nn.Module) or model.base_model is model:
        raise ValueError(
            f"{type(model).__name__} at {source} has no backbone + `score` head; only decoder classifiers that "
            "score the last token are supported"
        )
    return model.float().eval().requires_grad_(False)


class RewardModelPolicy:
    """Scores right-padded token sequences with a frozen sequence classifier (ScoreOutputSpec)."""

    def __init__(
        self,
        model_dir: str | Path,
        tokenizer: Any = None,
        *,
        device: str = "cpu",
        micro_batch_size: int = 32,
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.model_dir = resolve_model_path(str(model_dir))
        self.model = load_sequence_classifier(self.model_dir)
        self.device = dev.select_device(device)
        move_module(self.model, self.device)
        self.micro_batch_size = micro_batch_size
        if tokenizer is None and (self.model_dir / "tokenizer_config.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().get_parameter("weight").shape[0])

    def score(self, data: BatchedDataDict, micro_batch_size: int | None = None) -> BatchedDataDict:
        """{"scores": float32 [B] on CPU}: the classifier's output at token input_lengths[i] - 1 of each row."""
        rows = check_batch(data, _SCORE_KEYS, "score")
        ids, lengths = data["input_ids"], data["input_lengths"].long()  # [B, S], [B]
        if rows and int(lengths.min()) < 1:
            bad = int((lengths < 1).nonzero()[0])
            raise ValueError(f"score: row {bad} has input_length 0; a reward model needs at least one token")
        if rows and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(
                f"score: token ids must lie in [0, {self.vocab_size}) (the reward model's vocabulary); got "
                f"min {int(ids.min())}, max {int(ids.max())}; was it tokenized with another tokenizer?"
            )
        mbs = micro_batch_size or self.micro_batch_size
        out = [torch.zeros(0)]
        with torch.no_grad():
            for start in range(0, rows, mbs):
                mb_ids = ids[start : start + mbs].to(self.device)  # [b, S]
                mb_len = lengths[start : start + mbs].to(self.device)  # [b]
                out.append(self._score(mb_ids, mb_len).float().cpu())  # [b]
        return BatchedDataDict(scores=torch.cat(out))  # [B]

    def _score(self, input_ids: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
        batch, seq = input_ids.shape
        positions = torch.arange(seq, device=input_ids.device)  # [S]
        attention_mask = (positions[None, :] < input_lengths[:, None]).long()  # [b, S]
        hidden = self.model.base_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions.expand(batch, seq),
            use_cache=False,
        ).last_hidden_state  # [b, S, H]
        last = hidden[torch.arange(batch, device=hidden.device), input_lengths - 1]  # [b, H]
        return self.model.get_submodule("score")(last).squeeze(-1)  # [b]

    def shutdown(self) -> bool:
        return True
