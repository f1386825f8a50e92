"""The AOA engine (docs/aoa.md, "Primitive statements", "Reverse mode"): an AOA config -> exact slice mappings.

:func:`compile_aoa` parses and macro-expands the statements (:func:`expand_statements`), checks each against the
primitive forms (:mod:`.primitives`), inverts them in reverse mode, runs them over tensor descriptions
(:mod:`.interpreter` over :mod:`.desc`: interval arithmetic on boxes, no tensor data touched) and collects every
destination key's slices into an :class:`~oarlock.checkpoint.aoa.program.AOAProgram`, whose ``mappings_for`` gives
:class:`~oarlock.checkpoint.model.mapping.SliceMapping` objects tiling the key. The names of those modules are
importable from here too.

:data:`MAX_RESHAPE_REFS` (the most slice mappings one ``reshape=`` statement may produce) is read from this module
at each compilation.
"""

from __future__ import annotations

import gc
import warnings
from typing import Mapping, Sequence

from oarlock.checkpoint.aoa.desc import MAX_RESHAPE_REFS, Ref, TensorDesc
from oarlock.checkpoint.aoa.errors import AOAError
from oarlock.checkpoint.aoa.interpreter import Interpreter
from oarlock.checkpoint.aoa.macros import SCALAR_SUFFIXES, KeySet, MacroContext, expand_macros, optimizer_splitter
from oarlock.checkpoint.aoa.parser import Expr, parse_statements
from oarlock.checkpoint.aoa.primitives import Primitive, classify, invert, split_compound
from oarlock.checkpoint.aoa.program import (TP_LAYOUTS_KEY, AOAProgram, fold_optimizer_keys, fold_shard_counts,
                                            normalize_config, shard_counts, source_specs)
from oarlock.checkpoint.model.mapping import TensorSpec
from oarlock.utils import dtype_name

__all__ = ["AOAProgram", "MAX_RESHAPE_REFS", "Primitive", "Ref", "TP_LAYOUTS_KEY", "TensorDesc", "classify",
           "compile_aoa", "expand_statements", "fold_optimizer_keys", "fold_shard_counts", "invert",
           "normalize_config", "shard_counts", "source_specs", "split_compound"]


def _fmt_range(shape: Sequence[int]) -> str:
    return "(" + ", ".join(f"slice(0, {n})" for n in shape) + ("," if len(shape) == 1 else "") + ")"


def _pattern_keys(keys: Sequence[str]) -> KeySet:
    """What patterns match: the model-level keys, then the optimizer-state keys themselves (a template such as
    ``model.*.exp_avg`` matches those; placeholders and ``*`` stand for digits only, so a template without the
    suffix never matches a state key)."""
    model, states = [], []
    split = optimizer_splitter(keys)
    for k in keys:
        base, suf = split(k)
        model.append(base)
        if suf:
            states.append(k)
    return KeySet(model + states)


def expand_statements(aoa_config: object, source_keys: Sequence[str], destination_keys: Sequence[str] | None = None,
                      *, source_shards: Mapping[str, int] | None = None,
                      destination_shards: Mapping[str, int] | None = None,
                      layouts: dict[str, dict] | None = None) -> list[Expr]:
    """Parse and macro-expand ``aoa_config`` against key names only (no shapes): the primitive statements
    as written, before reverse-mode inversion. ``*_shards``: TP shard count per key for ``fused_qkv_old`` and
    ``fused_ffn`` (1 where absent). ``layouts``, if given, receives ``{name: {"statement", "tp", "axis", ...}}``
    for every destination-side name a TP-dependent fused statement writes.

    Raises:
        AOASyntaxError, AOAError: see :func:`compile_aoa`.
    """
    statements, reverse = normalize_config(aoa_config)
    exprs = parse_statements(statements)
    src = _pattern_keys(source_keys)
    dst = _pattern_keys(destination_keys) if destination_keys is not None else None
    ctx = MacroContext(src, dst, reverse, fold_shard_counts(source_shards), fold_shard_counts(destination_shards))
    out = expand_macros(exprs, ctx)
    if layouts is not None:
        layouts.update(ctx.layouts)
    return out


def compile_aoa(aoa_config: object, source: Mapping[str, TensorSpec],
                destination: Mapping[str, TensorSpec] | None = None, *,
                source_shards: Mapping[str, int] | None = None, destination_shards: Mapping[str, int] | None = None,
                allow_cast: bool = False) -> AOAProgram:
    """Compile an AOA config into slice mappings (the language: docs/aoa.md).

    Args:
        aoa_config: ``{"aoa_statements": [str, ...], "aoa_config_reverse": bool}`` or a list of statement strings.
        source: checkpoint key -> global :class:`TensorSpec`; optimizer states ``<model_key><suffix>`` (see
            :data:`~oarlock.checkpoint.aoa.macros.OPTIMIZER_SUFFIXES`) follow the statements of ``<model_key>``.
        destination: model key -> spec, or None for the program's dataflow sinks (export / ``full()``).
        source_shards, destination_shards: TP shard count per key (distinct global offsets of its shards), used
            by ``fused_qkv_old`` and ``fused_ffn``; 1 where absent. See :func:`shard_counts`.
        allow_cast: cast to the destination dtype instead of failing when no AOA cast makes dtypes agree.

    Returns:
        An :class:`AOAProgram` (implements ``MappingProgram``): destination keys are the ``destination`` keys
        that some statement or identically named source key provides (others are listed in ``missing``;
        ``_ -> key`` ones in ``skipped``).

    Raises:
        AOASyntaxError: lexing/parsing/macro errors, naming the statement, column and macro expansion chain.
        AOAError: semantic errors (unknown name, zero-match pattern, indivisible split, concat dtype/shape
            mismatch, destination shape or dtype mismatch, ...), naming the statement, column and macro
            expansion chain.
    """
    # Compilation allocates ~10 small acyclic objects per key; the cyclic GC would rescan them all again and
    # again (a third of the time on 50,000 keys), so it is paused while compiling. One young-generation pass at
    # the end moves the program's objects out of the young generations at once; otherwise the first calls of
    # mappings_for() would pay for that, several times over.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _compile(aoa_config, source, destination, source_shards, destination_shards, allow_cast)
    finally:
        if enabled:
            gc.enable()
            gc.collect(1)


def _canonical_specs(specs: Mapping[str, TensorSpec], what: str) -> dict[str, TensorSpec]:
    """Specs with canonical dtype names (``"float32"``, not ``"F32"`` or ``"torch.float32"``)."""
    names: dict[str, str] = {}
    out = {}
    for k, sp in specs.items():
        dt = names.get(sp.dtype)
        if dt is None:
            try:
                dt = names[sp.dtype] = dtype_name(sp.dtype)
            except ValueError as e:
                raise AOAError(f"{what} key {k!r}: {e}") from None
        out[k] = sp if dt == sp.dtype else TensorSpec(tuple(sp.shape), dt)
    return out


def _compile(aoa_config: object, source: Mapping[str, TensorSpec], destination: Mapping[str, TensorSpec] | None,
             source_shards: Mapping[str, int] | None, destination_shards: Mapping[str, int] | None,
             allow_cast: bool) -> AOAProgram:
    _, reverse = normalize_config(aoa_config)
    source = _canonical_specs(source, "source")
    if destination is not None:
        destination = _canonical_specs(destination, "destination")
    model_src, states = fold_optimizer_keys(source)
    dst_model = None
    split_dst = optimizer_splitter(destination or {})
    if destination is not None:
        dst_model = [split_dst(k)[0] for k in destination]
    layouts: dict[str, dict] = {}
    exprs = expand_statements(aoa_config, list(source), dst_model, source_shards=source_shards,
                              destination_shards=destination_shards, layouts=layouts)
    memo: dict = {}
    prims = [classify(e, memo) for e in split_compound(exprs)]
    if reverse:
        prims = invert(prims)
    prog = AOAProgram(source, reverse, prims)
    # MAX_RESHAPE_REFS is read here, at each compilation, so that setting this module's value takes effect
    ex = Interpreter(model_src, KeySet(model_src), {k: v for k, v in source.items() if k not in model_src},
                     {k: v for k, v in (destination or {}).items() if not split_dst(k)[1]}, MAX_RESHAPE_REFS)
    for p in prims:
        ex.run(p)
    # a dropped model key takes its optimizer states along
    prog.deleted = list(ex.deleted) + [k + s for k in ex.deleted for s in states.get(k, ()) if k + s not in ex.deleted]
    if destination is None:
        wanted = _sink_keys(ex, source, model_src, states)
        prog.skipped = [k for k in ex.created if ex.is_void(k)]
    else:
        wanted = []
        for k in destination:
            if k in ex.env or k in model_src:
                wanted.append((k, k, ""))
            else:
                base, suf = split_dst(k)
                wanted.append((k, base, suf) if suf else (k, k, ""))
    reached: set[str] = set()
    for key, model_key, suf in wanted:
        reached.update(_add_destination(prog, ex, key, model_key, suf, source, model_src, destination, allow_cast))
    # '_ -> key' over a source that stores 'key' too: that stored tensor (and its optimizer states) is
    # deliberately not loaded, which is what '_' says, so it is dropped rather than left "unexpected"
    voided = [k for k in model_src if ex.is_void(k) and k not in ex.read_sources and k not in ex.deleted]
    prog.deleted += [n for k in voided for n in (k, *(k + s for s in states.get(k, ()))) if n not in prog.deleted]
    prog.unused_sources = [k for k in model_src if k not in reached and k not in ex.deleted and k not in voided]
    entries = set(prog.destination_keys())
    prog.tp_layouts = {k: v for k, v in layouts.items() if k in entries}
    return prog


def _mismatch(err: AOAError, key: str, shape: Sequence[int], dtype: str, d: TensorDesc) -> AOAError:
    """``err`` with ``err.mismatch`` set: ``(destination key, its (shape, dtype), the computed (shape, dtype),
    [(source key, source box, permutation), ...])``, so that a caller can say it in its own terms."""
    err.mismatch = (key, (tuple(shape), dtype), (tuple(d.shape), d.dtype),  # type: ignore[attr-defined]
                    [(r.src_key, r.src_box, r.perm) for r in d.refs])
    return err


def _sink_keys(ex: Interpreter, source: Mapping[str, TensorSpec], model_src: Mapping[str, TensorSpec],
               states: Mapping[str, list[str]]) -> list[tuple[str, str, str]]:
    """``(key, model key, optimizer suffix)`` of every destination of a program compiled without destination keys:
    the dataflow sinks (source keys no statement read, and the names last written), each followed by the
    optimizer states its sources carry (unless dropped, or moved by a statement of their own)."""
    sinks = [k for k in model_src if k not in ex.env and k not in ex.read_sources] + list(ex.fresh)
    wanted: list[tuple[str, str, str]] = []
    for k in sinks:
        wanted.append((k, k, ""))
        d = ex.resolve(k)
        if isinstance(d, TensorDesc):
            srcs = {r.src_key for r in d.refs}
            sufs = dict.fromkeys(s for sk in srcs for s in states.get(sk, ()))
            for s in sufs:
                ok = any if s in SCALAR_SUFFIXES else all
                if any(sk + s in ex.deleted or sk + s in ex.read_sources for sk in srcs):
                    continue  # dropped, or moved by a statement of its own
                if ok(sk + s in source for sk in srcs):
                    wanted.append((k + s, k, s))
    return wanted


def _add_destination(prog: AOAProgram, ex: Interpreter, key: str, model_key: str, suf: str,
                     source: Mapping[str, TensorSpec], model_src: Mapping[str, TensorSpec],
                     destination: Mapping[str, TensorSpec] | None, allow_cast: bool) -> list[str]:
    """Make destination ``key`` (``model_key`` under the optimizer suffix ``suf``) an entry of ``prog``, or record
    why it is skipped or missing. Returns the source keys it reads.

    Raises:
        AOAError: a shape or dtype that disagrees with the destination's or the parameter's.
    """
    d = ex.resolve(model_key)
    if d is None or (isinstance(d, str) and d.startswith("deleted by")) or \
            (suf and isinstance(d, TensorDesc) and any(r.src_key + suf in ex.deleted for r in d.refs)):
        # '_ -> key', or named like a key dropped with 'key -> _': deliberately not loaded
        prog.skipped.append(key) if key not in prog.skipped else None
        return []
    if isinstance(d, str):
        prog.missing[key] = d
        return []
    if not suf and model_key not in source and any(r.src_key not in source for r in d.refs):
        lack = next(r.src_key for r in d.refs if r.src_key not in source)
        prog.missing[key] = f"source key {lack!r} exists only through its optimizer states"
        return []
    if suf and suf not in SCALAR_SUFFIXES:
        lack = [r.src_key + suf for r in d.refs if r.src_key + suf not in source]
        if lack:
            prog.missing[key] = f"source optimizer state {lack[0]!r} does not exist"
            return []
    if suf in SCALAR_SUFFIXES:
        srcs = list(dict.fromkeys(r.src_key + suf for r in d.refs if r.src_key + suf in source))
        if not srcs:
            prog.missing[key] = f"no source holds a {suf} accumulator for {model_key!r}"
            return []
        if len(srcs) > 1:
            warnings.warn(f"AOA: {key!r} gathers several sources; its accumulator is taken from {srcs[0]!r}")
        sspec = source[srcs[0]]
        spec = destination[key] if destination is not None else sspec
        if tuple(spec.shape) != tuple(sspec.shape):
            raise AOAError(f"destination {key!r} has shape {list(spec.shape)} but its source accumulator "
                           f"{srcs[0]!r} has shape {list(sspec.shape)}")
        prog.add_entry(key, d, suf, TensorSpec(tuple(spec.shape), spec.dtype),
                       spec.dtype if spec.dtype != sspec.dtype else None)
        return [r.src_key for r in d.refs]
    if suf:
        for r in d.refs:
            sshape = source[r.src_key + suf].shape
            if r.src_key in model_src and tuple(sshape) != tuple(model_src[r.src_key].shape):
                raise AOAError(f"optimizer state {r.src_key + suf!r} has shape {list(sshape)} but its parameter "
                               f"{r.src_key!r} has shape {list(model_src[r.src_key].shape)}")
        state_dtype = source[d.refs[0].src_key + suf].dtype if d.refs else d.dtype
    cast_all = None
    if destination is not None:
        spec = destination[key]
        dtype = dtype_name(spec.dtype)
        if tuple(spec.shape) != tuple(d.shape):
            raise _mismatch(AOAError(
                f"destination {key!r} does not match the tensor AOA computes for it: current model param slice "
                f"range: {_fmt_range(spec.shape)}, preloaded weights param slice range: {_fmt_range(d.shape)}. "
                "Please check the AOA statements (a missing '^T', a wrong split/concat axis?)",
                d.expr, name=model_key), key, spec.shape, dtype, d)
        if not suf and dtype != d.dtype:
            if not (prog.reverse or allow_cast):
                raise _mismatch(AOAError(f"{key!r}: the source is {d.dtype} but the destination is {dtype}; direct "
                                         "assignment of tensors of different types is prohibited, add an AOA cast "
                                         f"(\"{model_key} -> {model_key}, dtype='{dtype}'\")", d.expr, name=model_key),
                                key, spec.shape, dtype, d)
            cast_all = dtype
    else:
        dtype = state_dtype if suf else d.dtype
    prog.add_entry(key, d, suf, TensorSpec(tuple(d.shape), dtype), cast_all)
    return [r.src_key for r in d.refs]
