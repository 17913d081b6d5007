"""Wire layout of one field: a `Column` of packed values, jagged (per-token) or dense (one row per sample).

Per-token fields travel jagged: one flat `values` tensor `[T, *trailing]` holding every sample's valid tokens
back to back, plus `lengths` `[N]`. Nothing is padded on the wire, so a write-back never carries the forward pad
and two fields written with different pads stay comparable. Dense fields (per-row scalars, fixed-width rows)
travel as `values` `[N, *trailing]` with `lengths=None`. Dtypes are never changed by anything in this module.
`materialize` turns columns back into right-padded tensors with per-field pad values and an absolute width.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from relayrl.distributed.batched_data_dict import BatchedDataDict

# Fused jagged→padded kernel (CPU and CUDA). Private to torch, so every call falls back to index_copy_ on error.
_JAGGED_TO_PADDED = getattr(torch.ops.aten, "_jagged_to_padded_dense_forward", None)


@dataclass(frozen=True, eq=False)
class Column:
    """One field for N samples: `values` `[T, *trailing]` + `lengths` `[N]` (jagged) or `values` `[N, *trailing]`."""

    values: torch.Tensor
    lengths: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.values, torch.Tensor):
            raise TypeError(f"Column.values must be a torch.Tensor, got {type(self.values).__name__}")
        if self.values.is_nested:
            raise TypeError("Column.values must be a plain tensor; use Column.from_nested for nested tensors")
        if self.lengths is None:
            if self.values.dim() == 0:
                raise ValueError("a dense Column needs a leading row dimension; got a 0-d tensor")
            return
        lengths = self.lengths
        if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1 or lengths.dtype != torch.int64:
            raise ValueError("Column.lengths must be a 1-D int64 tensor (one length per sample)")
        if self.values.dim() == 0:
            raise ValueError("jagged Column.values must be at least 1-D ([T, *trailing])")
        total = int(lengths.sum()) if lengths.numel() else 0
        if lengths.numel() and int(lengths.min()) < 0:
            raise ValueError("Column.lengths must be non-negative")
        if total != self.values.shape[0]:
            raise ValueError(f"Column lengths sum to {total} but values hold {self.values.shape[0]} tokens")

    # ------------------------------------------------------------------ construction
    @classmethod
    def dense(cls, values: torch.Tensor) -> Column:
        """Row i is `values[i]`."""
        return cls(values)

    @classmethod
    def jagged(cls, values: torch.Tensor, lengths: torch.Tensor | Sequence[int]) -> Column:
        """Row i is the next `lengths[i]` entries of the flat `values`."""
        return cls(values, torch.as_tensor(lengths, dtype=torch.int64).reshape(-1))

    @classmethod
    def from_padded(cls, padded: torch.Tensor, lengths: torch.Tensor | Sequence[int]) -> Column:
        """Pack right-padded `[N, S, *trailing]` to jagged, keeping the first `lengths[i]` positions of row i."""
        lens = torch.as_tensor(lengths, dtype=torch.int64).reshape(-1).cpu()
        if padded.dim() < 2:
            raise ValueError(f"from_padded needs a [N, S, ...] tensor, got shape {tuple(padded.shape)}")
        if lens.shape[0] != padded.shape[0]:
            raise ValueError(f"lengths has {lens.shape[0]} entries for {padded.shape[0]} rows")
        width = padded.shape[1]
        if lens.numel() and int(lens.max()) > width:
            raise ValueError(f"a length of {int(lens.max())} exceeds the padded width {width}; nothing would be kept")
        if lens.numel() and bool((lens == width).all()):
            return cls(padded.reshape(-1, *padded.shape[2:]), lens)  # no padding to drop
        starts = torch.arange(lens.shape[0], dtype=torch.int64) * width  # [N] row starts when flattened
        src = flat_token_index(starts, lens).to(padded.device)  # [T]
        return cls(padded.reshape(-1, *padded.shape[2:]).index_select(0, src), lens)

    @classmethod
    def from_rows(cls, rows: Sequence[torch.Tensor]) -> Column:
        """Jagged column from per-sample tensors `[len_i, *trailing]` (tests and small inputs; not the hot path)."""
        if not rows:
            raise ValueError("from_rows needs at least one row (dtype would be unknown)")
        lens = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
        return cls(torch.cat(list(rows)), lens)

    @classmethod
    def from_nested(cls, nested: torch.Tensor) -> Column:
        """Jagged column from a `torch.jagged` nested tensor (shares its values buffer)."""
        if not nested.is_nested or nested.layout != torch.jagged:
            raise TypeError("from_nested expects a torch.nested tensor with layout=torch.jagged")
        offsets = nested.offsets().to("cpu", torch.int64)  # type: ignore[attr-defined]  # [N + 1]
        return cls(nested.values(), offsets.diff())

    @classmethod
    def unchecked(cls, values: torch.Tensor, lengths: torch.Tensor | None = None) -> Column:
        """Skip validation; only for stores returning data they validated at write time (hot path)."""
        col = object.__new__(cls)
        object.__setattr__(col, "values", values)
        object.__setattr__(col, "lengths", lengths)
        return col

    # ------------------------------------------------------------------ properties
    @property
    def is_jagged(self) -> bool:
        return self.lengths is not None

    @property
    def num_rows(self) -> int:
        return self.values.shape[0] if self.lengths is None else self.lengths.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def trailing_shape(self) -> tuple[int, ...]:
        """Shape of one element after the row (dense) or token (jagged) dimension."""
        return tuple(self.values.shape[1:])

    @property
    def offsets(self) -> torch.Tensor:
        """`[N + 1]` int64 start offsets of each row in `values` (jagged only)."""
        if self.lengths is None:
            raise ValueError("offsets are only defined for jagged columns")
        out = torch.zeros(self.lengths.shape[0] + 1, dtype=torch.int64)
        torch.cumsum(self.lengths, 0, out=out[1:])
        return out

    @property
    def nbytes(self) -> int:
        extra = 0 if self.lengths is None else self.lengths.numel() * 8
        return self.values.numel() * self.values.element_size() + extra

    def row(self, i: int) -> torch.Tensor:
        """Sample i (a view); for tests and debugging."""
        if self.lengths is None:
            return self.values[i]
        start = int(self.lengths[:i].sum())
        return self.values[start : start + int(self.lengths[i])]

    def to_nested(self) -> torch.Tensor:
        """A `torch.jagged` nested tensor view of a jagged column."""
        if self.lengths is None:
            raise ValueError("to_nested is only defined for jagged columns")
        return torch.nested.nested_tensor_from_jagged(self.values, self.offsets.to(self.values.device))

    def materialize(
        self,
        pad_value: Any = 0,
        pad_to_seqlen: int = 0,
        *,
        index_cache: dict[tuple[int, int], tuple[int, torch.Tensor | None]] | None = None,
    ) -> torch.Tensor:
        """Right-padded tensor: jagged → `[N, W, *trailing]` with `W = pad_to_seqlen or max length`; dense as is.

        `index_cache` lets columns that share one lengths tensor (written together) share the offsets work.
        """
        if self.lengths is None:
            return self.values
        key = (id(self.lengths), pad_to_seqlen)
        hit = None if index_cache is None else index_cache.get(key)
        if hit is None:
            hit = self._padded_layout(pad_to_seqlen)
            if index_cache is not None:
                index_cache[key] = hit
        width, offsets = hit
        n, trailing, dev = self.lengths.shape[0], self.trailing_shape, self.values.device
        if offsets is None:  # every row already has the target width: a reshape-copy
            return self.values.reshape(n, width, *trailing).clone()
        offsets = offsets.to(dev)
        if _JAGGED_TO_PADDED is not None and not (isinstance(pad_value, int) and abs(pad_value) > 2**53):
            try:  # one fused kernel; exact for every dtype (pad goes through a double)
                flat = self.values.reshape(self.values.shape[0], math.prod(trailing))  # [T, D]
                out = _JAGGED_TO_PADDED(flat, [offsets], [width], pad_value)
                return out.view(n, width, *trailing)
            except (RuntimeError, NotImplementedError):
                pass
        out = torch.full((n, width, *trailing), pad_value, dtype=self.dtype, device=dev)
        starts = torch.arange(n, dtype=torch.int64, device=dev) * width  # [N] row starts in the flat output
        dst = flat_token_index(starts, offsets.diff())  # [T]
        out.view(n * width, *trailing).index_copy_(0, dst, self.values)
        return out

    def _padded_layout(self, pad_to_seqlen: int) -> tuple[int, torch.Tensor | None]:
        """(padded width, offsets `[N + 1]`; None when no row needs padding). Raises if a row does not fit."""
        assert self.lengths is not None
        lens = self.lengths
        longest = int(lens.max()) if lens.numel() else 0
        if pad_to_seqlen and longest > pad_to_seqlen:
            raise ValueError(f"a row of length {longest} does not fit pad_to_seqlen={pad_to_seqlen}")
        width = pad_to_seqlen or longest
        if lens.numel() and longest == width and bool((lens == width).all()):
            return width, None
        return width, self.offsets


class FieldSpec(NamedTuple):
    """A field's layout as fixed by its first write in a partition; later writes must match it (nothing is cast)."""

    jagged: bool
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    trailing: tuple[int, ...]

    @classmethod
    def of(cls, col: Column) -> FieldSpec:
        return cls(col.is_jagged, str(col.dtype).removeprefix("torch."), col.trailing_shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    @property
    def width(self) -> int:
        """Payload bytes of one token (jagged) or one row (dense)."""
        return math.prod(self.trailing) * self.torch_dtype.itemsize

    def describe(self) -> str:
        return f"{'jagged' if self.jagged else 'dense'} torch.{self.dtype} trailing shape {self.trailing}"


def as_column(name: str, value: Any) -> Column:
    """Coerce a field value to a Column: Column as is, jagged nested tensor → jagged, plain tensor → dense."""
    if isinstance(value, Column):
        return value
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return Column.from_nested(value)
        if value.dim() == 0:
            raise ValueError(f"field '{name}' is a 0-d tensor; fields need one row per sample")
        return Column(value)
    raise TypeError(
        f"field '{name}' has unsupported type {type(value).__name__}; the data plane stores tensors only "
        "(non-tensor values are rejected, not dropped)"
    )


def materialize(
    batch: Mapping[str, Column | torch.Tensor],
    pad_value_dict: Mapping[str, Any] | None = None,
    pad_to_seqlen: int = 0,
) -> BatchedDataDict[Any]:
    """Right-pad every jagged column (pad from `pad_value_dict`, default 0) to `pad_to_seqlen` or its own max.

    `pad_to_seqlen` is absolute: all DP ranks pass the same value so they share one sequence dimension. A row
    longer than it raises instead of being truncated. Dense columns are returned unchanged.
    """
    pads = pad_value_dict or {}
    out: BatchedDataDict[Any] = BatchedDataDict()
    cache: dict[tuple[int, int], tuple[int, torch.Tensor | None]] = {}  # columns sharing lengths share offsets
    for name, value in batch.items():
        col = as_column(name, value)
        out[name] = col.materialize(pads.get(name, 0), pad_to_seqlen, index_cache=cache)
    return out


def concat_columns(columns: Sequence[Column]) -> Column:
    """Rows of `columns` back to back (one cat of the values); all must share layout, dtype and trailing shape."""
    if not columns:
        raise ValueError("concat_columns needs at least one column")
    first = columns[0]
    for c in columns[1:]:
        if c.is_jagged != first.is_jagged or c.dtype != first.dtype or c.trailing_shape != first.trailing_shape:
            raise ValueError("concat_columns: columns differ in layout, dtype or trailing shape")
    values = torch.cat([c.values for c in columns])
    if not first.is_jagged:
        return Column(values)
    return Column(values, torch.cat([c.lengths for c in columns if c.lengths is not None]))


def flat_token_index(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Concatenated ranges `[starts[i], starts[i] + lens[i])` as one int64 index, via a cumsum of steps.

    (Several times faster on CPU than `repeat_interleave(starts - out_starts, lens) + arange`.)
    """
    keep = lens > 0
    if not bool(keep.all()):
        starts, lens = starts[keep], lens[keep]
    if lens.numel() == 0:
        return torch.empty(0, dtype=torch.int64)
    ends = torch.cumsum(lens, 0)  # [n] exclusive ends in the output
    steps = torch.ones(int(ends[-1]), dtype=torch.int64)  # [T]
    steps[0] = starts[0]
    steps[ends[:-1]] = starts[1:] - (starts[:-1] + lens[:-1]) + 1
    return torch.cumsum(steps, 0)


def batch_nbytes(batch: Mapping[str, Column | torch.Tensor]) -> int:
    """Payload bytes of a batch of columns or tensors (what observability counts)."""
    total = 0
    for value in batch.values():
        if isinstance(value, Column):
            total += value.nbytes
        elif isinstance(value, torch.Tensor):
            t = value.values() if value.is_nested else value
            total += t.numel() * t.element_size()
    return total
