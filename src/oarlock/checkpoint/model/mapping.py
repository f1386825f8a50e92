"""The contract between a mapping program (identity, or a compiled AOA config) and the load planner.

A program says, for each destination (model) key, which slices of which source (checkpoint) tensors fill it:
``dst[dst_box] = cast(permute(src[src_box], permute), dtype)``. Boxes are global coordinates, one
``(start, stop)`` pair per dimension (``()`` for scalars). The planner intersects these boxes with the shards
a rank owns and with the shards stored on disk, so no full tensor is ever materialised (see
``docs/checkpoint-format.md``, "Loading"; the AOA language that produces programs: ``docs/aoa.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import torch

from oarlock.checkpoint.model.boxes import Box, box_extent, box_slices, full_box
from oarlock.utils import torch_dtype

__all__ = ["Box", "CAST_CHAIN", "IdentityProgram", "MappingProgram", "SliceMapping", "TensorSpec", "apply_mapping",
           "box_extent", "box_slices", "cast_tensor", "execute_on_full_tensors", "final_dtype", "full_box"]


@dataclass(frozen=True)
class TensorSpec:
    """Global shape and dtype (canonical name, e.g. ``"float32"``) of a tensor."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class SliceMapping:
    """``dst[dst_box] = cast(permute(src[src_box], permute), dtype)``.

    ``permute`` is a dimension order in ``torch.permute`` semantics applied to the source slice (``None`` =
    identity); after it, the slice's shape equals the extent of ``dst_box`` up to axes of extent 1 (an AOA
    ``reshape=`` may add or remove unit axes, so the two boxes may differ in rank: the slice is then viewed with
    ``dst_box``'s extent, its non-unit axes corresponding in order). ``dtype`` is the cast target
    (``None`` = keep the source dtype), or a chain ``"bfloat16>float32"`` of casts applied in order (so that an
    AOA ``fp32 -> bf16 -> fp32`` chain rounds through bfloat16, as Paddle does; see :func:`cast_tensor`).
    """

    dst_key: str
    dst_box: Box
    src_key: str
    src_box: Box
    permute: tuple[int, ...] | None = None
    dtype: str | None = None


class MappingProgram(Protocol):
    """What the load planner asks of a compiled AOA config (or of :class:`IdentityProgram`)."""

    def destination_keys(self) -> list[str]:
        """Every destination key the program can produce."""

    def destination_spec(self, key: str) -> TensorSpec:
        """Global shape and dtype of destination ``key``."""

    def mappings_for(self, key: str) -> list[SliceMapping]:
        """Slice mappings whose ``dst_box`` regions exactly tile destination ``key``."""


class IdentityProgram:
    """Every source key maps onto the destination key of the same name, unchanged."""

    def __init__(self, source: Mapping[str, TensorSpec]):
        self.source = dict(source)

    def destination_keys(self) -> list[str]:
        return list(self.source)

    def destination_spec(self, key: str) -> TensorSpec:
        return self.source[key]

    def mappings_for(self, key: str) -> list[SliceMapping]:
        spec = self.source[key]
        box = full_box(spec.shape)
        return [SliceMapping(key, box, key, box)]


CAST_CHAIN = ">"  # separates the steps of a cast chain in SliceMapping.dtype / ReadItem.dtype


def final_dtype(dtype: str | None) -> str | None:
    """The dtype a cast (or cast chain ``"a>b"``) ends in."""
    return dtype.rsplit(CAST_CHAIN, 1)[-1] if dtype is not None else None


def cast_tensor(t: torch.Tensor, dtype: str | None) -> torch.Tensor:
    """``t`` cast to ``dtype``; a chain ``"bfloat16>float32"`` casts step by step (each step rounds)."""
    if dtype is None:
        return t
    for step in dtype.split(CAST_CHAIN):
        t = t.to(torch_dtype(step))
    return t


def apply_mapping(m: SliceMapping, src_slice: torch.Tensor) -> torch.Tensor:
    """Apply a mapping's permute and cast to the source slice ``src[m.src_box]``; the result has the extent of
    ``m.dst_box``."""
    t = src_slice.permute(*m.permute) if m.permute is not None else src_slice
    ext = box_extent(m.dst_box)
    if tuple(t.shape) != ext:  # unit axes added or removed by a reshape
        t = t.reshape(ext)
    return cast_tensor(t, m.dtype)


def execute_on_full_tensors(program: MappingProgram, source: Mapping[str, torch.Tensor],
                            keys: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """Reference executor on whole tensors (tests and small single-process use): build every destination
    tensor from full source tensors. The sharded loader must give bit-identical results."""
    out = {}
    for key in keys if keys is not None else program.destination_keys():
        spec = program.destination_spec(key)
        dst = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype))
        for m in program.mappings_for(key):
            dst[box_slices(m.dst_box)] = apply_mapping(m, source[m.src_key][box_slices(m.src_box)])
        out[key] = dst
    return out
