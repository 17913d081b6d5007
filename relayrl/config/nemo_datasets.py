"""NeMo RL's named datasets (`data.train.dataset_name: gsm8k`) as relayrl `source: hf` datasets.

NeMo RL's registry gives each name a Hugging Face id, a split and the columns its wrapper reads; relayrl reads the
same rows through `datasets.load_dataset` (cache and offline mode honoured) with the fields set to those columns, so
a NeMo RL config that names a dataset trains on the rows NeMo RL's wrapper would produce. docs/nemo_rl_configs.md
holds this table in prose.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["NAMED_DATASETS", "NamedDataset", "UNSUPPORTED_NAMES"]


@dataclasses.dataclass(frozen=True)
class NamedDataset:
    hf_id: str
    """The Hugging Face dataset id passed to `datasets.load_dataset`."""
    split: str
    """The split NeMo RL's wrapper reads."""
    prompt_field: str
    """The column holding the problem (dotted for a nested one: `prompt.0.content`)."""
    answer_field: str
    """The column holding the reference answer (dotted for a nested one)."""
    subset: str | None = None
    """The dataset's configuration name, when it has several."""
    answer_after: str | None = None
    """Keep only the answer text after this marker (GSM8K's `####`)."""
    note: str = ""
    """How NeMo RL's wrapper differs from reading the rows once, for the docs."""

    def relayrl(self) -> dict[str, Any]:
        """This dataset as relayrl's `data.train` / `data.validation` block."""
        out: dict[str, Any] = {"source": "hf", "path": self.hf_id, "split": self.split}
        out.update(prompt_field=self.prompt_field, answer_field=self.answer_field, task_field=None)
        if self.subset is not None:
            out["subset"] = self.subset
        if self.answer_after is not None:
            out["answer_after"] = self.answer_after
        return out


_DAPO = {"prompt_field": "prompt.0.content", "answer_field": "reward_model.ground_truth"}
_REPEAT = "NeMo RL repeats it 16 times; relayrl reads it once (val_num_generations_per_prompt samples repeatedly)"

#: NeMo RL dataset_name -> where relayrl reads the same rows.
NAMED_DATASETS: dict[str, NamedDataset] = {
    "OpenMathInstruct-2": NamedDataset("nvidia/OpenMathInstruct-2", "train_1M", "problem", "expected_answer"),
    "DeepScaler": NamedDataset("agentica-org/DeepScaleR-Preview-Dataset", "train", "problem", "answer"),
    "DAPOMath17K": NamedDataset("BytedTsinghua-SIA/DAPO-Math-17k", "train", **_DAPO),
    "DAPOMathAIME2024": NamedDataset("BytedTsinghua-SIA/AIME-2024", "train", **_DAPO),
    "gsm8k": NamedDataset("openai/gsm8k", "train", "question", "answer", subset="main", answer_after="####"),
    "GSM8K": NamedDataset("openai/gsm8k", "train", "question", "answer", subset="main", answer_after="####"),
    "AIME2024": NamedDataset("HuggingFaceH4/aime_2024", "train", "problem", "answer", note=_REPEAT),
    "AIME2026": NamedDataset("MathArena/aime_2026", "train", "problem", "answer", note=_REPEAT),
    "math500": NamedDataset("HuggingFaceH4/MATH-500", "test", "problem", "answer", note=_REPEAT),
}

#: Names NeMo RL knows whose rows relayrl cannot read as one split, with the reason given.
UNSUPPORTED_NAMES: dict[str, str] = {
    "AIME2025": "NeMo RL joins two subsets of opencompass/AIME2025; save them as one file and use ResponseDataset",
}
