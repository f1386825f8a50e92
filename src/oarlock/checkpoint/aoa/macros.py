"""Macro expansion (docs/aoa.md, "Macros"): rewrite parsed statements into primitive statements.

Each macro runs over *all* expressions before the next one starts, in this order:

1. ``$LAYER_ID_OFFSET``: renumber layers, ``L`` on the left becomes ``L-1`` on the right.
2. ``$LAYER_ID`` / ``$EXPERT_ID``: one statement per id tuple found in the keys. Several placeholders are matched
   *jointly* (the tuples that occur in one key), not as an independent Cartesian product.
3. ``name[a:b]``: the list ``name_a, ..., name_{b-1}``.
4. ``prefix*suffix``: every key ``prefix<digits>suffix``, sorted by the number (left side: keys of the tensors
   read; right side: keys of the tensors produced).
5. ``prefix**suffix`` (extension): every source key ``prefix<anything>suffix`` no other statement reads.
6. chain recorder: name edges used to find the TP shard count of a temporary name.
7. ``X^T``: ``X -> X_transpose_tmp, permute='[]'`` then ``X_transpose_tmp`` in place of ``X^T``.
8. ``fused_qkv_old``, ``fused_ffn``, ``fused_qkv``: split/concat head- or block-wise pieces.

The language reference is docs/aoa.md.

In reverse mode the statements are expanded as written and inverted afterwards by the engine, so the
placeholders are matched on the right side (which then names source keys).
"""

from __future__ import annotations

import bisect
import difflib
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from oarlock.checkpoint.aoa.errors import AOAError, AOASyntaxError
from oarlock.checkpoint.aoa.parser import VOID, Expr

PLACEHOLDERS = ("LAYER_ID", "EXPERT_ID")
_PLACEHOLDER = re.compile(r"\$(LAYER_ID|EXPERT_ID)(?![A-Za-z0-9_])")
_OFFSET = "$LAYER_ID_OFFSET"
_ARRAY = re.compile(r"^(.*)\[(-?\d+):(-?\d+)\]$")
_DIGITS = re.compile(r"[#\d]+")  # digit runs (and '#' so that adjacent runs collapse into one '#')
_ANY_PLACEHOLDER = re.compile(r"\$(?:LAYER_ID_OFFSET|LAYER_ID|EXPERT_ID)(?![A-Za-z0-9_])")

# Most names one range or fused macro may expand to: `name[0:1000000000]` would otherwise build 10^9 strings until
# memory runs out. A real model's largest expansion (experts x layers) is far below this.
MAX_EXPANSION = 1_000_000

# Suffixes of optimizer states saved next to a model key (Paddle names, then torch-style names used by oarlock).
OPTIMIZER_SUFFIXES = (".moment1_0", ".moment2_0", ".w_0", ".velocity_0", ".beta1_pow_acc_0", ".beta2_pow_acc_0",
                      ".exp_avg_sq", ".exp_avg", ".momentum_buffer", ".max_exp_avg_sq", ".master_weight", ".step")
# States with their own small shape (step counters, beta powers) rather than the parameter's shape.
SCALAR_SUFFIXES = (".beta1_pow_acc_0", ".beta2_pow_acc_0", ".step")


_SUFFIX_SET = frozenset(OPTIMIZER_SUFFIXES)  # each suffix is one dotted component: an O(1) lookup of the tail


def split_optimizer_suffix(key: str) -> tuple[str, str]:
    """``("model.w", ".moment1_0")`` for ``"model.w.moment1_0"``; ``(key, "")`` for a model key."""
    i = key.rfind(".")
    if i > 0 and key[i:] in _SUFFIX_SET:
        return key[:i], key[i:]
    return key, ""


def optimizer_splitter(keys: Iterable[str]) -> Callable[[str], tuple[str, str]]:
    """:func:`split_optimizer_suffix` that knows the whole key set, so that keys which merely *end* like an
    optimizer state are recognised as model keys: a key with optimizer states of its own
    (``linear_0.w_0`` next to ``linear_0.w_0.moment1_0``), and a lone ``.w_0`` key (Paddle's static-graph
    parameter names ``fc_0.w_0``) whose base is no key and has no other state. Everything else splits as
    :func:`split_optimizer_suffix` does (an optimizer-only checkpoint keeps its states)."""
    keyset = set(keys)
    bases: dict[str, int] = {}
    for k in keyset:
        b, s = split_optimizer_suffix(k)
        if s:
            bases[b] = bases.get(b, 0) + 1

    def split(key: str) -> tuple[str, str]:
        b, s = split_optimizer_suffix(key)
        if not s or key in bases:  # not suffixed, or a parameter with states of its own
            return key, ""
        if s == ".w_0" and b not in keyset and bases.get(b, 0) == 1:
            return key, ""  # a lone Paddle parameter name
        return b, s
    return split


class KeySet:
    """An ordered key list with prefix search (sorted copy + bisect): matching a pattern against 50,000 keys
    only visits the keys that share the pattern's literal prefix."""

    def __init__(self, keys: Iterable[str]):
        self.keys = list(dict.fromkeys(keys))
        self._sorted = sorted(self.keys)
        self._set = set(self.keys)
        self._by_signature: dict[str, list[str]] | None = None

    def with_signature(self, signature: str) -> list[str]:
        """Keys whose digit runs replaced by ``#`` equal ``signature`` (index built on first use): a template
        such as ``layers.$LAYER_ID.experts.$EXPERT_ID.w`` is only matched against keys of its own form."""
        if self._by_signature is None:
            idx: dict[str, list[str]] = {}
            sub = _DIGITS.sub
            for k in self._sorted:
                idx.setdefault(sub("#", k), []).append(k)
            self._by_signature = idx
        return self._by_signature.get(signature, [])

    def __contains__(self, key: str) -> bool:
        return key in self._set

    def with_prefix(self, prefix: str) -> list[str]:
        i = bisect.bisect_left(self._sorted, prefix)
        j = bisect.bisect_left(self._sorted, prefix + "\U0010ffff")
        return self._sorted[i:j]

    def closest(self, pattern: str, n: int = 3) -> list[str]:
        probe = _PLACEHOLDER.sub("0", pattern.replace(_OFFSET, "0")).replace("*", "0")
        return difflib.get_close_matches(probe, self.keys, n=n, cutoff=0.3)


@dataclass
class MacroContext:
    """What macros match against: model-level key sets (optimizer suffixes stripped) and TP shard counts.

    ``left``/``right``: keys that names left/right of ``->`` refer to (forward: source/destination; reverse:
    destination/source). ``left_shards``/``right_shards`` likewise (key -> number of TP shards; 1 if absent).
    """

    source: KeySet
    destination: KeySet | None
    reverse: bool = False
    source_shards: dict[str, int] = field(default_factory=dict)
    destination_shards: dict[str, int] = field(default_factory=dict)
    fwd: dict[str, list[str]] = field(default_factory=dict)
    bwd: dict[str, list[str]] = field(default_factory=dict)
    # destination name -> the TP-dependent layout a fused_ffn / fused_qkv_old statement wrote it in
    layouts: dict[str, dict] = field(default_factory=dict)

    def record_layout(self, e: Expr, name: str, side: str, tp: int) -> None:
        """Note that ``name`` (``side`` of ``->``) is written in ``e``'s TP-blocked layout of degree ``tp``, if
        that side names destination keys (the right in forward mode, the left in reverse mode)."""
        if (side == "right") != self.reverse:
            rec: dict = {"statement": e.keyword, "tp": int(tp), "axis": e.attr("axis", 1)}
            for k in ("num_heads", "num_key_value_groups"):
                if e.attr(k) is not None:
                    rec[k] = e.attr(k)
            self.layouts[name] = rec

    @property
    def left(self) -> KeySet | None:
        return self.destination if self.reverse else self.source

    @property
    def right(self) -> KeySet | None:
        return self.source if self.reverse else self.destination

    exprs: list[Expr] = field(default_factory=list)

    def _edges(self) -> None:
        if self.exprs:  # built on first use only: most configs never need it
            for e in self.exprs:
                for a in e.lhs:
                    a = _strip_t(a)
                    for b in e.rhs:
                        if a != VOID and b != VOID:
                            self.fwd.setdefault(a, []).append(b)
                            self.bwd.setdefault(b, []).append(a)
            self.exprs = []

    def shard_count(self, name: str, side: str, expr: Expr) -> int:
        """TP shard count of ``name`` used ``side`` ("left"/"right") of ``->``; a temporary name is followed
        through the recorded statements (backwards for the left side, forwards for the right) to a real key."""
        counts = (self.destination_shards if self.reverse else self.source_shards) if side == "left" else \
            (self.source_shards if self.reverse else self.destination_shards)
        if not counts:
            return 1
        self._edges()
        edges = self.bwd if side == "left" else self.fwd
        seen = [name]
        cur = name
        while cur not in counts:
            nxt = [n for n in edges.get(cur, ()) if n != cur]
            if not nxt:
                return 1
            cur = nxt[0]
            if cur in seen:
                raise AOAError(f"Infinite loop detected while resolving the shard count of {name!r} through the "
                               f"name chain {' -> '.join(seen + [cur])}", expr, name=name)
            seen.append(cur)
        return int(counts[cur])


def _strip_t(name: str) -> str:
    return name[:-2] if name.endswith("^T") else name


def _zero_match(what: str, pattern: str, keys: KeySet | None, side: str, expr: Expr) -> AOAError:
    near = keys.closest(pattern) if keys is not None and keys.keys else []
    hint = f"; closest keys: {', '.join(near)}" if near else "; no similar key"
    return AOAError(f"{what} {pattern!r} matches no {side} key{hint}", expr, name=pattern)


def _template_regex(name: str, placeholders: Sequence[str]) -> tuple[str, re.Pattern]:
    """(literal prefix, compiled regex) where each ``$X`` becomes a digit group (back-reference if repeated)."""
    parts = re.split(r"(\$(?:LAYER_ID_OFFSET|LAYER_ID|EXPERT_ID)(?![A-Za-z0-9_]))", name)
    seen: set[str] = set()
    pat = []
    for i, p in enumerate(parts):
        if i % 2 == 0:  # a '*' beside placeholders stands for any number (expanded later by the star macro)
            pat.append(r"\d+".join(re.escape(x) for x in p.split("*")))
        else:
            g = p[1:]
            pat.append(f"(?P={g})" if g in seen else f"(?P<{g}>\\d+)")
            seen.add(g)
    return parts[0], re.compile("".join(pat))


def _signature(template: str) -> str:
    return _DIGITS.sub("#", _ANY_PLACEHOLDER.sub("#", template).replace("*", "#"))  # 'w1$LAYER_ID' -> 'w#', like the key 'w15' 


def _match_ids(template: str, keys: KeySet, placeholders: Sequence[str]) -> list[tuple[int, ...]]:
    template = _strip_t(template)
    prefix, rx = _template_regex(template, placeholders)
    found = set()
    for k in keys.with_signature(_signature(template)):
        m = rx.fullmatch(k)
        if m is not None:
            found.add(tuple(int(m.group(p)) for p in placeholders))
    return sorted(found)


def macro_layer_id_offset(exprs: list[Expr], ctx: MacroContext) -> list[Expr]:
    """``$LAYER_ID_OFFSET``: for each layer id L found in the source keys, L on the left, L-1 on the right."""
    out = []
    for e in exprs:
        if not any(_OFFSET in n for n in e.names()):
            out.append(e)
            continue
        for n in e.names():
            if n != VOID and _OFFSET not in n:
                raise AOASyntaxError(f"every name of a $LAYER_ID_OFFSET statement must contain the tag; {n!r} "
                                     "does not", e, name=n)
        side = e.rhs if ctx.reverse else e.lhs
        template = next((n for n in side if _OFFSET in n), None)
        if template is None:
            raise AOASyntaxError("$LAYER_ID_OFFSET must appear in a source name", e)
        prefix, rx = _template_regex(_strip_t(template), ["LAYER_ID_OFFSET"])
        ids = sorted({int(m.group("LAYER_ID_OFFSET")) for k in ctx.source.with_signature(_signature(_strip_t(template)))
                      if (m := rx.fullmatch(k)) is not None})
        if not ids:
            raise _zero_match("$LAYER_ID_OFFSET pattern", _strip_t(template), ctx.source, "source", e)
        for v in ids:
            left, right = (v + 1, v) if ctx.reverse else (v, v - 1)
            out.append(e.derive("$LAYER_ID_OFFSET", [n.replace(_OFFSET, str(left)) for n in e.lhs],
                                [n.replace(_OFFSET, str(right)) for n in e.rhs], keyword=e.keyword))
    return out


def macro_ids(exprs: list[Expr], ctx: MacroContext) -> list[Expr]:
    """``$LAYER_ID``/``$EXPERT_ID``: one statement per id tuple occurring jointly in one source key.

    A template left of ``->`` (right in reverse mode) is matched against the source keys, then against the
    temporaries that earlier statements produce (later ones in reverse mode, where data flows right to left);
    a statement whose placeholders appear only on the other side is matched against the destination keys.
    """
    groups: list[list[Expr]] = []
    temps = _Temps()
    for e in (reversed(exprs) if ctx.reverse else exprs):
        got = _expand_ids(e, ctx, temps)
        groups.append(got)
        for d in got:
            temps.names.extend(n for n in (d.lhs if ctx.reverse else d.rhs) if n != VOID)
    if ctx.reverse:
        groups.reverse()
    return [d for g in groups for d in g]


class _Temps:
    """Names produced by the statements expanded so far; their KeySet is built only when a template needs it."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._keys: KeySet | None = None

    def keys(self) -> KeySet | None:
        if not self.names:
            return None
        if self._keys is None or len(self._keys.keys) != len(dict.fromkeys(self.names)):
            self._keys = KeySet(self.names)
        return self._keys


def _expand_ids(e: Expr, ctx: MacroContext, temps: _Temps) -> list[Expr]:
    used: list[str] = []
    for n in e.names():
        for m in _PLACEHOLDER.finditer(n):
            if m.group(1) not in used:
                used.append(m.group(1))
        if "$" in _PLACEHOLDER.sub("", n):
            bad = n[n.index("$", ):].split(".")[0]
            raise AOASyntaxError(f"unknown placeholder {bad!r} (known: $LAYER_ID, $EXPERT_ID, $LAYER_ID_OFFSET)",
                                 e, name=n)
    if not used:
        return [e]
    src_side, dst_side = (e.rhs, e.lhs) if ctx.reverse else (e.lhs, e.rhs)
    template = next((n for n in src_side if all(f"${p}" in n for p in used)), None)
    tries: list[tuple[str, KeySet | None, str]] = []
    if template is not None:
        tries = [(template, ctx.source, "source"), (template, None, "temporary")]
    else:
        template = next((n for n in dst_side if all(f"${p}" in n for p in used)), None)
        if template is None:
            raise AOASyntaxError(f"no name of this statement contains every placeholder used "
                                 f"({', '.join('$' + p for p in used)}), so their values cannot be matched jointly",
                                 e)
        keys = ctx.destination if ctx.destination is not None else ctx.source
        tries = [(template, keys, "destination" if keys is ctx.destination else "source")]
    order = list(dict.fromkeys(m.group(1) for m in _PLACEHOLDER.finditer(template)))
    tuples: list[tuple[int, ...]] = []
    for _, keys, side in tries:
        keys = temps.keys() if side == "temporary" else keys
        if keys is not None:
            tuples = _match_ids(template, keys, order)
            if tuples:
                break
    if not tuples:
        raise _zero_match("placeholder pattern", _strip_t(template), tries[0][1], tries[0][2], e)
    out = []
    for t in tuples:
        def sub(n: str, t=t) -> str:
            for p, v in zip(order, t):
                n = n.replace(f"${p}", str(v))
            return n
        out.append(e.derive("$LAYER_ID/$EXPERT_ID", [sub(n) for n in e.lhs], [sub(n) for n in e.rhs],
                            keyword=e.keyword))
    return out


def macro_array(exprs: list[Expr], ctx: MacroContext) -> list[Expr]:
    """``name[a:b]`` -> ``name_a, ..., name_{b-1}``."""
    out = []
    for e in exprs:
        if not any("[" in n for n in e.names()):
            out.append(e)
            continue

        def expand(names: list[str]) -> list[str]:
            res = []
            for n in names:
                m = _ARRAY.match(n)
                if m is None:
                    res.append(n)
                    continue
                a, b = int(m.group(2)), int(m.group(3))
                if not 0 <= a < b:
                    raise AOASyntaxError(f"array range [{a}:{b}] of {m.group(1)!r} must satisfy 0 <= a < b", e,
                                         name=n)
                if b - a > MAX_EXPANSION:
                    raise AOASyntaxError(f"array range [{a}:{b}] of {m.group(1)!r} expands to {b - a} names, more "
                                         f"than the limit of {MAX_EXPANSION}", e, name=n)
                res.extend(f"{m.group(1)}_{i}" for i in range(a, b))
            return res
        out.append(e.derive("array [a:b]", expand(e.lhs), expand(e.rhs), keyword=e.keyword))
    return out


def macro_star(exprs: list[Expr], ctx: MacroContext) -> list[Expr]:
    """``prefix*suffix`` -> every key ``prefix<digits>suffix`` sorted by the number."""
    out = []
    for e in exprs:
        if not any("*" in n for n in e.names()) or any("**" in n for n in e.names()):  # '**': macro_rest
            out.append(e)
            continue

        def expand(names: list[str], keys: KeySet | None, side: str) -> list[str]:
            res = []
            for n in names:
                if "*" not in n:
                    res.append(n)
                    continue
                base, t = (_strip_t(n), "^T" if n.endswith("^T") else "")
                if base.count("*") > 1:
                    raise AOASyntaxError(f"{n!r} holds more than one '*'", e, name=n)
                if keys is None:
                    raise AOAError(f"{n!r} right of '->' can only be expanded against destination keys, and none "
                                   "were given", e, name=n)
                prefix, suffix = base.split("*")
                rx = re.compile(re.escape(prefix) + r"(\d+)" + re.escape(suffix))
                hits = sorted((int(m.group(1)), k) for k in keys.with_prefix(prefix) if (m := rx.fullmatch(k)))
                if not hits:
                    raise _zero_match("pattern", base, keys, side, e)
                res.extend(k + t for _, k in hits)
            return res
        lside, rside = ("destination", "source") if ctx.reverse else ("source", "destination")
        out.append(e.derive("star *", expand(e.lhs, ctx.left, lside), expand(e.rhs, ctx.right, rside),
                            keyword=e.keyword))
    return out


def macro_rest(exprs: list[Expr], ctx: MacroContext) -> list[Expr]:
    """``**`` (an extension): ``model.** -> **`` renames every source key ``model.<anything>`` that no other
    statement reads to ``<anything>`` (prefix renames, e.g. dropping HF's ``model.`` prefix around the
    statements that fuse q/k/v). Every name of the statement holds ``**`` exactly once; optimizer states follow
    their model keys as usual."""
    if not any("**" in n for e in exprs for n in e.names()):
        return exprs
    read = set()
    for e in exprs:
        if not any("**" in n for n in e.names()):
            read.update(_strip_t(n) for n in (e.rhs if ctx.reverse else e.lhs))
    keys = ctx.source
    model = [k for k in keys.keys if not (split_optimizer_suffix(k)[1] and split_optimizer_suffix(k)[0] in keys)]
    out = []
    for e in exprs:
        if not any("**" in n for n in e.names()):
            out.append(e)
            continue
        for n in e.names():
            if _strip_t(n).count("**") != 1 or "*" in _strip_t(n).replace("**", ""):
                raise AOASyntaxError(f"{n!r}: with '**' every name of the statement holds '**' exactly once (and no "
                                     "other '*')", e, name=n)
        src_side = e.rhs if ctx.reverse else e.lhs
        if len(src_side) != 1:
            raise AOASyntaxError("a '**' statement reads one name", e, name=src_side[0])
        prefix, suffix = _strip_t(src_side[0]).split("**")
        hits = [k for k in model if k.startswith(prefix) and k.endswith(suffix) and len(k) > len(prefix) + len(suffix)
                and k not in read]
        if not hits:
            raise _zero_match("pattern", _strip_t(src_side[0]), ctx.source, "source", e)
        for k in hits:
            mid = k[len(prefix):len(k) - len(suffix)]
            out.append(e.derive("rest **", [n.replace("**", mid) for n in e.lhs], [n.replace("**", mid) for n in e.rhs],
                                keyword=e.keyword))
            read.add(k)
    return out


def macro_record_chain(exprs: list[Expr], ctx: MacroContext) -> list[Expr]:
    """Record the statements whose name edges (``^T`` stripped) let fused macros resolve the shard counts of
    temporaries; the edge index is built lazily, on the first lookup that needs it."""
    ctx.exprs = list(exprs)
    return exprs


def macro_transpose(exprs: list[Expr], ctx: MacroContext) -> list[Expr]:
    """``X^T`` (left only) -> ``X -> X_transpose_tmp, permute='[]'`` and ``X_transpose_tmp`` in its place."""
    out = []
    t_attrs = [("permute", "[]")]
    for e in exprs:
        for n in e.rhs:
            if "^" in n:
                raise AOASyntaxError(f"'^T' is not allowed right of '->' ({n!r}): assign the tensor first, then "
                                     f"transpose it in a later statement, e.g. 'x -> tmp' and 'tmp^T -> y'",
                                     e, name=n)
        if not any("^" in n for n in e.lhs):
            out.append(e)
            continue
        lhs = []
        done: set[str] = set()
        for n in e.lhs:
            if "^" in n and not (n.endswith("^T") and "^" not in n[:-2]):
                raise AOASyntaxError(f"{n!r}: '^' may only appear as the suffix '^T'", e, name=n)
            if n.endswith("^T"):
                x = n[:-2]
                if x not in done:
                    out.append(e.derive("transpose ^T", [x], [f"{x}_transpose_tmp"], t_attrs))
                    done.add(x)
                lhs.append(f"{x}_transpose_tmp")
            else:
                lhs.append(n)
        out.append(e.derive("transpose ^T", lhs, list(e.rhs), keyword=e.keyword))
    return out


def _int_param(e: Expr, name: str) -> int:
    v = e.attr(name)
    if v is None:
        raise AOASyntaxError(f"{e.keyword} needs the parameter {name}=", e, name=e.keyword)
    if not isinstance(v, int) or v <= 0:
        raise AOASyntaxError(f"{e.keyword}: {name} must be a positive integer, got {v!r}", e, name=name)
    if v > MAX_EXPANSION:
        raise AOASyntaxError(f"{e.keyword}: {name}={v} is more than the limit of {MAX_EXPANSION} pieces", e,
                             name=name)
    return v


def _check_params(e: Expr, allowed: Sequence[str]) -> int:
    seen = set()
    for k, _ in e.attrs:
        if k not in allowed:
            raise AOASyntaxError(f"unsupported attribute {k!r} for {e.keyword} (allowed: {', '.join(allowed)})",
                                 e, name=k)
        if k in seen:
            raise AOASyntaxError(f"attribute {k!r} given twice", e, name=k)
        seen.add(k)
    axis = e.attr("axis", 1)
    if not isinstance(axis, int):
        raise AOASyntaxError(f"{e.keyword}: axis must be an integer, got {axis!r}", e, name="axis")
    for n in e.names():
        if split_optimizer_suffix(n)[1]:
            raise AOAError(f"{n!r}: AOA notions apply only to the model state, but are automatically propagated to "
                           "the optimizer state; write the statement for the model key only", e, name=n)
    return axis


def _fused_qkv(e: Expr, ctx: MacroContext) -> list[Expr]:
    axis = _check_params(e, ("num_heads", "num_key_value_groups", "axis"))
    h, g = _int_param(e, "num_heads"), _int_param(e, "num_key_value_groups")
    if h % g:
        raise AOASyntaxError(f"fused_qkv: num_heads={h} is not divisible by num_key_value_groups={g}", e,
                             name="num_heads")
    r = h // g
    ax = [("axis", axis)]

    def layout(q: str, k: str, v: str) -> list[str]:
        out = []
        for j in range(g):
            out += [f"{q}{j * r + i}" for i in range(r)] + [f"{k}{j}", f"{v}{j}"]
        return out
    stage = "fused_qkv"
    if len(e.lhs) == 1 and len(e.rhs) == 3:
        (x,), (q, k, v) = e.lhs, e.rhs
        return [e.derive(stage, [x], layout(q, k, v), ax),
                e.derive(stage, [f"{q}{i}" for i in range(h)], [q], ax),
                e.derive(stage, [f"{k}{i}" for i in range(g)], [k], ax),
                e.derive(stage, [f"{v}{i}" for i in range(g)], [v], ax)]
    if len(e.lhs) == 3 and len(e.rhs) == 1:
        (q, k, v), (x,) = e.lhs, e.rhs
        return [e.derive(stage, [q], [f"{q}{i}" for i in range(h)], ax),
                e.derive(stage, [k], [f"{k}{i}" for i in range(g)], ax),
                e.derive(stage, [v], [f"{v}{i}" for i in range(g)], ax),
                e.derive(stage, layout(q, k, v), [x], ax)]
    raise AOASyntaxError(f"fused_qkv takes 1 -> 3 (fused -> q, k, v) or 3 -> 1 names, got "
                         f"{len(e.lhs)} -> {len(e.rhs)}", e, name=e.keyword)


def _fused_qkv_old(e: Expr, ctx: MacroContext) -> list[Expr]:
    axis = _check_params(e, ("num_heads", "num_key_value_groups", "axis"))
    h, kv = _int_param(e, "num_heads"), _int_param(e, "num_key_value_groups")
    ax = [("axis", axis)]
    t = "fused_qkv_old_tmp"

    def layout(T: int, key: str) -> list[str]:
        if h % T or kv % T:
            raise AOAError(f"fused_qkv_old: {key!r} has {T} TP shards, which do not divide num_heads={h} and "
                           f"num_key_value_groups={kv}", e, name=key)
        out = []
        for rk in range(T):
            out += [f"{t}.Q_{i}" for i in range(rk * h // T, (rk + 1) * h // T)]
            out += [f"{t}.K_{i}" for i in range(rk * kv // T, (rk + 1) * kv // T)]
            out += [f"{t}.V_{i}" for i in range(rk * kv // T, (rk + 1) * kv // T)]
        return out
    stage = "fused_qkv_old"
    qs, ks, vs = ([f"{t}.{c}_{i}" for i in range(n)] for c, n in (("Q", h), ("K", kv), ("V", kv)))
    def count(name: str, side: str) -> int:
        n = ctx.shard_count(name, side, e)
        ctx.record_layout(e, name, side, n)
        return n
    if len(e.lhs) == 1 and len(e.rhs) == 1:
        x, y = e.lhs[0], e.rhs[0]
        return [e.derive(stage, [x], layout(count(x, "left"), x), ax),
                e.derive(stage, layout(count(y, "right"), y), [y], ax)]
    if len(e.lhs) == 1 and len(e.rhs) == 3:
        x = e.lhs[0]
        return [e.derive(stage, [x], layout(count(x, "left"), x), ax)] + \
            [e.derive(stage, names, [d], ax) for names, d in zip((qs, ks, vs), e.rhs)]
    if len(e.lhs) == 3 and len(e.rhs) == 1:
        y = e.rhs[0]
        return [e.derive(stage, [s], names, ax) for names, s in zip((qs, ks, vs), e.lhs)] + \
            [e.derive(stage, layout(count(y, "right"), y), [y], ax)]
    raise AOASyntaxError(f"fused_qkv_old takes 1 -> 1, 1 -> 3 or 3 -> 1 names, got {len(e.lhs)} -> {len(e.rhs)}",
                         e, name=e.keyword)


def _fused_ffn(e: Expr, ctx: MacroContext) -> list[Expr]:
    axis = _check_params(e, ("axis",))
    ax = [("axis", axis)]
    t = "fused_ffn_tmp"

    def layout(T: int, n: int) -> list[str]:
        out = []
        for rk in range(T):
            idx = range(rk * n // T, (rk + 1) * n // T)
            out += [f"{t}.GATE_{i}" for i in idx] + [f"{t}.UP_{i}" for i in idx]
        return out
    stage = "fused_ffn"
    if len(e.lhs) == 1 and len(e.rhs) == 1:
        x, y = e.lhs[0], e.rhs[0]
        ts, td = ctx.shard_count(x, "left", e), ctx.shard_count(y, "right", e)
        ctx.record_layout(e, x, "left", ts)
        ctx.record_layout(e, y, "right", td)
        n = math.lcm(ts, td)
        return [e.derive(stage, [x], layout(ts, n), ax), e.derive(stage, layout(td, n), [y], ax)]
    if len(e.lhs) == 1 and len(e.rhs) == 2:
        x = e.lhs[0]
        n = ctx.shard_count(x, "left", e)
        ctx.record_layout(e, x, "left", n)
        return [e.derive(stage, [x], layout(n, n), ax),
                e.derive(stage, [f"{t}.GATE_{i}" for i in range(n)], [e.rhs[0]], ax),
                e.derive(stage, [f"{t}.UP_{i}" for i in range(n)], [e.rhs[1]], ax)]
    if len(e.lhs) == 2 and len(e.rhs) == 1:
        y = e.rhs[0]
        n = ctx.shard_count(y, "right", e)
        ctx.record_layout(e, y, "right", n)
        return [e.derive(stage, [e.lhs[0]], [f"{t}.GATE_{i}" for i in range(n)], ax),
                e.derive(stage, [e.lhs[1]], [f"{t}.UP_{i}" for i in range(n)], ax),
                e.derive(stage, layout(n, n), [y], ax)]
    raise AOASyntaxError(f"fused_ffn takes 1 -> 1, 1 -> 2 (-> gate, up) or 2 -> 1 names, got "
                         f"{len(e.lhs)} -> {len(e.rhs)}", e, name=e.keyword)


_FUSED: dict[str, Callable[[Expr, MacroContext], list[Expr]]] = {
    "fused_qkv_old": _fused_qkv_old, "fused_ffn": _fused_ffn, "fused_qkv": _fused_qkv}


def macro_fused(exprs: list[Expr], ctx: MacroContext) -> list[Expr]:
    """``fused_qkv_old``, ``fused_ffn``, ``fused_qkv`` (in this order, as in Paddle)."""
    out = list(exprs)
    for kw, fn in _FUSED.items():
        nxt = []
        for e in out:
            nxt.extend(fn(e, ctx) if e.keyword == kw else [e])
        out = nxt
    return out


MACROS: tuple[tuple[str, Callable[[list[Expr], MacroContext], list[Expr]]], ...] = (
    ("$LAYER_ID_OFFSET", macro_layer_id_offset),
    ("$LAYER_ID/$EXPERT_ID", macro_ids),
    ("array [a:b]", macro_array),
    ("star *", macro_star),
    ("rest **", macro_rest),
    ("chain recorder", macro_record_chain),
    ("transpose ^T", macro_transpose),
    ("fused", macro_fused),
)


def expand_macros(exprs: list[Expr], ctx: MacroContext) -> list[Expr]:
    """Run every macro of :data:`MACROS` in order over all expressions."""
    for _, fn in MACROS:
        exprs = fn(exprs, ctx)
    return exprs
