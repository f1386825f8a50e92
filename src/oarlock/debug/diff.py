"""Find where two captured runs start to diverge, even when their op sequences differ.

The two op sequences are aligned on the key (phase, op, module path, output shapes and dtypes) with
:class:`difflib.SequenceMatcher` (Ratcliff/Obershelp longest matching blocks, ``autojunk`` off), so a run
with an extra op, a missing op or a fused region still lines up everywhere else. Within the aligned pairs
the checksums are compared in execution order of run A; the first pair whose outputs differ is the
divergence. Unaligned ops are reported as structural differences, and the ones before the divergence are
named because they may be its cause. torch's ``DebugMode.check_hash_mismatches`` compares position by
position and stops at the first length mismatch (pytorch#168974); this is the gap filled here.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field

import torch

from oarlock.debug.dump import Dump, format_stack, load_dump
from oarlock.debug.errors import DebugError


def op_key(rec: dict) -> tuple:
    """Alignment key of an op record: (phase, op, module path, output [shape, dtype] list)."""
    return rec["ph"], rec["op"], rec.get("mod"), json.dumps(rec.get("out"))


@dataclass
class OutputDiff:
    """One differing output of an aligned op pair: slot, both checksums, and the max abs/rel difference when
    both runs saved the tensor (rel = max over elements of ``|a - b| / |a|`` where ``a != 0``)."""

    slot: int
    hash_a: str
    hash_b: str
    max_abs: float | None = None
    max_rel: float | None = None


@dataclass
class Divergence:
    """The first aligned op pair whose outputs differ."""

    a: dict
    b: dict
    outputs: list[OutputDiff]
    stack_a: list
    stack_b: list
    fwd_stack_a: list
    fwd_stack_b: list
    user_a: int | None = None  # index in stack_a of the innermost user frame (same for the others)
    user_b: int | None = None
    fwd_user_a: int | None = None
    fwd_user_b: int | None = None

    def user_frames(self) -> dict[str, tuple | None]:
        """The innermost user frame of each stack: keys ``a``, ``b`` (where the op ran) and ``fwd_a``,
        ``fwd_b`` (for a backward op, where its autograd node was created in forward)."""
        pick = lambda fr, u: tuple(fr[u]) if u is not None and u < len(fr) else None  # noqa: E731
        return {"a": pick(self.stack_a, self.user_a), "b": pick(self.stack_b, self.user_b),
                "fwd_a": pick(self.fwd_stack_a, self.fwd_user_a), "fwd_b": pick(self.fwd_stack_b, self.fwd_user_b)}


@dataclass
class StructuralDiff:
    """A stretch of ops that did not align: ``tag`` is difflib's ``replace``/``delete``/``insert``."""

    tag: str
    a_ops: list[dict]
    b_ops: list[dict]


@dataclass
class DiffReport:
    """Result of :func:`diff`.

    Attributes:
        a, b: the two dumps.
        aligned: number of aligned op pairs; ``compared``: pairs whose checksums were compared.
        mismatched: aligned pairs with a differing output checksum.
        first: the first divergence in run A's order, or None.
        structural: unaligned stretches, in order; ``before_first``: those located before ``first``.
    """

    a: Dump
    b: Dump
    aligned: int = 0
    compared: int = 0
    mismatched: int = 0
    first: Divergence | None = None
    structural: list[StructuralDiff] = field(default_factory=list)
    before_first: list[StructuralDiff] = field(default_factory=list)

    def __repr__(self) -> str:
        first = "None" if self.first is None else f"op #{self.first.a['i']} {self.first.a['op']}"
        return (f"DiffReport(a={str(self.a.path)!r}, b={str(self.b.path)!r}, aligned={self.aligned}, "
                f"mismatched={self.mismatched}, first={first}, structural={len(self.structural)})")

    @property
    def diverged(self) -> bool:
        return self.first is not None

    def format(self, max_frames: int = 6) -> str:
        """A human-readable report (what ``oarlock debug diff`` prints)."""
        a, b = self.a, self.b
        lines = [f"A: {a.path} ({len(a.ops)} ops)", f"B: {b.path} ({len(b.ops)} ops)",
                 f"checksum: {a.checksum}; aligned {self.aligned} op pairs, compared {self.compared}, "
                 f"{self.mismatched} with different outputs; {len(self.structural)} unaligned stretch(es)"]
        if self.first is None:
            lines.append("no divergence: every aligned op has identical output checksums")
        else:
            d = self.first
            lines.append("")
            lines.append(f"first divergence: A op #{d.a['i']} / B op #{d.b['i']}  {d.a['op']}  "
                         f"[{_phase(d.a)}]  module {_mod(d.a)}")
            if d.a["ph"] == "b":
                lines.append(f"  autograd node: {d.a.get('nname')}")
            lines.append(f"  inputs: {_inputs(d.a)}")
            for o in d.outputs:
                extra = ""
                if o.max_abs is not None:
                    extra = f"  max abs diff {o.max_abs:.6g}, max rel diff {o.max_rel:.6g}"
                lines.append(f"  output {o.slot} {_fmt_meta(d.a['out'][o.slot])}: A {o.hash_a}  B {o.hash_b}{extra}")
            uf = d.user_frames()
            for side in ("a", "b"):
                where = uf[f"fwd_{side}"] or uf[side]
                what = "created in forward at" if uf[f"fwd_{side}"] else "run at"
                lines.append(f"  {side.upper()} user frame ({what}): "
                             + (f"{where[0]}:{where[1]} in {where[2]}" if where else "(none recorded)"))
            for title, frames, u in (("A call stack", d.stack_a, d.user_a), ("B call stack", d.stack_b, d.user_b),
                                     ("A forward stack of the producer", d.fwd_stack_a, d.fwd_user_a),
                                     ("B forward stack of the producer", d.fwd_stack_b, d.fwd_user_b)):
                if frames:
                    lines.append(f"  {title} (user frame first):")
                    lines.extend(f"    {x}" for x in format_stack(frames, u, max_frames))
        if self.before_first:
            lines.append("")
            lines.append("unaligned ops before the divergence (possible causes):")
            for s in self.before_first[:10]:
                for side, ops in (("A only", s.a_ops), ("B only", s.b_ops)):
                    for r in ops[:5]:
                        lines.append(f"  {side}: #{r['i']} {r['op']} [{_phase(r)}] module {_mod(r)} "
                                     f"-> {_fmt_outs(r)}")
                    if len(ops) > 5:
                        lines.append(f"  {side}: ... {len(ops) - 5} more")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """The report as plain JSON-serialisable data (``oarlock debug diff --json``)."""
        out = {"a": str(self.a.path), "b": str(self.b.path), "checksum": self.a.checksum,
               "aligned": self.aligned, "compared": self.compared, "mismatched": self.mismatched,
               "structural": [{"tag": s.tag, "a": [r["i"] for r in s.a_ops], "b": [r["i"] for r in s.b_ops]}
                              for s in self.structural],
               "first": None}
        if self.first is not None:
            d = self.first
            out["first"] = {"a": d.a, "b": d.b, "outputs": [o.__dict__ for o in d.outputs],
                            "stack_a": d.stack_a, "stack_b": d.stack_b,
                            "fwd_stack_a": d.fwd_stack_a, "fwd_stack_b": d.fwd_stack_b,
                            "user_frames": d.user_frames()}
        return out


def _phase(r: dict) -> str:
    return "forward" if r["ph"] == "f" else "backward"


def _mod(r: dict) -> str:
    m = r.get("mod")
    return "(none)" if m is None else (m or "(root)")


def _fmt_meta(m) -> str:
    return "-" if m is None else f"{m[1]}{m[0]}"


def _fmt_outs(r: dict) -> str:
    return ", ".join(_fmt_meta(m) for m in r.get("out") or [])


def _inputs(r: dict) -> str:
    parts = []
    for m, s in zip(r.get("in") or [], r.get("src") or []):
        where = "user input" if s is None else ("parameter " + s[2:] if s.startswith("p:") else "op #" +
                                                s[1:].replace(".", " output "))
        parts.append(f"{_fmt_meta(m)} from {where}")
    return "; ".join(parts) or "(none)"


def _value_diff(a: Dump, b: Dump, key_a: str | None, key_b: str | None) -> tuple[float | None, float | None]:
    if not key_a or not key_b:
        return None, None
    ta, tb = a.load_tensor(key_a), b.load_tensor(key_b)
    if ta is None or tb is None or ta.shape != tb.shape:
        return None, None
    ta, tb = ta.to(torch.float64), tb.to(torch.float64)
    d = (ta - tb).abs()
    max_abs = float(d.max()) if d.numel() else 0.0
    nz = ta != 0
    max_rel = float((d[nz] / ta[nz].abs()).max()) if bool(nz.any()) else (0.0 if max_abs == 0 else float("inf"))
    return max_abs, max_rel


def diff(a: str | os.PathLike | Dump, b: str | os.PathLike | Dump) -> DiffReport:
    """Align two capture dumps and find the first op whose outputs diverge.

    Args:
        a, b: dump paths (or loaded :class:`Dump` objects) written by :func:`oarlock.debug.capture` with the
            same checksum spec.

    Returns:
        a :class:`DiffReport`; ``report.first`` is None when every aligned op has identical checksums.

    Raises:
        DebugError: a dump was captured without checksums, or the two used different checksum specs.
        DumpFormatError / FileNotFoundError: a path is not a readable dump.
    """
    da = a if isinstance(a, Dump) else load_dump(a)
    db = b if isinstance(b, Dump) else load_dump(b)
    for d in (da, db):
        if d.checksum is None:
            raise DebugError(f"{d.path}: captured with checksum=None; capture both runs with checksum='fast', "
                             "'md5' or 'rounded:N' to compare them")
    if da.checksum != db.checksum:
        raise DebugError(f"checksum specs differ: {da.path} used {da.checksum!r}, {db.path} used "
                         f"{db.checksum!r}; capture both runs with the same spec")
    rep = DiffReport(da, db)
    sm = difflib.SequenceMatcher(None, [op_key(r) for r in da.ops], [op_key(r) for r in db.ops], autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag != "equal":
            s = StructuralDiff(tag, da.ops[i1:i2], db.ops[j1:j2])
            rep.structural.append(s)
            if rep.first is None:
                rep.before_first.append(s)
            continue
        rep.aligned += i2 - i1
        for ra, rb in zip(da.ops[i1:i2], db.ops[j1:j2]):
            ha, hb = ra.get("h") or [], rb.get("h") or []
            slots = [k for k, (x, y) in enumerate(zip(ha, hb)) if x is not None and y is not None]
            if not slots:
                continue
            rep.compared += 1
            bad = [k for k in slots if ha[k] != hb[k]]
            if not bad:
                continue
            rep.mismatched += 1
            if rep.first is None:
                outs = []
                sva, svb = ra.get("sv") or [], rb.get("sv") or []
                for k in bad:
                    mx = _value_diff(da, db, sva[k] if k < len(sva) else None, svb[k] if k < len(svb) else None)
                    outs.append(OutputDiff(k, ha[k], hb[k], *mx))
                ui = lambda dump, sid: dump.user_index.get(sid) if sid is not None else None  # noqa: E731
                rep.first = Divergence(ra, rb, outs, da.stack(ra.get("st")), db.stack(rb.get("st")),
                                       da.stack(ra.get("fst")), db.stack(rb.get("fst")),
                                       ui(da, ra.get("st")), ui(db, rb.get("st")),
                                       ui(da, ra.get("fst")), ui(db, rb.get("fst")))
    return rep
