"""Strided reads of short runs (a column slice of a row-major tensor) staged through each thread's small reused
buffer, and the phases a load reports."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import save_file

from oarlock.checkpoint import load_state_dict, save_state_dict
from oarlock.checkpoint.storage.safetensors import _BOUNCE_BYTES, SafetensorsFile


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_slice_over_several_staging_chunks(tmp_path, dtype):
    # rows of 1,200 bytes (fp32) or 600 (bf16): the box spans several staging chunks, the last one partial
    rows = 3 * _BOUNCE_BYTES // (300 * dtype.itemsize) + 17
    w = torch.randn(rows, 300).to(dtype)
    save_file({"w": w, "z": torch.arange(10.0)}, str(tmp_path / "a.safetensors"))  # written by safetensors itself
    f = SafetensorsFile(tmp_path / "a.safetensors")
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    box = ((7, rows - 3), (11, 61))
    got = f.read_box("w", 0, (rows, 300), box, name)
    assert torch.equal(got, w[7:rows - 3, 11:61])
    # into a strided destination (a column block of a larger tensor)
    out = torch.zeros(rows, 100, dtype=dtype)
    f.read_box("w", 0, (rows, 300), box, name, out=out[7:rows - 3, 20:70])
    assert torch.equal(out[7:rows - 3, 20:70], w[7:rows - 3, 11:61])
    assert not out[:, :20].any() and not out[:, 70:].any() and not out[:7].any()
    f.close()


def test_strided_reads_on_several_threads_do_not_share_staging(tmp_path):
    w = torch.randn(4 * _BOUNCE_BYTES // 1024, 256)
    save_file({"w": w}, str(tmp_path / "a.safetensors"))
    f = SafetensorsFile(tmp_path / "a.safetensors")
    boxes = [((0, w.shape[0]), (c, c + 16)) for c in range(0, 256, 16)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda b: f.read_box("w", 0, tuple(w.shape), b, "float32"), boxes))
    for b, g in zip(boxes, got):
        assert torch.equal(g, w[:, b[1][0]:b[1][1]])
    f.close()


def test_load_report_phases(tmp_path):
    sd = {"a": torch.randn(64, 32), "b": torch.randn(8)}
    save_state_dict(sd, tmp_path / "c")
    tgt = {"a": torch.zeros(64, 32), "b": torch.zeros(8)}
    rep = load_state_dict(tgt, tmp_path / "c")
    assert torch.equal(tgt["a"], sd["a"]) and torch.equal(tgt["b"], sd["b"])
    assert list(rep.phases) == ["plan", "verify", "verdict", "read"], rep.phases
    assert all(v >= 0 for v in rep.phases.values())
    rep = load_state_dict({"a": torch.zeros(64, 32), "b": torch.zeros(8)}, tmp_path / "c", verify_checksums=False)
    assert list(rep.phases) == ["plan", "read"], rep.phases


def test_rows_longer_than_the_staging_buffer_are_read_and_not_kept(tmp_path, monkeypatch):
    """A strided read whose single row (dim 0) exceeds the reused staging buffer (a 3-D tensor of 3 MiB rows, a
    short-run slice of the last dim) reads right through a buffer of its own, and the thread's kept buffer stays
    at its fixed size afterwards."""
    from oarlock.checkpoint.storage import safetensors as safetensors_io

    asked = []
    real = safetensors_io._bounce
    monkeypatch.setattr(safetensors_io, "_bounce", lambda n: asked.append(n) or real(n))
    w = torch.randn(2, 512, 1536)
    assert w[0].numel() * 4 > _BOUNCE_BYTES
    save_file({"w": w}, str(tmp_path / "a.safetensors"))
    f = SafetensorsFile(tmp_path / "a.safetensors")
    box = ((0, 2), (0, 512), (7, 407))
    assert torch.equal(f.read_box("w", 0, (2, 512, 1536), box, "float32"), w[:, :, 7:407])
    f.close()
    assert asked and max(asked) > _BOUNCE_BYTES, asked  # the long-row case was the one exercised
    kept = getattr(safetensors_io._bounce_local, "buf", None)
    assert kept is None or kept.numel() == _BOUNCE_BYTES
