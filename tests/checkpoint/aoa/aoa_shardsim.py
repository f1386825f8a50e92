"""Test helper: execute a MappingProgram shard by shard, the way the load planner does, without ever building a
full source or destination tensor. Source tensors exist only as shards (box, local tensor); each destination
shard is filled from the intersections of its box with the mappings and of their source boxes with the stored
shards."""

from __future__ import annotations

import itertools

import torch

from oarlock.utils import torch_dtype
from oarlock.checkpoint.model.mapping import cast_tensor


def even_boxes(shape, axis, parts):
    """Boxes of an even split of ``shape`` into ``parts`` along ``axis`` (TP-style shards)."""
    n = shape[axis]
    assert n % parts == 0, (shape, axis, parts)
    step = n // parts
    full = [(0, s) for s in shape]
    return [tuple(full[:axis] + [(i * step, (i + 1) * step)] + full[axis + 1:]) for i in range(parts)]


def grid_boxes(shape, cuts):
    """Boxes of a grid: ``cuts[d]`` is the sorted list of interior cut points of dimension d."""
    per_dim = []
    for n, c in zip(shape, cuts):
        pts = [0] + sorted(set(x for x in c if 0 < x < n)) + [n]
        per_dim.append([(a, b) for a, b in zip(pts, pts[1:])] or [(0, n)])
    return [tuple(b) for b in itertools.product(*per_dim)]


def shard(full: torch.Tensor, boxes):
    return [(box, full[tuple(slice(a, b) for a, b in box)].clone()) for box in boxes]


def _inter(a, b):
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def load_shards(program, src_shards, dst_boxes):
    """``{key: [(box, local tensor), ...]}`` for every ``dst_boxes[key]`` box, filled via the program."""
    out = {}
    for key, boxes in dst_boxes.items():
        spec = program.destination_spec(key)
        maps = program.mappings_for(key)
        res = []
        for box in boxes:
            local = torch.empty([b - a for a, b in box], dtype=torch_dtype(spec.dtype))
            filled = torch.zeros(local.shape, dtype=torch.int32)
            for m in maps:
                it = _inter(m.dst_box, box) if box else ()
                if it is None:
                    continue
                nd = len(m.dst_box)
                perm = m.permute if m.permute is not None else tuple(range(nd))
                want = list(m.src_box)
                for i in range(nd):
                    s0 = m.src_box[perm[i]][0] + it[i][0] - m.dst_box[i][0]
                    want[perm[i]] = (s0, s0 + it[i][1] - it[i][0])
                for sbox, stensor in src_shards[m.src_key]:
                    si = _inter(tuple(want), sbox) if sbox else ()
                    if si is None:
                        continue
                    piece = stensor[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(si, sbox))]
                    if m.permute is not None:
                        piece = piece.permute(*m.permute)
                    if m.dtype is not None:
                        piece = cast_tensor(piece, m.dtype)
                    # destination position of this piece, in local coordinates
                    idx = tuple(slice(si[perm[i]][0] - want[perm[i]][0] + it[i][0] - box[i][0],
                                      si[perm[i]][1] - want[perm[i]][0] + it[i][0] - box[i][0]) for i in range(nd))
                    local[idx] = piece
                    filled[idx] += 1
            assert bool((filled == 1).all()), f"{key} box {box}: every element must be written exactly once"
            res.append((box, local))
        out[key] = res
    return out


def assert_shards_equal(loaded, expected_full):
    """Each loaded shard equals the same box of the expected full tensor, bit for bit and dtype for dtype."""
    for key, shards in loaded.items():
        exp = expected_full[key]
        for box, local in shards:
            ref = exp[tuple(slice(a, b) for a, b in box)]
            assert local.dtype == ref.dtype, (key, local.dtype, ref.dtype)
            assert torch.equal(local, ref), (key, box)
