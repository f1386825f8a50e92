"""Online merge: full tensors from a live sharded state dict, one at a time.

:func:`full_state_dict` turns the shards a running job holds (ShardedWeights, DTensors, plain replicated
tensors) into ``(key, full_tensor)`` pairs, optionally through an AOA config (e.g. a reverse config that turns
a fused model layout back into HuggingFace's). Each output is assembled from the pieces its slice mappings
need and yielded before the next one starts, so memory holds one output (plus its pieces), never the model.
Replicated pieces are sent once, from the lowest rank that holds them.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch

from oarlock.checkpoint.runtime.dist import DistWrapper
from oarlock.checkpoint.errors import CheckpointError
from oarlock.checkpoint.model.boxes import (Box, box_intersection, box_shift, box_slices, box_volume,
                                            flat_range_boxes, full_box, make_box)
from oarlock.checkpoint.model.mapping import IdentityProgram, TensorSpec, apply_mapping
from oarlock.checkpoint.model.sharded import ShardedWeight, to_sharded_weight
from oarlock.checkpoint.model.traversal import iter_leaves, leaf_key
from oarlock.utils import dtype_name, torch_dtype


def _pieces(sw: ShardedWeight) -> list[tuple[Box, torch.Tensor]]:
    """Regular boxes (global coordinates) and the tensors holding them for one local shard."""
    if sw.flattened_range is None:
        return [(sw.box, sw.local_tensor)] if box_volume(sw.box) > 0 else []
    out = []
    for off, ext, fs in flat_range_boxes(sw.local_shape, *sw.flattened_range):
        n = box_volume(make_box(off, ext))
        goff = tuple(o + g for o, g in zip(off, sw.global_offset))
        out.append((make_box(goff, ext), sw.local_tensor[fs:fs + n].view(ext)))
    return out


def _as_sharded(sd: Mapping[str, Any]) -> dict[str, ShardedWeight]:
    out: dict[str, ShardedWeight] = {}
    for path, v in iter_leaves(dict(sd)):
        key = leaf_key(path, v)
        if not isinstance(v, (torch.Tensor, ShardedWeight)):
            raise CheckpointError(f"full_state_dict: value of {key!r} is a {type(v).__name__}, not a tensor")
        sw = to_sharded_weight(key, v)
        if sw is not None:
            out[key] = sw
    return out


def full_state_dict(sharded_state_dict: Mapping[str, Any], aoa_config: Any = None, *, process_group: Any = None,
                    rank0_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, full_tensor)`` for every tensor of a (possibly sharded) state dict.

    Args:
        sharded_state_dict: this rank's ``{key: ShardedWeight | DTensor | Tensor}`` (nested dicts allowed);
            plain tensors count as replicated. Collective: every rank of ``process_group`` must iterate the
            generator to its end, in the same order (ranks with ``rank0_only`` and rank != 0 yield nothing).
        aoa_config: optional AOA config applied to the outputs (the program's destination keys are yielded in
            order; e.g. a reverse config for HF export).
        rank0_only: assemble outputs only on group rank 0 (pieces go there point to point).

    Yields full tensors with the global shape and the dtype of the destination spec, on the device of the
    local shards. Single process with identity mapping: the live tensor itself, not a copy.

    Raises:
        CheckpointError: shards of a key that do not cover it exactly, or disagree on shape/dtype across ranks.
    """
    import torch.distributed as dist

    shards = _as_sharded(sharded_state_dict)
    dw = DistWrapper(process_group)
    distributed = dw.active
    me = dw.rank
    local = {k: (sw.global_shape, dtype_name(sw.local_tensor.dtype), [b for b, _ in _pieces(sw)], sw.global_offset)
             for k, sw in shards.items()}
    gathered = dw.all_gather_object(local)
    specs: dict[str, TensorSpec] = {}
    owners: dict[str, dict[Box, int]] = {}  # key -> distinct box -> lowest rank holding it
    offsets: dict[str, set] = {}  # key -> distinct shard offsets (the TP degree the fused macros need)
    for rank, entries in enumerate(gathered):
        for k, (gshape, dt, boxes, off) in entries.items():
            offsets.setdefault(k, set()).add(tuple(off))
            spec = TensorSpec(tuple(gshape), dt)
            if specs.setdefault(k, spec) != spec:
                raise CheckpointError(f"full_state_dict: {k!r} is {specs[k]} on one rank and {spec} on rank {rank}")
            for b in boxes:
                owners.setdefault(k, {}).setdefault(tuple(map(tuple, b)), rank)
    for k, spec in specs.items():
        covered = sum(box_volume(b) for b in owners.get(k, {}))
        total = box_volume(full_box(spec.shape))
        if covered != total:
            raise CheckpointError(f"full_state_dict: the shards of {k!r} cover {covered} of {total} elements of "
                                  f"shape {spec.shape} (gap or overlap between ranks)")
    if aoa_config is None:
        program: Any = IdentityProgram(specs)
    else:
        from oarlock.checkpoint.aoa import compile_aoa

        program = compile_aoa(aoa_config, specs, None, source_shards={k: len(v) for k, v in offsets.items()})
    group_ranks = [dw.global_rank(r) for r in range(dw.size)]
    local_pieces = {k: _pieces(sw) for k, sw in shards.items()}

    for key in program.destination_keys():
        spec = program.destination_spec(key)
        maps = program.mappings_for(key)
        if not distributed and len(maps) == 1 and aoa_config is None:
            sw = shards[key]
            if sw.flattened_range is None and sw.local_shape == sw.global_shape:
                yield key, sw.local_tensor
                continue
        want = not rank0_only or me == 0
        device = next(iter(shards.values())).local_tensor.device if shards else torch.device("cpu")
        out = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=device) if want else None
        for m in maps:
            src_spec = specs[m.src_key]
            region = torch.empty([b - a for a, b in m.src_box], dtype=torch_dtype(src_spec.dtype),
                                 device=device) if want else None
            for box, owner in sorted(owners[m.src_key].items(), key=lambda kv: kv[0]):
                inter = box_intersection(box, m.src_box)
                if inter is None:
                    continue
                held = None
                if owner == me:
                    piece = next(t for b, t in local_pieces[m.src_key] if b == box)
                    held = piece[box_slices(box_shift(inter, [a for a, _ in box]))]
                dst_view = region[box_slices(box_shift(inter, [a for a, _ in m.src_box]))] if want else None
                if not distributed:
                    dst_view.copy_(held)
                elif rank0_only:
                    if owner == me and me == 0:
                        dst_view.copy_(held)
                    elif owner == me:
                        dist.send(held.contiguous(), group_ranks[0], group=process_group)
                    elif me == 0:
                        buf = torch.empty_like(dst_view).contiguous()
                        dist.recv(buf, group_ranks[owner], group=process_group)
                        dst_view.copy_(buf)
                else:
                    buf = held.contiguous() if owner == me else torch.empty(dst_view.shape, dtype=dst_view.dtype,
                                                                             device=device)
                    dist.broadcast(buf, group_ranks[owner], group=process_group)
                    dst_view.copy_(buf)
            if want:
                out[box_slices(m.dst_box)] = apply_mapping(m, region)
        if want:
            yield key, out
