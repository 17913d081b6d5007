"""BatchedDataDict: a batch-major dict of tensors and lists, the unit of data the legacy path moves around.

Every value is indexed by row on its first dimension (tensors) or position (lists). Operations keep rows aligned
across keys, so a trainer can filter, repeat, shard and micro-batch a rollout without tracking keys by hand.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")


class BatchedDataDict(dict[str, Any], Generic[T]):
    """A dict whose values all share the same leading (row) dimension."""

    # ------------------------------------------------------------------ shape
    @property
    def size(self) -> int:
        """Number of rows; raises ValueError if the keys disagree."""
        return self.check_consistent()

    def check_consistent(self) -> int:
        """Return the common row count, or raise ValueError naming the keys whose lengths differ."""
        lengths = {k: n for k, n in ((k, _rows(v)) for k, v in self.items()) if n is not None}
        if not lengths:
            return 0
        distinct = set(lengths.values())
        if len(distinct) > 1:
            detail = ", ".join(f"{k}={n}" for k, n in lengths.items())
            raise ValueError(f"BatchedDataDict rows disagree across keys: {detail}")
        return distinct.pop()

    # ------------------------------------------------------------------ row selection
    def select_indices(self, indices: Sequence[int] | torch.Tensor) -> BatchedDataDict[T]:
        """Rows at `indices`, in that order (tensors gathered, lists picked); a bool tensor acts as a row mask."""
        idx = torch.as_tensor(indices)
        if idx.dtype == torch.bool:
            if idx.dim() != 1 or idx.numel() != self.size:
                raise ValueError(f"bool row mask of shape {tuple(idx.shape)} does not match {self.size} rows")
            idx = idx.nonzero().flatten()
        idx = idx.to(torch.long).flatten()
        n = self.size
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise IndexError(f"row indices must lie in [0, {n}); got min {int(idx.min())}, max {int(idx.max())}")
        idx_list = idx.tolist()
        out: BatchedDataDict[T] = type(self)()
        on_device = {idx.device: idx}  # one copy of the index per device, not one per field
        for k, v in self.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                if v.device not in on_device:
                    on_device[v.device] = idx.to(v.device)
                out[k] = v.index_select(0, on_device[v.device])
            elif isinstance(v, list):
                out[k] = [v[i] for i in idx_list]
            else:
                out[k] = v
        return out

    def select_keys(self, keys: Sequence[str]) -> BatchedDataDict[T]:
        """A new batch holding only `keys` (values shared, not copied); a missing key raises KeyError."""
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"BatchedDataDict has no key(s) {missing}; present: {sorted(self)}")
        return type(self)({k: self[k] for k in keys})

    def slice(self, start: int, end: int) -> BatchedDataDict[T]:
        """Rows [start, end) as views (tensors) or shallow copies (lists)."""
        out: BatchedDataDict[T] = type(self)()
        for k, v in self.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 or isinstance(v, list):
                out[k] = v[start:end]
            else:
                out[k] = v
        return out

    def get_batch(self, batch_idx: int, batch_size: int) -> BatchedDataDict[T]:
        """The `batch_idx`-th block of `batch_size` rows."""
        return self.slice(batch_idx * batch_size, (batch_idx + 1) * batch_size)

    def repeat_interleave(self, num_repeats: int) -> BatchedDataDict[T]:
        """Each row repeated `num_repeats` times contiguously; list items are deep-copied so they can diverge.

        (Plain dicts, lists, tensors and scalars are copied structurally, far faster than `copy.deepcopy` on
        message logs; aliasing *within* one item is not preserved, anything else goes through deepcopy.)"""
        out: BatchedDataDict[T] = type(self)()
        for k, v in self.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[k] = v.repeat_interleave(num_repeats, dim=0)
            elif isinstance(v, list):
                out[k] = [_tree_copy(item) for item in v for _ in range(num_repeats)]
            else:
                out[k] = v
        return out

    def reorder_data(self, permutation: Sequence[int] | torch.Tensor) -> BatchedDataDict[T]:
        """Undo a sharding permutation: row `permutation[i]` of the result is row `i` of self."""
        perm = torch.as_tensor(permutation, dtype=torch.long)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(len(perm))
        return self.select_indices(inverse)

    # ------------------------------------------------------------------ sharding and micro-batches
    def shard_by_batch_size(
        self, shards: int, batch_size: int | None = None, allow_uneven_shards: bool = False
    ) -> list[BatchedDataDict[T]]:
        """Split rows across `shards` data-parallel ranks.

        Without `batch_size`: contiguous split. With `batch_size`: the batch is cut into chunks of `batch_size`
        rows (one optimizer step each); each chunk is split into `shards` contiguous pieces and rank d receives
        the concatenation of its piece from every chunk, so global batch k holds the same rows on every rank.
        """
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        n = self.size
        if batch_size is None:
            if n % shards and not allow_uneven_shards:
                raise ValueError(f"{n} rows do not split evenly into {shards} shards")
            bounds = _even_bounds(n, shards)
            return [self.slice(a, b) for a, b in bounds]
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if n % batch_size:
            raise ValueError(f"{n} rows are not a multiple of the global batch size {batch_size}")
        if batch_size % shards and not allow_uneven_shards:
            raise ValueError(f"global batch size {batch_size} does not split evenly into {shards} shards")
        per_shard: list[list[int]] = [[] for _ in range(shards)]
        for chunk_start in range(0, n, batch_size):
            for d, (a, b) in enumerate(_even_bounds(batch_size, shards)):
                per_shard[d].extend(range(chunk_start + a, chunk_start + b))
        return [self.select_indices(rows) for rows in per_shard]

    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator[BatchedDataDict[T]]:
        """Consecutive blocks of `microbatch_size` rows; the row count must divide evenly."""
        n = self.size
        if microbatch_size < 1:
            raise ValueError(f"micro batch size must be >= 1, got {microbatch_size}")
        if n % microbatch_size:
            raise ValueError(f"{n} rows do not split into micro-batches of {microbatch_size}")
        for start in range(0, n, microbatch_size):
            yield self.slice(start, start + microbatch_size)

    # ------------------------------------------------------------------ assembly
    @classmethod
    def from_batches(
        cls, batches: Sequence[dict[str, Any]], pad_value_dict: dict[str, Any] | None = None
    ) -> BatchedDataDict[Any]:
        """Concatenate batches row-wise; 2-D+ tensors are right-padded on dim 1 to the longest (pad 0 or per key)."""
        pad_value_dict = pad_value_dict or {}
        out: BatchedDataDict[Any] = cls()
        if not batches:
            return out
        keys = set(batches[0])
        for i, b in enumerate(batches[1:], start=1):
            if set(b) != keys:
                raise ValueError(
                    f"from_batches: batch {i} keys differ from batch 0 (missing {sorted(keys - set(b))}, "
                    f"extra {sorted(set(b) - keys)})"
                )
        for k in batches[0]:
            values = [b[k] for b in batches]
            first = values[0]
            if isinstance(first, torch.Tensor):
                if first.dim() == 0:
                    out[k] = first
                elif first.dim() == 1:
                    out[k] = torch.cat(values)
                else:
                    out[k] = _pad_cat(values, pad_value_dict.get(k, 0))
            elif isinstance(first, list):
                out[k] = [item for v in values for item in v]
            else:
                out[k] = first
        return out

    def to(self, device: torch.device | str) -> BatchedDataDict[T]:
        """Move every tensor to `device` (in place; returns self for chaining)."""
        for k, v in self.items():
            if isinstance(v, torch.Tensor):
                self[k] = v.to(device)
        return self

    def copy(self) -> BatchedDataDict[T]:  # type: ignore[override]
        """Shallow copy that keeps the BatchedDataDict type."""
        return type(self)(self)

    def get_dict(self) -> dict[str, Any]:
        """A plain dict view (for serialization)."""
        return dict(self)


def _rows(v: Any) -> int | None:
    if isinstance(v, torch.Tensor):
        return v.shape[0] if v.dim() > 0 else None
    if isinstance(v, list):
        return len(v)
    return None


def _even_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [a, b) ranges whose sizes differ by at most one (larger ones first)."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def _pad_cat(tensors: list[torch.Tensor], pad_value: Any) -> torch.Tensor:
    width = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        if t.shape[1] < width:
            pad_shape = (t.shape[0], width - t.shape[1], *t.shape[2:])
            t = torch.cat([t, t.new_full(pad_shape, pad_value)], dim=1)
        padded.append(t)
    return torch.cat(padded)


_IMMUTABLE = (str, int, float, bool, bytes, type(None))


def _tree_copy(x: Any) -> Any:
    """A deep copy of the plain dict / list / tensor trees rows hold (message logs, env metadata).

    Equal to `copy.deepcopy` except that two references to one object inside `x` become two copies; tensors are
    cloned (same values, dtype, device, requires_grad), immutable scalars shared, other objects deep-copied.
    """
    t = type(x)
    if t is dict:
        return {k: _tree_copy(v) for k, v in x.items()}
    if t is list:
        return [_tree_copy(v) for v in x]
    if t in _IMMUTABLE:
        return x
    if t is torch.Tensor and x.is_leaf:
        return x.detach().clone().requires_grad_(x.requires_grad)
    return copy.deepcopy(x)
