"""A compiled AOA config, :class:`AOAProgram` (a :class:`~oarlock.checkpoint.model.mapping.MappingProgram`), and
the key-set helpers around it: the config's normal form, the model-level view of optimizer-state keys, and the
source specs and TP shard counts of a checkpoint's metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from oarlock.checkpoint.aoa.desc import Ref, TensorDesc
from oarlock.checkpoint.aoa.errors import AOAError, AOASyntaxError
from oarlock.checkpoint.aoa.macros import SCALAR_SUFFIXES, optimizer_splitter, split_optimizer_suffix
from oarlock.checkpoint.aoa.primitives import Primitive
from oarlock.checkpoint.model.boxes import Box, full_box
from oarlock.checkpoint.model.mapping import CAST_CHAIN, SliceMapping, TensorSpec

TP_LAYOUTS_KEY = "tp_layouts"  # CheckpointMetadata.extra entry: AOAProgram.tp_layouts of the writer


def normalize_config(aoa_config: object) -> tuple[list[str], bool]:
    """``(statements, reverse)`` from a Paddle-style dict, a list of strings or one string."""
    if isinstance(aoa_config, str):
        return [aoa_config], False
    if isinstance(aoa_config, (list, tuple)):
        return list(aoa_config), False
    if isinstance(aoa_config, Mapping):
        if "aoa_statements" not in aoa_config:
            raise AOASyntaxError(f"AOA config needs the key 'aoa_statements'; got keys {sorted(aoa_config)}")
        st = aoa_config["aoa_statements"]
        if isinstance(st, str):
            st = [st]
        if not isinstance(st, (list, tuple)):
            raise AOASyntaxError(f"aoa_statements must be a list of strings, got {type(st).__name__}")
        return list(st), bool(aoa_config.get("aoa_config_reverse", False))
    raise AOASyntaxError(f"AOA config must be a dict with 'aoa_statements' or a list of statement strings, got "
                         f"{type(aoa_config).__name__}")


def fold_optimizer_keys(source: Mapping[str, TensorSpec]) -> tuple[dict[str, TensorSpec], dict[str, list[str]]]:
    """Model-level view of a source key set: ``({model_key: spec}, {model_key: [optimizer suffixes]})``.

    A model key present only through its optimizer states (an optimizer-only checkpoint) takes the spec of its
    first parameter-shaped state."""
    model: dict[str, TensorSpec] = {}
    states: dict[str, list[str]] = {}
    split = optimizer_splitter(source)
    for k, spec in source.items():
        base, suf = split(k)
        if not suf:
            model[k] = spec
        else:
            states.setdefault(base, []).append(suf)
    for base, sufs in states.items():
        if base not in model:
            for s in sufs:
                if s not in SCALAR_SUFFIXES:
                    model[base] = source[base + s]
                    break
    return model, states


def fold_shard_counts(counts: Mapping[str, int] | None) -> dict[str, int]:
    """Model-level TP shard counts; a key and its optimizer states must agree.

    Raises:
        AOAError: naming the key and the disagreeing counts.
    """
    out: dict[str, int] = {}
    seen: dict[str, list[str]] = {}
    split = optimizer_splitter(counts or {})
    for k, n in (counts or {}).items():
        base, suf = split(k)
        if suf in SCALAR_SUFFIXES:
            continue
        if base in out and out[base] != int(n):
            raise AOAError(f"inconsistent shard counts among {base!r} and its optimizer states: "
                           f"{', '.join(seen[base])} have {out[base]} TP shard(s) but {k!r} has {n}")
        out[base] = int(n)
        seen.setdefault(base, []).append(repr(k))
    return out


def source_specs(metadata) -> dict[str, TensorSpec]:
    """``{key: TensorSpec(global_shape, dtype)}`` of a :class:`~oarlock.checkpoint.CheckpointMetadata`: the
    ``source`` argument of :func:`compile_aoa` for a checkpoint on disk."""
    return {k: TensorSpec(tuple(t.global_shape), t.dtype) for k, t in metadata.tensors.items()}


def shard_counts(metadata) -> dict[str, int]:
    """TP shard count of every key of a :class:`~oarlock.checkpoint.CheckpointMetadata`: the number of distinct
    global offsets among its primary shards (as Paddle derives it for ``fused_qkv_old``/``fused_ffn``)."""
    counts = {k: t.shard_count() or 1 for k, t in metadata.tensors.items()}
    recorded = (getattr(metadata, "extra", None) or {}).get(TP_LAYOUTS_KEY) or {}
    if recorded:  # the degree a fused layout was written for wins over the offsets (a reshard may differ)
        for k in counts:
            rec = recorded.get(split_optimizer_suffix(k)[0])
            if isinstance(rec, dict) and isinstance(rec.get("tp"), int) and rec["tp"] > 0:
                counts[k] = rec["tp"]
    return counts


@dataclass
class _Entry:
    desc: TensorDesc
    suffix: str
    spec: TensorSpec
    cast_all: str | None = None      # reverse-mode / allow_cast: cast every ref to the destination dtype


class AOAProgram:
    """A compiled AOA config; implements :class:`~oarlock.checkpoint.model.mapping.MappingProgram`.

    Attributes:
        reverse: whether the statements were inverted (``aoa_config_reverse``).
        statements: the primitive statements as executed (expanded by macros, inverted in reverse mode).
        skipped: destination keys deliberately not loaded (left as initialised): declared source-less with
            ``_ -> key``, or named like a source key dropped with ``key -> _`` (or whose state source was dropped).
        missing: destination keys that no statement and no source key provides, with the reason.
        deleted: source keys dropped with ``key -> _``.
        unused_sources: source keys (model level) that reach no destination key.
        tp_layouts: destination keys written in a TP-degree-dependent layout (``fused_ffn``, ``fused_qkv_old``):
            ``{key: {"statement": ..., "tp": degree, "axis": ..., ["num_heads", "num_key_value_groups"]}}``.
            Writers store it in the checkpoint metadata (``extra["tp_layouts"]``) so that a load at another
            degree re-lays it out (see :func:`oarlock.checkpoint.aoa.layout.relayout_config`).
    """

    def __init__(self, source: Mapping[str, TensorSpec], reverse: bool, statements: list[Primitive]):
        self.source = dict(source)
        self.reverse = reverse
        self.statements = statements
        self.skipped: list[str] = []
        self.missing: dict[str, str] = {}
        self.deleted: list[str] = []
        self.unused_sources: list[str] = []
        self.tp_layouts: dict[str, dict] = {}
        self._entries: dict[str, _Entry] = {}
        self._cache: dict[str, list[SliceMapping]] = {}

    def add_entry(self, key: str, desc: TensorDesc, suffix: str, spec: TensorSpec, cast_all: str | None = None
                  ) -> None:
        """Make ``key`` a destination key: the tensor ``desc`` describes, read under the optimizer-state ``suffix``
        of its sources (``""``: the sources themselves), of ``spec``; ``cast_all``: cast every slice to it."""
        self._entries[key] = _Entry(desc, suffix, spec, cast_all)

    @property
    def deleted_keys(self) -> list[str]:
        """Source keys dropped with ``key -> _`` (the loader does not report them as unexpected)."""
        return list(self.deleted)

    def destination_keys(self) -> list[str]:
        """Destination keys this program fills (model keys, then their optimizer states where present)."""
        return list(self._entries)

    def destination_spec(self, key: str) -> TensorSpec:
        """Global shape and dtype of destination ``key``; raises :class:`AOAError` for an unknown key."""
        return self._entry(key).spec

    def _entry(self, key: str) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            why = self.missing.get(key) or ("declared source-less by '_ -> key'" if key in self.skipped else None)
            raise AOAError(f"{key!r} is not a destination key of this AOA program"
                           + (f" ({why})" if why else "")) from None

    def mappings_for(self, key: str) -> list[SliceMapping]:
        """Slice mappings tiling destination ``key`` (computed on first request, then cached)."""
        got = self._cache.get(key)
        if got is not None:
            return got
        ent = self._entry(key)
        out = []
        if ent.suffix in SCALAR_SUFFIXES:  # beta powers / step counters: one whole accumulator
            src = next(r.src_key + ent.suffix for r in ent.desc.refs if r.src_key + ent.suffix in self.source)
            box = full_box(ent.spec.shape)
            out.append(SliceMapping(key, box, src, box, None, ent.cast_all))
        else:
            for r in ent.desc.refs:
                if ent.suffix:
                    src = r.src_key + ent.suffix
                    cast = ent.spec.dtype if self.source[src].dtype != ent.spec.dtype else None
                else:
                    src, cast = r.src_key, r.cast
                    if ent.cast_all is not None and (cast or "").rsplit(CAST_CHAIN, 1)[-1] != ent.cast_all:
                        cast = ent.cast_all if cast is None else cast + CAST_CHAIN + ent.cast_all
                out.append(SliceMapping(key, r.dst_box, src, r.src_box, _mapping_perm(r), cast))
        self._cache[key] = out
        return out

    def explain(self, keys: Sequence[str] | None = None, *, only: str | None = None,
                tp: int = 1, tp_axes: Mapping[str, int | None] | None = None) -> str:
        """Human-readable listing: every primitive statement, then per destination key each slice's origin, then
        the skipped, missing, deleted and unused keys.

        Args:
            keys: destination keys to list (default: all).
            only: an ``fnmatch`` glob; every section keeps only what names a matching key (a statement is kept
                when one of its names matches).
            tp, tp_axes: with ``tp > 1``, each listed key also shows the row ranges the ``tp`` ranks hold
                (``tp_axes``: key -> split axis or None, as ``convert --tp`` splits it).
        """
        import fnmatch

        def hit(name: str) -> bool:
            return only is None or fnmatch.fnmatchcase(name, only)

        stmts = list(self.statements)
        if only is not None:  # statements naming a matching key, or feeding one (walked backwards)
            need = {k for k in self._entries if hit(k)}
            kept = []
            for p in reversed(stmts):
                if any(hit(n) for n in (*p.lhs, *p.rhs)) or any(n in need for n in p.rhs):
                    kept.append(p)
                    need.difference_update(p.rhs)  # temporaries are reused: only the latest writer feeds a reader
                    need.update(p.lhs)
            stmts = kept[::-1]
        lines = [f"# {len(stmts)} primitive statement(s)" + (" (reverse mode: inverted)" if self.reverse else "")
                 + (f" for keys matching {only!r}" if only is not None else "")]
        lines += [f"  {p.render()}" for p in stmts]
        keys = [k for k in (list(self._entries) if keys is None else list(keys)) if hit(k)]
        lines.append(f"# {len(keys)} destination key(s)")
        for k in keys:
            spec = self.destination_spec(k)
            lines.append(f"{k}  {list(spec.shape)} {spec.dtype}")
            axis = (tp_axes or {}).get(k) if tp > 1 else None
            if axis is not None:
                n = spec.shape[axis]
                step = -(-n // tp)  # torch.chunk sizes, as convert --tp splits
                parts = [f"rank {r}: {min(r * step, n)}:{min((r + 1) * step, n)}" for r in range(tp)]
                layout = self.tp_layouts.get(k)
                extra = f", {layout['statement']} blocks for tp={layout['tp']}" if layout else ""
                lines.append(f"  TP {tp} on axis {axis}{extra}: {'; '.join(parts)}")
            for m in self.mappings_for(k):
                extra = (f"  permute={list(m.permute)}" if m.permute else "") + (f"  cast={m.dtype}" if m.dtype else "")
                lines.append(f"  [{_fmt_box(m.dst_box)}] <- {m.src_key}[{_fmt_box(m.src_box)}]{extra}")
        for k in self.skipped:
            if hit(k):
                lines.append(f"{k}  (not loaded on purpose: '_ -> {k}' or a dropped key of that name; keeps its "
                             "value)")
        for k, why in self.missing.items():
            if hit(k):
                lines.append(f"{k}  MISSING: {why}")
        for what, names in (("deleted", self.deleted), ("unused", self.unused_sources)):
            names = [n for n in names if hit(n)]
            if names:
                more = f" ... ({len(names) - 10} more)" if len(names) > 10 else ""
                lines.append(f"# {len(names)} {what} source key(s): {', '.join(names[:10])}{more}")
        return "\n".join(lines)


def _mapping_perm(r: Ref) -> tuple[int, ...] | None:
    """The ``SliceMapping.permute`` of a ref: its own permutation when it keeps the source's rank; after a reshape,
    the source axes in this tensor's order followed by the unmapped (unit) ones, or None when the non-unit axes
    keep their order (then the source box's row-major elements are the destination box's, unit axes aside)."""
    p = r.perm
    if p is None or (len(p) == len(r.src_box) and None not in p):
        return p
    mapped = [j for j in p if j is not None]
    full = mapped + [j for j in range(len(r.src_box)) if j not in mapped]
    moving = [j for j in full if r.src_box[j][1] - r.src_box[j][0] != 1]
    return None if moving == sorted(moving) else tuple(full)


def _fmt_box(box: Box) -> str:
    return ", ".join(f"{a}:{b}" for a, b in box)
