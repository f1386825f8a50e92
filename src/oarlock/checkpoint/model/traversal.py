"""State-dict traversal: nested dicts/lists of tensors, DTensors, ShardedWeights and JSON values.

Every module that walks a state dict goes through here: :func:`iter_leaves` (depth-first leaves with their
paths), :func:`to_sharded_weight` (the one conversion of a leaf to a :class:`ShardedWeight`: DTensors become their
local shard, plain tensors whole replicated boxes), :func:`collect_leaves` (a state dict split into shards and
JSON objects, as save and load need it) and :func:`set_path` (write a loaded object back into its container).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch

from oarlock.checkpoint.errors import CheckpointError
from oarlock.checkpoint.model.sharded import (ShardedWeight, is_dtensor, is_sharded_tensor, sharded_tensor_shards,
                                              to_sharded_weight)

__all__ = ["Leaves", "collect_leaves", "flat_key", "holds_tensor", "is_dtensor", "iter_leaves", "leaf_key",
           "set_path", "to_sharded_weight"]


def iter_leaves(obj: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """Depth-first ``(path, leaf)`` pairs of a nested state dict. Dicts and lists/tuples holding a tensor are
    containers; anything else (tensors, ShardedWeights, numbers, strings, tensor-free lists) is a leaf."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_leaves(v, path + (k,))
    elif isinstance(obj, (list, tuple)) and holds_tensor(obj):
        for i, v in enumerate(obj):
            yield from iter_leaves(v, path + (i,))
    else:
        yield path, obj


def holds_tensor(obj: Any) -> bool:
    """True when ``obj`` is, or nests inside dicts/lists/tuples, a tensor or ShardedWeight (what makes a list a
    container rather than a JSON leaf for :func:`iter_leaves`)."""
    if isinstance(obj, (torch.Tensor, ShardedWeight)):
        return True
    if isinstance(obj, dict):
        return any(holds_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(holds_tensor(v) for v in obj)
    return False


def flat_key(path: tuple) -> str:
    """``.``-joined key of a nested path (``("optim", "state", 0, "exp_avg")`` -> ``"optim.state.0.exp_avg"``)."""
    return ".".join(str(p) for p in path)


def leaf_key(path: tuple, leaf: Any) -> str:
    """The checkpoint key of a leaf: a ShardedWeight's own key, else the flat key of its path."""
    return leaf.key if isinstance(leaf, ShardedWeight) else flat_key(path)


@dataclass
class Leaves:
    """A state dict split by :func:`collect_leaves`.

    Attributes:
        shards: this rank's shards (tensors, DTensors and ShardedWeights), in traversal order.
        objects: JSON values by flat key; object_paths: their paths in the state dict.
        nested: flat key -> path, for keys whose path is not just ``(key,)``.
    """

    shards: list[ShardedWeight] = field(default_factory=list)
    objects: dict[str, Any] = field(default_factory=dict)
    object_paths: dict[str, tuple] = field(default_factory=dict)
    nested: dict[str, list] = field(default_factory=dict)


def collect_leaves(state_dict: Mapping[str, Any], origins: list | None = None) -> Leaves:
    """Split a nested state dict into shards (tensors, DTensors, ShardedWeights) and JSON objects. ``origins``,
    when given, receives for each shard appended to ``Leaves.shards`` its ``(leaf, i)``: the state-dict leaf it came
    from and its index among that leaf's shards (a ShardedTensor's local shards; 0 otherwise).

    Raises:
        CheckpointError: two leaves with the same flat key, or a leaf that is neither a tensor nor JSON data.
    """
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    out = Leaves()
    seen: dict[str, tuple] = {}
    several: set[str] = set()  # keys given as several shards (ShardedWeights, ShardedTensor local shards)
    for path, leaf in iter_leaves(state_dict):
        key = leaf_key(path, leaf)
        if key in seen and not (key in several and isinstance(leaf, ShardedWeight)):
            raise CheckpointError(f"state_dict key {key!r} occurs twice (at {list(seen[key])} and {list(path)}); "
                                  "only ShardedWeights may give several shards of one key")
        if key not in seen and (len(path) > 1 or not isinstance(path[0], str) or path[0] != key):
            out.nested[key] = list(path)
        seen.setdefault(key, path)
        if isinstance(leaf, ShardedWeight):
            several.add(key)
        if is_sharded_tensor(leaf):
            got = sharded_tensor_shards(key, leaf)
            out.shards.extend(got)
            if origins is not None:
                origins.extend((leaf, i) for i in range(len(got)))
        elif isinstance(leaf, (torch.Tensor, ShardedWeight)):
            sw = to_sharded_weight(key, leaf)
            if sw is not None:
                out.shards.append(sw)
                if origins is not None:
                    origins.append((leaf, 0))
        else:
            try:
                json.dumps(leaf, allow_nan=True)
            except (TypeError, ValueError):
                raise CheckpointError(f"state_dict key {key!r}: a value of type {type(leaf).__name__} is neither a tensor nor "
                                      "JSON data (int, float, str, bool, None, lists and dicts of those)") from None
            out.objects[key] = leaf
            out.object_paths[key] = path
    return out


def set_path(root: Any, path: tuple, value: Any) -> None:
    """Put ``value`` at ``path`` of the nested containers under ``root``.

    Raises:
        CheckpointError: the container at the end of the path is a tuple (immutable).
    """
    node = root
    for p in path[:-1]:
        node = node[p]
    if isinstance(node, tuple):
        raise CheckpointError(f"cannot load object {flat_key(path)!r} into a tuple; use a list")
    node[path[-1]] = value
