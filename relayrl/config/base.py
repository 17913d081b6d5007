"""Shared pieces of the config schema: the strict base model, constrained number types, fixed vocabularies."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

NonNegInt = Annotated[int, Field(ge=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
UnitFloat = Annotated[float, Field(gt=0, le=1)]

#: `checkpointing.checkpoint_must_save_by`: days:hours:minutes:seconds, each a non-negative integer.
DURATION_PATTERN = re.compile(r"[0-9]+:[0-9]+:[0-9]+:[0-9]+")
#: What validation reports; `*.stop_at_validation_metric` must name one of them.
VALIDATION_METRICS = ("accuracy", "avg_length", "num_samples", "pass_k")

#: Shipped with the package (see scripts/make_tiny_model.py); resolved by relayrl.utils.paths.resolve_model_path.
BUILTIN_TINY_MODEL = "builtin:tiny-arith"


class Strict(BaseModel):
    """Base for every config block: unknown keys are errors, assignments are validated, and the docstring under each
    field becomes its `Field.description` (what `relayrl config show` prints; tests/unit/config/test_descriptions.py
    requires one on every field)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)
