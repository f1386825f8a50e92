"""TP-degree-dependent layouts recorded in a checkpoint, and the re-layout a load at another degree needs.

``fused_ffn`` and ``fused_qkv_old`` write a tensor as blocks of its tensor-parallel ranks (``[gate_0, up_0, gate_1,
up_1, ...]``), so the same bytes mean different things at different TP degrees. A writer that knows the degree
(``convert_checkpoint``, which compiles the AOA program for it) stores :attr:`AOAProgram.tp_layouts` in the
checkpoint metadata under ``extra["tp_layouts"]``. A load then calls :func:`relayout_config`: a recorded key
requested at another degree is re-laid out by an added ``K -> K, fused_ffn, axis=A`` statement when no statement
of the caller reads it, and a clear error names the statement to write when one reads it as a plain tensor
(which would give silently wrong numbers). See docs/aoa.md, "TP-dependent layouts".
"""

from __future__ import annotations

from typing import Any, Mapping

from oarlock.checkpoint.aoa.engine import TP_LAYOUTS_KEY, expand_statements, normalize_config
from oarlock.checkpoint.aoa.errors import AOAError


def relayout_statement(key: str, rec: Mapping[str, Any], target: str | None = None) -> str:
    """The statement re-laying out ``key`` (recorded as ``rec``) from its saved TP degree to the load's:
    ``"key -> target, fused_ffn, axis=0"`` (``target`` defaults to ``key``)."""
    params = "".join(f", {k}={rec[k]}" for k in ("num_heads", "num_key_value_groups") if k in rec)
    return f"{key} -> {target or key}, {rec['statement']}{params}, axis={rec.get('axis', 1)}"


def recorded_layouts(metadata: Any) -> dict[str, dict]:
    """``extra["tp_layouts"]`` of a :class:`~oarlock.checkpoint.CheckpointMetadata` (``{}`` when absent or not a
    mapping of well-formed records)."""
    rec = (getattr(metadata, "extra", None) or {}).get(TP_LAYOUTS_KEY) or {}
    if not isinstance(rec, Mapping):
        return {}
    return {k: dict(v) for k, v in rec.items()
            if isinstance(v, Mapping) and v.get("statement") in ("fused_ffn", "fused_qkv_old")
            and isinstance(v.get("tp"), int)}


def relayout_config(aoa_config: Any, metadata: Any, destination_shards: Mapping[str, int]) -> Any:
    """``aoa_config`` extended so that every key recorded in a TP-dependent layout loads correctly at the
    destination's TP degree (``destination_shards``: key -> distinct global offsets requested; keys absent are
    not loaded). Returns ``aoa_config`` unchanged (``None`` stays ``None``) when nothing needs re-laying out.

    Raises:
        AOAError: a recorded key is read by a statement of ``aoa_config`` that is not a fused statement of the
            same kind, at another degree: the message names the key, both degrees and the statement to write.
    """
    layouts = recorded_layouts(metadata)
    if not layouts:
        return aoa_config
    readers: dict[str, list] = {}
    statements: list = []
    reverse = False
    if aoa_config is not None:
        statements, reverse = normalize_config(aoa_config)
        try:
            exprs = expand_statements(aoa_config, list(metadata.tensors))
        except AOAError:
            return aoa_config  # a pattern needs the destination keys: compile_aoa reports any real error
        for e in exprs:
            root = e  # the statement as written by the caller, before fused-macro expansion
            while root.parent is not None and root.keyword is None and root.stage.startswith("fused"):
                root = root.parent
            for n in (root.rhs if reverse else root.lhs):
                n = n[:-2] if n.endswith("^T") else n
                if n in layouts and all(r is not root for r in readers.get(n, ())):
                    readers.setdefault(n, []).append(root)
    added = []
    for key, rec in layouts.items():
        rs = readers.get(key, [])
        if not rs:
            want = destination_shards.get(key)
            if want is not None and want != rec["tp"]:
                added.append(relayout_statement(key, rec))
            continue
        if any(r.keyword == rec["statement"] for r in rs):
            continue  # the caller re-lays it out (or splits it) with the right macro
        for r in rs:
            targets = r.lhs if reverse else r.rhs
            want = next((destination_shards[t] for t in targets if t in destination_shards), None)
            if want is None or want == rec["tp"]:
                continue
            target = targets[0] if len(targets) == 1 and not reverse else None
            raise AOAError(
                f"{key!r} was saved in the TP-blocked {rec['statement']} layout of TP degree {rec['tp']} (recorded "
                f"in the checkpoint metadata) and is loaded at TP degree {want}, but statement "
                f"{r.source.text!r} reads it as a plain tensor, which would load wrong numbers: write "
                f"'{relayout_statement(key, rec, target)}' instead")
    if not added:
        return aoa_config
    return {"aoa_statements": list(statements) + added, "aoa_config_reverse": reverse}
