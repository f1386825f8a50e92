"""Hostile input for the four foreign readers: torch DCP, Megatron-Core ``torch_dist``, DeepSpeed ZeRO and GGUF.

Each reader gets small hand-made checkpoints (written by ``torch.distributed.checkpoint``, ``torch.save`` and the
``gguf`` package, none by oarlock) and then: metadata naming a data file outside the checkpoint (``..``, absolute
path, symlink out) -> refused naming the file, with no path outside the checkpoint passed to ``open``/``os.open``
(the ``opened`` fixture records them); byte ranges and partitions past the end of a data file; negative and huge
shapes; pickles that would call ``os.system`` (refused; the marker file they would create never appears);
truncated GGUF headers and GGUF tensor infos pointing beyond the file. Every refusal is a
:class:`CheckpointFormatError` naming the file, at ``open_checkpoint``, ``load_state_dict`` and ``oarlock inspect``
(exit status 2, one line).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from oarlock.checkpoint import load_state_dict, open_checkpoint
from oarlock.checkpoint.errors import CheckpointError, CheckpointFormatError
from oarlock.cli import main
from testkit import PickledCall

# the builders write DCP files with torch's own save in one process, which warns that it assumes so
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _w() -> torch.Tensor:
    return torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8


def _b() -> torch.Tensor:
    return torch.arange(4, dtype=torch.float32) + 100


# ---------------------------------------------------------------- builders (independent writers)

def dcp_ckpt(d: Path) -> Path:
    """A one-process ``torch.distributed.checkpoint`` save of ``w`` (3 x 4), ``b`` (4) and the value ``step``."""
    import torch.distributed.checkpoint as dcp

    d.mkdir(parents=True)
    dcp.save({"w": _w(), "b": _b(), "step": 3}, checkpoint_id=str(d))
    return d


def megatron_ckpt(d: Path) -> Path:
    """A Megatron-Core ``torch_dist`` directory: the DCP files, ``metadata.json`` and ``common.pt``."""
    dcp_ckpt(d)
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                 "common_backend": "torch"}))
    torch.save({"iteration": 7, "checkpoint_version": 3.0}, d / "common.pt")
    return d


DS_TAG = "global_step1"
DS_MODEL = "mp_rank_00_model_states.pt"
DS_OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def deepspeed_ckpt(d: Path, shapes: dict | None = None) -> Path:
    """A ZeRO stage-2 save of one rank, in DeepSpeed's on-disk layout (``latest``, ``global_step1/`` with the model
    and optimizer state files): ``w`` and ``b`` flattened into one fp32 partition, moments 0.5x and 0.25x of it.
    ``shapes`` replaces ``param_shapes``."""
    tag = d / DS_TAG
    tag.mkdir(parents=True)
    (d / "latest").write_text(DS_TAG)
    flat = torch.cat([_w().reshape(-1), _b()])
    torch.save({"module": {"w": _w().to(torch.bfloat16), "b": _b().to(torch.bfloat16)},
                "param_shapes": [shapes or OrderedDict(w=torch.Size([3, 4]), b=torch.Size([4]))],
                "buffer_names": [], "shared_params": {}, "global_steps": 1}, tag / DS_MODEL)
    torch.save({"optimizer_state_dict": {
        "zero_stage": 2, "partition_count": [1], "single_partition_of_fp32_groups": [flat],
        "param_alignment_paddings": [[0, 0]],
        "base_optimizer_state": {"state": {0: {"exp_avg": flat * 0.5, "exp_avg_sq": flat * 0.25,
                                               "step": torch.tensor(1.0)}},
                                 "param_groups": [{"lr": 0.01, "params": [0]}]}}}, tag / DS_OPTIM)
    return d


def gguf_file(p: Path) -> Path:
    """A tiny llama-architecture GGUF file (``gguf.GGUFWriter``) holding ``token_embd.weight`` = ``_w()`` and
    ``output_norm.weight`` = ``_b()``."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_block_count(1)
    w.add_embedding_length(4)
    w.add_feed_forward_length(8)
    w.add_head_count(2)
    w.add_context_length(16)
    w.add_tensor("token_embd.weight", _w().numpy())
    w.add_tensor("output_norm.weight", _b().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p


def _rewrite_dcp_metadata(d: Path, edit) -> None:
    """Apply ``edit(metadata)`` to the DCP ``.metadata`` pickle (written by torch itself, so a trusted load here)."""
    md = pickle.loads((d / ".metadata").read_bytes())
    edit(md)
    (d / ".metadata").write_bytes(pickle.dumps(md))


def _storage(md, fqn: str):
    return next(info for idx, info in md.storage_data.items() if idx.fqn == fqn)


# ---------------------------------------------------------------- the readers read the builders' files right

def test_builders_read_back_exactly(tmp_path):
    """The positive control: each builder's checkpoint opens in its format with the values written."""
    for fmt, ck in [("dcp", dcp_ckpt(tmp_path / "dcp")), ("megatron", megatron_ckpt(tmp_path / "meg")),
                    ("deepspeed", deepspeed_ckpt(tmp_path / "ds"))]:
        out = {"w": torch.zeros(3, 4), "b": torch.zeros(4)}
        report = load_state_dict(out, ck, strict=False)
        assert report.missing_keys == [], (fmt, report)
        assert torch.equal(out["w"], _w()) and torch.equal(out["b"], _b()), fmt
        with open_checkpoint(ck) as r:
            assert r.metadata.format == fmt
            if fmt == "deepspeed":
                t = r.metadata.tensors["optim.state.w.exp_avg"]
                assert torch.equal(r.read("optim.state.w.exp_avg", t.shards[0]).reshape(3, 4), _w() * 0.5)
            if fmt == "megatron":
                assert r.metadata.objects["common.iteration"] == 7
    with open_checkpoint(gguf_file(tmp_path / "m.gguf")) as r:
        assert r.metadata.format == "gguf"
        t = r.metadata.tensors["model.embed_tokens.weight"]
        assert torch.equal(r.read("model.embed_tokens.weight", t.shards[0]), _w())


# ---------------------------------------------------------------- refusals at every entry point

def _refused_everywhere(ck: Path, want: str | tuple[str, ...], capsys, target: dict | None = None) -> list[str]:
    """Problems (empty when none) with refusing ``ck``: ``open_checkpoint``, ``load_state_dict`` and ``oarlock
    inspect`` must each fail with a CheckpointFormatError (CLI: exit 2, one stderr line) containing ``want`` (each
    of them, for a tuple)."""
    wants = (want,) if isinstance(want, str) else want
    problems = []
    for what, call in [("open_checkpoint", lambda: open_checkpoint(ck).close()),
                       ("load_state_dict", lambda: load_state_dict(target or {"w": torch.zeros(3, 4)}, ck))]:
        try:
            call()
            problems.append(f"{what}({ck.name}) succeeded")
        except CheckpointFormatError as e:
            if not all(w in str(e) for w in wants):
                problems.append(f"{what}({ck.name}): {e!s} lacks {want!r}")
    code = main(["inspect", str(ck)])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    if code != 2 or len(err) != 1 or not all(w in err[0] for w in wants) or "Traceback" in err[0]:
        problems.append(f"inspect {ck.name}: exit {code}, stderr {err}")
    return problems


def _escape_cases(base: Path) -> list[tuple[str, Path, str]]:
    """(case, checkpoint, text the refusal must contain): data files named outside the checkpoint. The files the
    hostile names point at exist (in ``base/outside``), so only the path rule stands between them and a read."""
    outside = base / "outside"
    outside.mkdir()
    dcp_ckpt(outside / "dcp")
    deepspeed_ckpt(outside / "ds")
    torch.save({"iteration": 666}, outside / "common.pt")
    secret = outside / "dcp" / "__0_0.distcp"
    cases = []
    for fmt, build in (("dcp", dcp_ckpt), ("megatron", megatron_ckpt)):
        for how, name in (("..", "../../outside/dcp/__0_0.distcp"), ("absolute", str(secret))):
            ck = build(base / f"{fmt}_{how}" / "ck")
            _rewrite_dcp_metadata(ck, lambda md, n=name: [setattr(i, "relative_path", n)
                                                          for i in md.storage_data.values()])
            cases.append((f"{fmt} storage file {how}", ck, repr(name)))
        ck = build(base / f"{fmt}_data_symlink" / "ck")
        os.unlink(ck / "__0_0.distcp")
        os.symlink(secret, ck / "__0_0.distcp")
        cases.append((f"{fmt} data file symlink", ck, "'__0_0.distcp' resolves to"))
        ck = build(base / f"{fmt}_metadata_symlink" / "ck")
        os.unlink(ck / ".metadata")
        os.symlink(outside / "dcp" / ".metadata", ck / ".metadata")
        cases.append((f"{fmt} .metadata symlink", ck, "'.metadata' resolves to"))
    ck = megatron_ckpt(base / "megatron_common_symlink" / "ck")
    os.unlink(ck / "common.pt")
    os.symlink(outside / "common.pt", ck / "common.pt")
    cases.append(("megatron common.pt symlink", ck, "'common.pt' resolves to"))

    ck = deepspeed_ckpt(base / "ds_tag_symlink" / "ck")
    for f in (ck / DS_TAG).iterdir():
        f.unlink()
    (ck / DS_TAG).rmdir()
    os.symlink(outside / "ds" / DS_TAG, ck / DS_TAG)
    cases.append(("deepspeed tag directory symlink", ck, f"'{DS_TAG}' resolves to"))
    for how, tag in (("..", "../../outside/ds/" + DS_TAG), ("absolute", str(outside / "ds" / DS_TAG))):
        ck = deepspeed_ckpt(base / f"ds_latest_{how}" / "ck")
        (ck / "latest").write_text(tag)
        cases.append((f"deepspeed latest {how}", ck, repr(tag)))
    for name in (DS_MODEL, DS_OPTIM):
        ck = deepspeed_ckpt(base / f"ds_{name}" / "ck")
        (ck / DS_TAG / name).unlink()
        os.symlink(outside / "ds" / DS_TAG / name, ck / DS_TAG / name)
        cases.append((f"deepspeed {name} symlink", ck, f"'{DS_TAG}/{name}' resolves to"))
    return cases


def test_foreign_path_escapes_refused_before_opening(tmp_path, opened, capsys):
    failures = []
    for case, ck, want in _escape_cases(tmp_path):
        del opened[:]
        failures += [f"{case}: {p}" for p in _refused_everywhere(ck, (want, "refusing to open it"), capsys)]
        outside = sorted({p for p in opened if p.startswith(os.path.realpath(tmp_path / "outside"))})
        if outside:
            failures.append(f"{case}: opened outside the checkpoint: {outside}")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- hostile pickles: refused, nothing runs

def _evil_pickle(marker: Path) -> bytes:
    return pickle.dumps(PickledCall(os.system, f"touch {marker}"))


def _evil_torch_save(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save({"optimizer_state_dict": PickledCall(os.system, f"touch {marker}"),
                "param_shapes": PickledCall(os.system, f"touch {marker}")}, buf)
    return buf.getvalue()


@pytest.mark.parametrize("fmt,file", [("dcp", ".metadata"), ("megatron", ".metadata"),
                                      ("deepspeed", f"{DS_TAG}/{DS_MODEL}"), ("deepspeed", f"{DS_TAG}/{DS_OPTIM}")])
def test_pickles_calling_os_system_are_refused(tmp_path, capsys, fmt, file):
    marker = tmp_path / "PWNED"
    build = {"dcp": dcp_ckpt, "megatron": megatron_ckpt, "deepspeed": deepspeed_ckpt}[fmt]
    ck = build(tmp_path / "ck")
    (ck / file).write_bytes(_evil_pickle(marker) if file == ".metadata" else _evil_torch_save(marker))
    problems = _refused_everywhere(ck, Path(file).name, capsys)
    assert not marker.exists(), "the pickle ran os.system"
    assert not problems, "\n".join(problems)


def test_megatron_common_pt_calling_os_system_is_reported_not_run(tmp_path):
    """``common.pt`` holds only side values: a weights-only refusal is reported in the metadata (naming the file
    and the refused global) while the tensors still load; the call never runs."""
    marker = tmp_path / "PWNED"
    ck = megatron_ckpt(tmp_path / "ck")
    (ck / "common.pt").write_bytes(_evil_torch_save(marker))
    with open_checkpoint(ck) as r:
        err = r.metadata.extra["megatron"]["common_error"]
        assert not any(k.startswith("common.") for k in r.metadata.objects)
    assert "common.pt: not a weights-only loadable common.pt" in err and "system" in err, err
    out = {"w": torch.zeros(3, 4)}
    load_state_dict(out, ck, strict=False)
    assert torch.equal(out["w"], _w())
    assert not marker.exists()


# ---------------------------------------------------------------- byte ranges, partitions and shapes

@pytest.mark.parametrize("build", [dcp_ckpt, megatron_ckpt], ids=["dcp", "megatron"])
def test_dcp_entry_past_the_end_of_its_file(tmp_path, capsys, build):
    ck = build(tmp_path / "ck")
    size = (ck / "__0_0.distcp").stat().st_size

    def edit(md):
        _storage(md, "w").offset = size + 100
    _rewrite_dcp_metadata(ck, edit)
    problems = _refused_everywhere(ck, f"__0_0.distcp: truncated: 'w' is stored at bytes [{size + 100}, ", capsys)
    assert not problems, "\n".join(problems)


def test_dcp_negative_and_huge_shapes(tmp_path, capsys):
    ck = dcp_ckpt(tmp_path / "neg")

    def negative(md):
        md.state_dict_metadata["w"].chunks[0].sizes = [-3, 4]
    _rewrite_dcp_metadata(ck, negative)
    problems = _refused_everywhere(ck, "chunk size of 'w'", capsys)

    ck = dcp_ckpt(tmp_path / "huge")

    def huge(md):
        md.state_dict_metadata["w"].size = torch.Size([10**12, 4])
        md.state_dict_metadata["w"].chunks[0].sizes = torch.Size([10**12, 4])
    _rewrite_dcp_metadata(ck, huge)
    with open_checkpoint(ck) as r:  # metadata alone is fine; reading checks the stored tensor first
        t = r.metadata.tensors["w"]
        assert t.global_shape == (10**12, 4)
        with pytest.raises(CheckpointFormatError, match=r"__0_0\.distcp.*'w'.*holds torch.float32 \[3, 4\], metadata "
                                                        r"says float32 \[1000000000000, 4\]"):
            r.read("w", t.shards[0], (slice(0, 1),))
    with pytest.raises(CheckpointError, match=r"'w'.*\(3, 4\)|'w'.*\[3, 4\]"):  # a shape mismatch, named
        load_state_dict({"w": torch.zeros(3, 4)}, ck, strict=False)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("case,shapes,want", [
    ("negative", OrderedDict(w=[-3, -4], b=[4]), "parameter 'w' has shape [-3, -4]"),
    ("huge", OrderedDict(w=torch.Size([10**12, 4]), b=torch.Size([4])), "partitions"),
    ("past the partition", OrderedDict(w=torch.Size([4, 4]), b=torch.Size([4])),
     f"parameter 'b' (group 0): the rank partitions ({DS_TAG}/{DS_OPTIM}) cover 0 of its 4 elements"),
    ("not a shape", OrderedDict(w="3x4", b=[4]), "parameter 'w' has shape '3x4'"),
])
def test_deepspeed_shapes_beyond_the_partition(tmp_path, capsys, case, shapes, want):
    ck = deepspeed_ckpt(tmp_path / "ck", shapes)
    problems = _refused_everywhere(ck, want, capsys)
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- GGUF: truncated headers, tensor infos out of range

def _tensor_info_at(raw: bytes, name: bytes) -> int:
    """Byte position of ``n_dims`` in the tensor info of ``name`` (after its u64 length and its bytes)."""
    i = raw.index(struct.pack("<Q", len(name)) + name)
    return i + 8 + len(name)


def _gguf_variants(base: Path) -> list[tuple[str, bytes]]:
    raw = gguf_file(base / "good.gguf").read_bytes()
    name = b"output_norm.weight"
    pos = _tensor_info_at(raw, name)
    (n_dims,) = struct.unpack_from("<I", raw, pos)
    off_pos = pos + 4 + 8 * n_dims + 4

    def patched(at: int, fmt: str, *values: int) -> bytes:
        b = bytearray(raw)
        struct.pack_into(fmt, b, at, *values)
        return bytes(b)

    from gguf import GGUFReader

    data_at = next(t.data_offset for t in GGUFReader(str(base / "good.gguf")).tensors if t.name == name.decode())
    cuts = (3, 8, 20, 24, 40, pos - 5, pos + 6, data_at + 8)  # magic, counts, key/values, tensor info, data
    out = [(f"truncated at byte {n}", raw[:n]) for n in cuts]
    out += [("tensor offset past the end", patched(off_pos, "<Q", len(raw) * 4)),
            ("tensor offset 2**63", patched(off_pos, "<Q", 2**63)),
            ("huge dimension", patched(pos + 4, "<Q", 2**40)),
            ("dimensions overflowing 64 bits", patched(pos + 4, "<Q", 2**63) if n_dims == 1 else raw),
            ("2**62 tensors", patched(8, "<Q", 2**62)),
            ("2**62 key/value pairs", patched(16, "<Q", 2**62))]
    return out


def test_gguf_truncated_and_out_of_range_tensor_infos(tmp_path, capsys):
    failures = []
    for i, (case, raw) in enumerate(_gguf_variants(tmp_path)):
        p = tmp_path / f"bad{i}.gguf"
        p.write_bytes(raw)
        failures += [f"{case}: {x}" for x in _refused_everywhere(p, f"bad{i}.gguf", capsys,
                                                                  {"model.norm.weight": torch.zeros(4)})]
    assert not failures, "\n".join(failures)
