"""Every config field is documented, and its attribute docstring reaches pydantic as `Field.description`.

The docstring line under a field is how this project documents config keys; `Strict` turns on
`use_attribute_docstrings`, so the same text is what `model_fields[...].description` and the JSON schema show.
"""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel

from relayrl.config import (
    ClippedPGLossConfig,
    GRPOConfig,
    MasterConfig,
    PolicyConfig,
    PPOConfig,
    Strict,
    ValueConfig,
)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """Pydantic models named anywhere in a field annotation: bare, Optional, in unions, lists, tuples, dicts."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def undocumented_fields(root: type[BaseModel]) -> tuple[list[str], list[type[BaseModel]]]:
    """(dotted paths of fields with no description, every model visited), walking nested models from `root`.

    A model reached by several paths (e.g. TokenizerConfig under policy and value) is walked once, under the
    first path; inherited fields are checked on every subclass, since a subclass may redeclare them.
    """
    missing: list[str] = []
    seen: list[type[BaseModel]] = []
    queue: list[tuple[str, type[BaseModel]]] = [(root.__name__, root)]
    while queue:
        path, model = queue.pop(0)
        if model in seen:
            continue
        seen.append(model)
        for name, field in model.model_fields.items():
            if not (field.description or "").strip():
                missing.append(f"{path}.{name} ({model.__name__})")
            queue.extend((f"{path}.{name}", sub) for sub in _models_in(field.annotation))
    return missing, seen


def test_every_config_field_has_a_description():
    missing, seen = undocumented_fields(MasterConfig)
    assert not missing, "config fields without an attribute docstring:\n" + "\n".join(missing)
    # The walk really reached the nested blocks, including those behind Optional / inheritance.
    names = {m.__name__ for m in seen}
    for expected in ("RewardModelEnvConfig", "DatasetConfig", "GenerationResourcesConfig", "AdamWKwargs"):
        assert expected in names
    assert len(seen) >= 30
    assert sum(len(m.model_fields) for m in seen) >= 250


def test_the_walk_reports_undocumented_fields_in_nested_optional_and_list_models():
    class Leaf(Strict):
        documented: int = 0
        """Has one."""
        bare: int = 0

    class Root(Strict):
        maybe: Leaf | None = None
        """Optional nested model."""
        many: list[Leaf] = []
        """Models in a list."""
        keyed: dict[str, Leaf] = {}

    missing, seen = undocumented_fields(Root)
    assert missing == ["Root.keyed (Root)", "Root.maybe.bare (Leaf)"]
    assert seen == [Root, Leaf]


def test_attribute_docstrings_become_pydantic_descriptions():
    fields = MasterConfig.model_fields
    assert fields["algorithm"].description == (
        "Which trainer `relayrl train` runs: GRPO (the `grpo` block) or actor-critic PPO (`ppo`, `value`)."
    )
    # Multi-line docstrings arrive dedented, line breaks kept.
    assert PolicyConfig.model_fields["logprob_chunk_size"].description == (
        "Positions per log-softmax chunk; None picks a chunk that keeps [rows, chunk, V] fp32 under ~64 MB on the\n"
        "CPU, and on a GPU under a sixteenth of the memory free at the first pass (a power of two, 64 MiB to 1 GiB)."
    )
    kl = ClippedPGLossConfig.model_fields["reference_policy_kl_penalty"].description
    assert kl is not None and kl.startswith("KL coefficient beta") and "\n" in kl and "\n    " not in kl
    # Inherited fields keep the base class's docstring (BatchingModes -> PolicyConfig / ValueConfig,
    # RolloutConfig -> GRPOConfig / PPOConfig); a redeclared field carries its own.
    packing = "Bin whole sequences into packed micro-batches (exclusive with dynamic_batching)."
    assert PolicyConfig.model_fields["sequence_packing"].description == packing
    assert ValueConfig.model_fields["sequence_packing"].description == packing
    greedy = "Validate with greedy decoding (deterministic accuracy); False samples like training."
    assert GRPOConfig.model_fields["val_greedy"].description == greedy
    assert PPOConfig.model_fields["val_greedy"].description == greedy
    assert PPOConfig.model_fields["max_num_steps"].description != GRPOConfig.model_fields["max_num_steps"].description
    # ... and reach the JSON schema that tools render.
    schema = MasterConfig.model_json_schema()
    prop = schema["$defs"]["PolicyConfig"]["properties"]["logprob_batch_size"]
    assert prop["description"] == "Rows per logprob / reference / top-k micro-batch; None means train_micro_batch_size."
