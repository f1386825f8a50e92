"""Compare the logical tensors of two checkpoints of any supported format and layout (``oarlock diff``).

Both sides are opened with :func:`~oarlock.checkpoint.open_checkpoint`; every key is read whole through the load
planner (an HF directory, a TP=4 oarlock checkpoint and a ZeRO-flattened one all give the same logical tensor),
one key at a time, so memory holds one tensor of each side. Keys are compared in A's order.

Element semantics (``numpy.isclose``'s): elements ``a`` (from A) and ``b`` (from B) differ when
``|a - b| > atol + rtol * |b|``, computed in float64 (complex: on the modulus of the difference); NaNs at the
same position count as equal, a NaN against a number differs. With the default ``rtol = atol = 0`` and equal
dtypes the comparison is exact equality in the stored dtype (``-0.0 == 0.0``; int64 values beyond 2**53
compared exactly); the reported differences are then computed in float64. The relative difference of an element is ``|a - b| / |b|`` (infinite where
``b == 0`` and ``a != 0``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from oarlock.checkpoint.integrity import BlockVerifier, ChecksumError, corrupt_keys, equal_by_checksum, recorded
from oarlock.checkpoint.model.metadata import CheckpointMetadata, key_selected
from oarlock.utils import dtype_name


_CHUNK = 1 << 22  # elements compared at once


@dataclass
class KeyDiff:
    """One key present on both sides that is not equal.

    Attributes:
        key: the tensor key. shape_a, shape_b, dtype_a, dtype_b: global shapes and dtype names.
        numel: elements compared (0 when the shapes differ: nothing is compared).
        num_different: elements that differ under ``rtol``/``atol``.
        max_abs_diff: largest ``|a - b|`` (float; NaN-vs-number counts as ``inf``).
        max_rel_diff: largest ``|a - b| / |b|`` over differing elements.
    """

    key: str
    shape_a: list[int]
    shape_b: list[int]
    dtype_a: str
    dtype_b: str
    numel: int = 0
    num_different: int = 0
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0

    @property
    def kind(self) -> str:
        """``"shape"``, ``"dtype"`` (values compared after widening) or ``"values"``."""
        if self.shape_a != self.shape_b:
            return "shape"
        return "dtype" if self.dtype_a != self.dtype_b else "values"


@dataclass
class DiffReport:
    """The result of :func:`diff_checkpoints`.

    Attributes:
        only_in_a, only_in_b: tensor keys present on one side only (after the include/exclude filters).
        changed: :class:`KeyDiff` per common key that differs (shape, dtype or values).
        equal_keys: number of common keys that are equal.
        objects_only_in_a, objects_only_in_b, objects_changed, equal_objects: the same for JSON objects saved
            beside the tensors.
        equal_by_checksum: common keys found equal from stored checksums alone, without reading their bytes.
    """

    a: str
    b: str
    rtol: float
    atol: float
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    changed: list[KeyDiff] = field(default_factory=list)
    equal_keys: int = 0
    objects_only_in_a: list[str] = field(default_factory=list)
    objects_only_in_b: list[str] = field(default_factory=list)
    objects_changed: list[str] = field(default_factory=list)
    equal_by_checksum: int = 0
    equal_objects: int = 0

    @property
    def equal(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.changed or self.objects_only_in_a
                    or self.objects_only_in_b or self.objects_changed)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["equal"] = self.equal
        for c, cd in zip(self.changed, d["changed"]):
            cd["kind"] = c.kind
            for k in ("max_abs_diff", "max_rel_diff"):  # JSON has no inf
                if math.isinf(cd[k]):
                    cd[k] = "inf"
        return d

    def render(self) -> str:
        lines = []
        for k in self.only_in_a:
            lines.append(f"only in A: {k}")
        for k in self.only_in_b:
            lines.append(f"only in B: {k}")
        for c in self.changed:
            if c.kind == "shape":
                lines.append(f"shape changed: {c.key}: {c.shape_a} {c.dtype_a} -> {c.shape_b} {c.dtype_b}")
                continue
            head = f"dtype changed: {c.key}: {c.dtype_a} -> {c.dtype_b}" if c.kind == "dtype" else f"differs: {c.key}"
            if c.num_different:
                head += (f": {c.num_different}/{c.numel} elements differ, max abs diff {c.max_abs_diff:.6g}, "
                         f"max rel diff {c.max_rel_diff:.6g}")
            lines.append(head)
        for k in self.objects_only_in_a:
            lines.append(f"object only in A: {k}")
        for k in self.objects_only_in_b:
            lines.append(f"object only in B: {k}")
        for k in self.objects_changed:
            lines.append(f"object differs: {k}")
        tol = f" (rtol={self.rtol:g}, atol={self.atol:g})" if self.rtol or self.atol else ""
        n = self.equal_keys + len(self.changed)
        summary = (f"{'equal' if self.equal else 'differ'}: {n} common tensor keys, {self.equal_keys} equal{tol}, "
                   f"{len(self.changed)} changed, {len(self.only_in_a)} only in A, {len(self.only_in_b)} only in B")
        n_obj = self.equal_objects + len(self.objects_changed)
        if n_obj or self.objects_only_in_a or self.objects_only_in_b:  # counted like the tensors, listed above
            summary += (f"; {n_obj} common objects, {self.equal_objects} equal, {len(self.objects_changed)} changed, "
                        f"{len(self.objects_only_in_a)} only in A, {len(self.objects_only_in_b)} only in B")
        lines.append(summary)
        return "\n".join(lines)


def compare_tensors(key: str, a: torch.Tensor, b: torch.Tensor, *, rtol: float = 0.0, atol: float = 0.0) -> KeyDiff:
    """Compare two whole tensors (see the module docstring for the semantics). Returns a :class:`KeyDiff` whose
    ``num_different`` is 0 (and shapes and dtypes equal) when they are equal."""
    d = KeyDiff(key, list(a.shape), list(b.shape), dtype_name(a.dtype), dtype_name(b.dtype))
    if a.shape != b.shape:
        return d
    d.numel = a.numel()
    if d.numel == 0:
        return d
    wide = torch.complex128 if (a.is_complex() or b.is_complex()) else torch.float64
    exact = a.dtype == b.dtype and not rtol and not atol
    fa, fb = a.reshape(-1), b.reshape(-1)
    for s in range(0, d.numel, _CHUNK):  # chunks bound the float64 working copies whatever the tensor's size
        x, y = fa[s:s + _CHUNK], fb[s:s + _CHUNK]
        if exact:  # compared in their own dtype: no rounding of large integers
            bad = x != y
            if x.is_floating_point() or x.is_complex():
                bad &= ~(torch.isnan(x) & torch.isnan(y))
            xb, yb = x[bad].to(wide), y[bad].to(wide)
            if x.dtype.is_floating_point or x.is_complex() or x.dtype == torch.bool:
                diff = (xb - yb).abs()
            else:  # integers: subtract exactly, then widen
                diff = (x[bad].long() - y[bad].long()).abs().to(wide)
        else:
            xw, yw = x.to(wide), y.to(wide)
            diff = (xw - yw).abs()
            diff = torch.where(torch.isnan(xw) & torch.isnan(yw), torch.zeros_like(diff), diff)
            diff = torch.nan_to_num(diff, nan=math.inf, posinf=math.inf)  # NaN against a number
            bad = diff > atol + rtol * yw.abs()
            diff, yb = diff[bad], yw[bad]
        nbad = int(bad.sum())
        if nbad:
            diff = torch.nan_to_num(diff.real if diff.is_complex() else diff, nan=math.inf, posinf=math.inf)
            d.num_different += nbad
            d.max_abs_diff = max(d.max_abs_diff, float(diff.max()))
            rel = torch.nan_to_num(diff / yb.abs(), nan=math.inf, posinf=math.inf)
            d.max_rel_diff = max(d.max_rel_diff, float(rel.max()))
    return d


#: Formats an HF export is read as (whole tensors under the model's own names).
HF_FORMATS = ("huggingface", "safetensors")


def diff_checkpoints(a: str | Path, b: str | Path, *, rtol: float = 0.0, atol: float = 0.0,
                     include: Sequence[str] | None = None, exclude: Sequence[str] | None = None,
                     use_checksums: bool = True, aoa_a: Any = None, aoa_b: Any = None,
                     verify_checksums: bool = True) -> DiffReport:
    """Compare the logical tensors (and JSON objects) of checkpoints ``a`` and ``b``, streaming one key at a time.

    Args:
        a, b: any source :func:`~oarlock.checkpoint.open_checkpoint` reads (oarlock in any layout, HF, Paddle,
            a ``.safetensors`` file), possibly of different formats and layouts. Keys recorded in a TP-blocked
            layout (``extra["tp_layouts"]``, docs/aoa.md) are compared re-laid out to TP degree 1.
        rtol, atol: tolerances (module docstring); 0 means exact equality.
        include, exclude: glob patterns over keys (:func:`~oarlock.checkpoint.model.metadata.key_selected`).
        use_checksums: keys whose stored bytes have equal checksums on both sides (same layout, same dtype) are
            equal without being compared element by element; the files holding them are first hashed against
            their recorded checksums (a corrupted copy with an intact ``metadata.json`` is not "equal").
        aoa_a, aoa_b: AOA configs (docs/aoa.md) through which side A / B is read, as a conversion would read it:
            keys are then that config's destination keys (e.g. a reverse preset compares a training checkpoint
            with fused QKV against an HF directory). ``include``/``exclude`` select those keys. Without one, a
            side whose model weights sit under a wrapper prefix
            (:attr:`~oarlock.checkpoint.model.metadata.CheckpointMetadata.model_prefix`) compared with an HF directory
            or ``.safetensors`` file is read with the prefix stripped, as ``convert --to hf`` exports it.
        verify_checksums: before any comparison, hash every data file of either side holding a compared key
            against the block checksums recorded at its save (sides without recorded checksums are read as
            they are): a corrupted byte is then an error naming the file and block, not a "difference". False
            compares every key by its bytes as they are (``use_checksums`` then has no effect: equal recorded
            checksums stand for equal tensors only in verified files).

    Raises:
        CheckpointFormatError: either side unreadable (naming the file); CheckpointTilingError: a key whose
            shards do not tile it; ChecksumError: a file of either side no longer matches its recorded checksums.
    """
    from oarlock.checkpoint.aoa.layout import recorded_layouts
    from oarlock.checkpoint.convert import compile_program, read_destination
    from oarlock.checkpoint.planning.load import Planner
    from oarlock.checkpoint.formats.opening import open_checkpoint

    from oarlock.checkpoint.convert import strip_model_prefix

    rep = DiffReport(str(a), str(b), float(rtol), float(atol))
    with open_checkpoint(a) as ra, open_checkpoint(b) as rb:
        ma, mb = ra.metadata, rb.metadata
        # a training checkpoint against an HF export: its model keys are read without their wrapper prefix, as
        # ``convert --to hf`` writes them ({"model": ..., "step": ...} against its export compares equal)
        if aoa_a is None and ma.model_prefix and mb.format in HF_FORMATS:
            aoa_a = strip_model_prefix(ma)
        if aoa_b is None and mb.model_prefix and ma.format in HF_FORMATS:
            aoa_b = strip_model_prefix(mb)
        # keys saved in a TP-blocked layout (fused_ffn / fused_qkv_old at some TP degree, recorded in the metadata)
        # are compared in the layout of degree 1, as a conversion to HF writes them: the logical tensor
        pa, pb = Planner(ma, compile_program(ma, aoa_a)), Planner(mb, compile_program(mb, aoa_b))
        spec_a = {k: pa.program.destination_spec(k) for k in pa.program.destination_keys()}
        spec_b = {k: pb.program.destination_spec(k) for k in pb.program.destination_keys()}
        ka = [k for k in spec_a if key_selected(k, include, exclude)]
        kb = [k for k in spec_b if key_selected(k, include, exclude)]
        sb = set(kb)
        rep.only_in_a = [k for k in ka if k not in sb]
        rep.only_in_b = [k for k in kb if k not in set(ka)]
        la, lb = recorded_layouts(ma), recorded_layouts(mb)
        # recorded checksums prove equality only of intact files, so without verification every key is compared
        # by its bytes (a corrupted byte then shows as a difference)
        trust = use_checksums and verify_checksums and aoa_a is None and aoa_b is None
        same = _checksum_equal_keys(ma, mb) if trust else set()
        same = {k for k in same if la.get(k) == lb.get(k)}  # equal bytes mean equal tensors only in one layout
        if verify_checksums:  # a corrupted byte must not pass for a change: the compared files are checked first
            common = {k for k in ka if k in sb}
            for reader, meta, aoa in ((ra, ma, aoa_a), (rb, mb, aoa_b)):
                keys = set(meta.tensors) if aoa is not None else common  # through an AOA config keys are renamed
                _verify_files(reader, meta, {sh.file for k in keys if k in meta.tensors
                                             for sh in meta.tensors[k].shards})
        for k in ka:
            if k not in sb:
                continue
            ta, tb = spec_a[k], spec_b[k]
            if tuple(ta.shape) != tuple(tb.shape):
                rep.changed.append(KeyDiff(k, list(ta.shape), list(tb.shape), dtype_name(ta.dtype),
                                           dtype_name(tb.dtype)))
                continue
            if k in same:
                rep.equal_keys += 1
                rep.equal_by_checksum += 1
                continue
            d = compare_tensors(k, read_destination(ra, pa, k), read_destination(rb, pb, k), rtol=rtol, atol=atol)
            if d.num_different or d.dtype_a != d.dtype_b:
                rep.changed.append(d)
            else:
                rep.equal_keys += 1
        oa = {k: v for k, v in ma.objects.items() if key_selected(k, include, exclude)}
        ob = {k: v for k, v in mb.objects.items() if key_selected(k, include, exclude)}
        rep.objects_only_in_a = [k for k in oa if k not in ob]
        rep.objects_only_in_b = [k for k in ob if k not in oa]
        rep.objects_changed = [k for k in oa if k in ob and json.dumps(oa[k], sort_keys=True)
                               != json.dumps(ob[k], sort_keys=True)]
        rep.equal_objects = sum(1 for k in oa if k in ob) - len(rep.objects_changed)
    return rep


def _verify_files(reader, meta: CheckpointMetadata, files: set[str]) -> None:
    sums = recorded(meta, reader.path_of)
    if not sums or not files:  # a format without recorded checksums has nothing to check
        return
    verifier = BlockVerifier(reader.path_of, sums)
    for f in sorted(files & set(sums)):
        bad = verifier.bad_blocks(f, range(sums[f].n_blocks))
        if bad:
            path = reader.path_of(f)
            bs = sums[f].block_size
            raise ChecksumError(f"{path}: block(s) {bad[:5]} (bytes from {bad[0] * bs}) do not match the checksums "
                                f"recorded at save (keys {corrupt_keys(path, bad, bs, reader, f)[:5]}): the file was corrupted "
                                "after it was written, so its recorded checksums cannot stand for its contents; "
                                "`oarlock verify` lists every bad block")


def _checksum_equal_keys(ma: CheckpointMetadata, mb: CheckpointMetadata) -> set[str]:
    """Keys stored identically on both sides whose bytes are equal by checksums: equal without reading."""
    return equal_by_checksum(ma, mb)
