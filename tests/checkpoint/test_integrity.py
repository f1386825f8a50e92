"""Block checksums: a flipped byte anywhere in a data file is caught by load and by `oarlock verify`; partial
reads check only their blocks; checkpoints without checksums still load; a 4-rank load fails alike everywhere."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import _integrity_scenarios as W
from multirank import each_scenario, launch_fixture
from oarlock.checkpoint import ShardedWeight, convert_checkpoint, load_state_dict, save_state_dict
from oarlock.checkpoint.convert.diff import diff_checkpoints
from oarlock.checkpoint.integrity import BLOCK_SIZE, ChecksumError, file_checksums, verify_checkpoint
from oarlock.checkpoint.storage.safetensors import read_header
from oarlock.cli import main

DATA = "rank-00000.safetensors"


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    # "a" spans about 3.5 blocks, "b" sits in the last one
    return {"a": torch.randn(896, 4096, generator=g), "b": torch.arange(1000, dtype=torch.float64), "step": 11}


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.fixture()
def ck(tmp_path):
    save_state_dict(_state(), tmp_path / "ck")
    return tmp_path / "ck"


def test_checksums_recorded_match_an_independent_hash(ck):
    import xxhash

    rec = json.loads((ck / "metadata.json").read_text())["extra"]["checksums"]
    data = (ck / DATA).read_bytes()
    want = [xxhash.xxh3_64_hexdigest(data[i:i + BLOCK_SIZE]) for i in range(0, len(data), BLOCK_SIZE)]
    assert rec["algorithm"] == "xxh3_64" and rec["block_size"] == BLOCK_SIZE
    # format 4: the 8-byte big-endian digests, in block order, in a digests file beside the data file; the
    # metadata holds only the file's size and the XXH3 of those digest bytes
    raw = b"".join(xxhash.xxh3_64_digest(data[i:i + BLOCK_SIZE]) for i in range(0, len(data), BLOCK_SIZE))
    assert rec["files"][DATA] == {"size": len(data), "digests_xxh3": xxhash.xxh3_64_hexdigest(raw)}
    assert (ck / (DATA + ".xxh3")).read_bytes() == raw
    assert len(want) == 4
    assert file_checksums(ck / DATA)["blocks"] == want


def _where(ck: Path) -> dict[str, int]:
    h = read_header(ck / DATA)
    size = (ck / DATA).stat().st_size
    return {"first": h.data_start + 100, "middle": 2 * BLOCK_SIZE + 12345, "last": size - 1}


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_byte_caught_by_load_and_verify(ck, where, capsys):
    off = _where(ck)[where]
    block = off // BLOCK_SIZE
    key = "b" if where == "last" else "a"
    _flip(ck / DATA, off)
    # the same-layout (warm) path and the planned path (a 2-row shard holding the byte) both refuse, write nothing
    h = read_header(ck / DATA)
    if key == "a":
        row = min(894, max(0, (off - h.data_start - h.entries["a"][2]) // (4096 * 4)))
        part = {"a": ShardedWeight("a", torch.zeros(2, 4096), (2, 4096), (896, 4096), (row, 0))}
    else:
        part = {"b": ShardedWeight("b", torch.zeros(10, dtype=torch.float64), (10,), (1000,), (990,))}
    keys = {"first": ["header", "a"], "middle": ["a"], "last": ["a", "b"]}[where]  # what each block holds
    for target in ({"a": torch.zeros(896, 4096), "b": torch.zeros(1000, dtype=torch.float64)}, part):
        with pytest.raises(ChecksumError) as e:
            load_state_dict(target, ck, strict=False)
        msg = str(e.value)
        assert str(ck / DATA) in msg and f"(block {block})" in msg and repr(key) in msg
        # every key the block holds, whichever of them this load reads (the warm path and the planned path)
        assert all(f"key {k!r}" in msg for k in keys if k != "header"), msg
        assert ("the file header" in msg) == ("header" in keys), msg
        for v in target.values():
            t = v.local_tensor if isinstance(v, ShardedWeight) else v
            assert bool((t == 0).all())  # no destination written
    assert main(["verify", str(ck)]) == 1
    out = capsys.readouterr().out
    assert f"{DATA}: checksum mismatch" in out and f"(block {block})" in out and repr(key) in out
    assert main(["verify", str(ck), "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["intact"] is False and [(p["file"], p["block"], p["keys"]) for p in rep["problems"]] == \
        [(DATA, block, keys)]
    with pytest.raises(ChecksumError, match=re.escape(f"(block {block})")):
        convert_checkpoint(ck, ck.parent / "out", tp=2, show_progress=False)
    assert not (ck.parent / "out").exists()
    _flip(ck / DATA, off)  # restored: intact again
    assert main(["verify", str(ck)]) == 0
    load_state_dict({"a": torch.zeros(896, 4096)}, ck, strict=False)


def test_partial_read_checks_only_its_blocks(ck):
    _flip(ck / DATA, 3 * BLOCK_SIZE + 50)  # inside the last block: rows near the end of "a", and "b"
    ref = _state()["a"]
    top = ShardedWeight("a", torch.zeros(100, 4096), (100, 4096), (896, 4096), (0, 0))
    rep = load_state_dict({"a": top}, ck, strict=False, comm_method="auto")
    assert torch.equal(top.local_tensor, ref[:100])
    h = read_header(ck / DATA)
    lo = h.data_start + h.entries["a"][2]  # rows 0-99 of "a": 1.6 MB from here, all inside block 0
    assert (lo + 100 * 4096 * 4 - 1) // BLOCK_SIZE == 0 and rep.bytes_hashed == BLOCK_SIZE, rep.bytes_hashed
    assert load_state_dict({"a": top}, ck, strict=False, verify_checksums=False).bytes_hashed == 0
    bottom = ShardedWeight("a", torch.zeros(100, 4096), (100, 4096), (896, 4096), (796, 0))
    with pytest.raises(ChecksumError, match=r"key 'a' shard box offset \[0, 0\] shape \[896, 4096\]"):
        load_state_dict({"a": bottom}, ck, strict=False)
    load_state_dict({"a": bottom}, ck, strict=False, verify_checksums=False)  # the opt-out reads what is there


def test_error_names_every_key_of_the_damaged_block(tmp_path):
    """Two small keys share block 0; a byte flipped in the second one: a load of either key (or both) names the
    block and both keys with their shard boxes, not just the first key stored there."""
    sd = {"first": torch.arange(64, dtype=torch.float32), "second": torch.arange(32, dtype=torch.int64)}
    save_state_dict(sd, tmp_path / "ck")
    h = read_header(tmp_path / "ck" / DATA)
    begin = {k: h.entries[k][2] for k in sd}
    assert begin["first"] < begin["second"]  # "first" is stored first
    _flip(tmp_path / "ck" / DATA, h.data_start + begin["second"] + 3)
    size = (tmp_path / "ck" / DATA).stat().st_size
    for want in (["first", "second"], ["second"], ["first"]):
        target = {k: torch.zeros_like(sd[k]) for k in want}
        with pytest.raises(ChecksumError) as e:
            load_state_dict(target, tmp_path / "ck", strict=False)
        # both keys whole: the warm path (it hashes the own file whole); one key: the planned path
        boxes = (" shard box offset [0] shape [64]", " shard box offset [0] shape [32]") if len(want) == 1 else ("", "")
        assert f"{tmp_path / 'ck' / DATA}: checksum mismatch in bytes [0, {size}) (block 0) holding the file header, " \
               f"key 'first'{boxes[0]}, key 'second'{boxes[1]}: " in str(e.value), str(e.value)
        assert all(bool((t == 0).all()) for t in target.values())
        # a slice of each: the planned path, which also gives each key's stored shard box
        part = {k: ShardedWeight(k, torch.zeros(4, dtype=sd[k].dtype), (4,), tuple(sd[k].shape), (2,)) for k in want}
        with pytest.raises(ChecksumError) as e:
            load_state_dict(part, tmp_path / "ck", strict=False)
        assert f"bytes [0, {size}) (block 0) holding the file header, key 'first' shard box offset [0] shape [64], " \
               "key 'second' shard box offset [0] shape [32]: " in str(e.value), str(e.value)
        assert all(bool((sw.local_tensor == 0).all()) for sw in part.values())


def test_block_bytes_of_strided_boxes_match_a_byte_mask():
    """The bytes a box read takes from each block, against a mask of the read elements' bytes built element by
    element: 2-d and 3-d boxes, a flattened read, a 0-d tensor, blocks that cut elements' rows anywhere."""
    from types import SimpleNamespace

    from oarlock.checkpoint.integrity import FileChecksums, block_bytes

    g = torch.Generator().manual_seed(9)
    cases = [((7, 9), ((2, 5), (3, 8)), 0), ((4, 5, 6), ((1, 3), (0, 5), (2, 4)), 0), ((40,), ((5, 33),), 11),
             ((), (), 0), ((3, 300), ((0, 3), (299, 300)), 0), ((6, 8), ((0, 6), (0, 8)), 5)]
    for shape, box, flat in cases:
        isz, start, begin = 4, 200 + int(torch.randint(0, 50, (1,), generator=g)) * 8, 24
        n = 1
        for x in shape:
            n *= x
        size = start + begin + (flat + n) * isz + 40
        entry = ("F32", [flat + n], begin, begin + (flat + n) * isz)
        reader = SimpleNamespace(safetensors_file=lambda f: SimpleNamespace(entries={"t": entry}, data_start=start))
        for bs in (64, 100, 4096):
            fc = FileChecksums("x.safetensors", size, bs, ["0"] * -(-size // bs))
            mask = bytearray(size)
            idx = torch.arange(n).reshape(shape) if shape else torch.arange(1).reshape(())
            for e in idx[tuple(slice(a, b) for a, b in box)].flatten().tolist():
                lo = start + begin + (flat + e) * isz
                mask[lo:lo + isz] = b"\x01" * isz
            want = {b: sum(mask[b * bs:(b + 1) * bs]) for b in range(len(fc.blocks)) if any(mask[b * bs:(b + 1) * bs])}
            assert block_bytes(reader, fc, "t", flat, shape, box) == want, (shape, box, flat, bs)


def test_checkpoint_without_checksums_still_loads(ck, capsys):
    meta = json.loads((ck / "metadata.json").read_text())
    del meta["extra"]["checksums"]  # what earlier oarlock versions wrote
    (ck / "metadata.json").write_text(json.dumps(meta))
    got = {"a": torch.zeros(896, 4096), "b": torch.zeros(1000, dtype=torch.float64), "step": None}
    load_state_dict(got, ck)
    assert torch.equal(got["a"], _state()["a"]) and got["step"] == 11
    assert main(["verify", str(ck), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["checksums"] is False and rep["intact"] is True and rep["files_checked"] == 1


def test_verify_structure_of_hf_and_bad_input(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"x": torch.ones(100, 100), "y": torch.zeros(10)}, hf / "model.safetensors")
    assert main(["verify", str(hf)]) == 0
    assert "no checksums recorded" in capsys.readouterr().out
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[:-8])  # truncated
    assert main(["verify", str(hf)]) == 1
    assert "model.safetensors" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "missing")]) == 2
    (tmp_path / "empty").mkdir()
    assert main(["verify", str(tmp_path / "empty")]) == 2


def test_verify_checks_tp_checkpoint_and_missing_file(ck, tmp_path, capsys):
    convert_checkpoint(ck, tmp_path / "tp2", tp=2, show_progress=False)
    rep = verify_checkpoint(tmp_path / "tp2")
    assert rep.intact and rep.checksums and rep.bytes_hashed == sum(
        p.stat().st_size for p in (tmp_path / "tp2").glob("*.safetensors"))
    victim = sorted((tmp_path / "tp2").glob("rank-*.safetensors"))[-1]
    victim.write_bytes(victim.read_bytes()[:-1] + b"\x00" if victim.read_bytes()[-1:] != b"\x00" else
                       victim.read_bytes()[:-1] + b"\x01")
    rep = verify_checkpoint(tmp_path / "tp2")
    assert not rep.intact and rep.problems[0].file == victim.name
    victim.unlink()  # a missing data file: named, and the summary does not claim "no checksums recorded"
    assert main(["verify", str(tmp_path / "tp2")]) == 1
    out = capsys.readouterr().out
    assert victim.name in out and "missing" in out
    assert "no checksums recorded" not in out and "could not be opened" in out


def test_diff_fast_path_uses_checksums(ck, tmp_path):
    shutil.copytree(ck, tmp_path / "copy")
    rep = diff_checkpoints(ck, tmp_path / "copy")
    assert rep.equal and rep.equal_by_checksum == 2
    rep = diff_checkpoints(ck, tmp_path / "copy", use_checksums=False)
    assert rep.equal and rep.equal_by_checksum == 0 and rep.equal_keys == 2


def _corrupt_single_file(root: Path, world: int) -> None:
    """Input of the 4-rank scenario that loads row shards: a single-file checkpoint with a flipped byte in the
    rows only rank 2 reads (``corrupt.json``: file and block)."""
    g = torch.Generator().manual_seed(1)
    save_state_dict({"w": torch.randn(W.ROWS, W.COLS, generator=g)}, root / "ck")
    data = root / "ck" / DATA
    start = read_header(data).data_start
    per_rank = W.ROWS // 4 * W.COLS * 4
    off = start + 2 * per_rank + per_rank // 2  # the middle of rank 2's rows
    ranges = [(start + r * per_rank, start + (r + 1) * per_rank) for r in range(4)]
    touch = [set(range(lo // BLOCK_SIZE, (hi - 1) // BLOCK_SIZE + 1)) for lo, hi in ranges]
    assert [r for r in range(4) if off // BLOCK_SIZE in touch[r]] == [2]  # only rank 2 reads that block
    _flip(data, off)
    (root / "corrupt.json").write_text(json.dumps({"file": str(data), "block": off // BLOCK_SIZE}))


# one launch of 4 ranks for every 4-rank scenario of _integrity_scenarios.py (test_manager.py runs its 2-rank ones)
launched = launch_fixture("_integrity_scenarios", worlds=(4,), prepare=_corrupt_single_file, timeout_s=300)


@pytest.mark.multiproc
@each_scenario("_integrity_scenarios", worlds=(4,))
def test_four_ranks(launched, world, scenario):
    """A corrupt block one rank reads fails every rank alike; row shards loaded as column shards hash each
    touched block once in the group; a flipped byte there fails every rank alike naming every key of the block;
    a same-layout restart hashes only its own file; a rank that requests nothing hashes nothing."""
    launched.check(scenario, world)


@pytest.mark.multiproc
def test_four_ranks_errors_name_the_detecting_rank(launched):
    """The messages behind the scenarios: ranks that did not hash the bad block prefix the detecting rank's
    message with "rank R: "; a column load hashes about a quarter of the blocks on each rank."""
    launched.check("one_rank_reads_the_corrupt_block_all_fail_alike")
    msgs = launched.values("one_rank_reads_the_corrupt_block_all_fail_alike")
    data = launched.root(4) / "ck" / DATA
    assert msgs[0] == f"rank 2: {msgs[2]}" and str(data) in msgs[2]
    launched.check("column_load_of_row_shards_hashes_each_block_once")
    hashed = launched.values("column_load_of_row_shards_hashes_each_block_once")[0]
    assert len(hashed) == 4 and all(0 < h < sum(hashed) / 2 for h in hashed), hashed


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned staging of device tensors)")
def test_async_save_stages_cuda_tensors_in_pinned_memory(tmp_path):
    from oarlock.checkpoint import async_save

    g = torch.Generator().manual_seed(3)
    ref = {"w": torch.randn(2048, 1024, generator=g), "b": torch.randn(1024, generator=g)}
    dev = {k: v.cuda() for k, v in ref.items()}
    for i in range(2):  # the second save reuses the pinned buffers
        h = async_save(dev, tmp_path / f"ck{i}")
        h.wait_staged()
        for v in dev.values():
            v.mul_(3.0).add_(1.0)  # after the snapshot: must not reach the file
        h.wait()
        assert h.pinned_bytes == sum(v.numel() * 4 for v in ref.values())
        got = {k: torch.zeros_like(v) for k, v in ref.items()}
        load_state_dict(got, tmp_path / f"ck{i}")
        assert all(torch.equal(got[k], ref[k]) for k in ref)
        ref = {k: v.cuda().mul(3.0).add(1.0).cpu() for k, v in ref.items()}


def test_threaded_reads_equal_sequential_reads(tmp_path, monkeypatch):
    import threading

    from oarlock.checkpoint.runtime import executor

    g = torch.Generator().manual_seed(5)
    sd = {f"w{i}": torch.randn(64, 96, generator=g) for i in range(6)}
    save_state_dict(sd, tmp_path / "ck")
    monkeypatch.setattr(executor, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setenv("OARLOCK_IO_THREADS", "3")
    threads = []
    real = executor.execute_items

    def spy(*a):
        threads.append(threading.current_thread().name)
        return real(*a)

    monkeypatch.setattr(executor, "execute_items", spy)
    # parameters (requires_grad: the reader threads must not track the copies), resharded to column halves
    params = {k: torch.nn.Parameter(torch.zeros(64, 48)) for k in sd}
    load_state_dict({k: ShardedWeight(k, p, (64, 48), (64, 96), (0, 48)) for k, p in params.items()},
                    tmp_path / "ck")
    assert all(torch.equal(params[k].detach(), sd[k][:, 48:]) for k in params)
    assert threads and all(t.startswith("oarlock-io") for t in threads)  # read on the pool, not the caller


def test_streamed_reads_of_one_file_run_on_the_pool(tmp_path, monkeypatch):
    """The file-by-file load path (forced: ``STREAM_MIN_ITEMS`` 0) with one data file of large reads: the file's
    items are spread over three reader threads reading at once, and every target equals the saved rows. Each
    thread's first read waits until three threads have entered (a generous limit only keeps a serial reader from
    hanging); the log of entries and exits then shows three entries before any exit, which a pool running one
    read at a time cannot produce."""
    import threading

    from oarlock.checkpoint.runtime import executor

    g = torch.Generator().manual_seed(6)
    sd = {f"w{i}": torch.randn(1024, 256, generator=g) for i in range(6)}
    save_state_dict(sd, tmp_path / "ck")
    monkeypatch.setattr(executor, "STREAM_MIN_ITEMS", 0)
    monkeypatch.setattr(executor, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setenv("OARLOCK_IO_THREADS", "3")
    threads, log = [], []
    real = executor.execute_items
    entered = threading.Condition()

    def spy(*a):
        name = threading.current_thread().name
        with entered:
            first = name not in threads
            threads.append(name)
            log.append(("enter", name))
            entered.notify_all()
            if first:
                entered.wait_for(lambda: len(set(threads)) >= 3, timeout=120)
        try:
            return real(*a)
        finally:
            with entered:
                log.append(("exit", name))

    monkeypatch.setattr(executor, "execute_items", spy)
    # the second half of each tensor's rows (512 KiB each: large reads, item by item, not one coalesced span)
    got = {k: torch.nn.Parameter(torch.zeros(512, 256)) for k in sd}
    load_state_dict({k: ShardedWeight(k, p, (512, 256), (1024, 256), (512, 0)) for k, p in got.items()},
                    tmp_path / "ck")
    assert all(torch.equal(got[k].detach(), sd[k][512:]) for k in sd)
    assert len(threads) == 6 and len(set(threads)) == 3 and all(t.startswith("oarlock-io") for t in threads)
    first_exit = next(n for n, (event, _) in enumerate(log) if event == "exit")
    assert len({name for _, name in log[:first_exit]}) == 3, log  # three threads inside at once


@pytest.mark.parametrize("data_format", ["distcp", "safetensors"])
def test_verify_paddle_structure(tmp_path, data_format, capsys):
    import numpy as np

    from testkit import write_paddle_checkpoint

    tensors = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(5, dtype=np.int64)}
    write_paddle_checkpoint(tmp_path, tensors, data_format)
    assert main(["verify", str(tmp_path), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["format"] == "paddle" and rep["checksums"] is False and rep["files_checked"] == 1
    data = tmp_path / f"0_0.{data_format}"
    data.write_bytes(data.read_bytes()[: len(data.read_bytes()) // 2])  # truncated data file
    assert main(["verify", str(tmp_path)]) == 1
    assert f"0_0.{data_format}" in capsys.readouterr().out


def test_a_malformed_compact_checksum_string_is_refused(tmp_path):
    """The compact ``digests`` form must be base64 of 8 bytes per block, as many blocks as the size needs."""
    from oarlock.checkpoint.errors import CheckpointFormatError

    save_state_dict({"w": torch.ones(4, 4)}, tmp_path / "ck")
    path = tmp_path / "ck" / "metadata.json"
    good = json.loads(path.read_text())
    for bad in ("%%%%", "AAAA", "AAAAAAAAAAAAAAAAAAAAAA=="):  # not base64; 3 bytes; 16 bytes for one block
        meta = json.loads(json.dumps(good))
        rec = meta["extra"]["checksums"]["files"]["rank-00000.safetensors"]
        del rec["digests_xxh3"]
        rec["digests"] = bad
        path.write_text(json.dumps(meta))
        with pytest.raises(CheckpointFormatError, match="malformed checksums"):
            load_state_dict({"w": torch.zeros(4, 4)}, tmp_path / "ck")


def test_metadata_size_does_not_grow_with_the_data(tmp_path):
    """The block checksums live in digests files: ``metadata.json`` is the same size for a one-block and a
    three-block data file (inline digests would add 11 characters per block), and so is what rank 0 gathers."""
    import xxhash

    save_state_dict({"w": torch.zeros(1_000_000, dtype=torch.float16)}, tmp_path / "one")  # 2 MB: 1 block
    save_state_dict({"w": torch.zeros(1_000_000, dtype=torch.float64)}, tmp_path / "three")  # 8 MB: 2 blocks
    small, big = ((tmp_path / n / "metadata.json").read_text() for n in ("one", "three"))
    assert len(small) == len(big)
    for n, blocks in (("one", 1), ("three", 2)):
        data = (tmp_path / n / DATA).read_bytes()
        assert -(-len(data) // BLOCK_SIZE) == blocks
        raw = (tmp_path / n / (DATA + ".xxh3")).read_bytes()
        assert raw == b"".join(xxhash.xxh3_64_digest(data[i:i + BLOCK_SIZE]) for i in range(0, len(data), BLOCK_SIZE))


def test_corrupt_or_missing_digests_file_fails_the_load_naming_it(ck, capsys):
    side = ck / (DATA + ".xxh3")
    good = side.read_bytes()
    target = {"a": torch.full((896, 4096), 7.0), "b": torch.full((1000,), 7.0, dtype=torch.float64), "step": 0}
    for damage, words in ((lambda: _flip(side, 3), "does not match the checksum metadata.json records"),
                          (lambda: side.write_bytes(good[:-1]), "has 31 bytes, 32 were written"),
                          (lambda: side.unlink(), "is missing")):
        damage()
        with pytest.raises(ChecksumError, match=re.escape(words)) as e:
            load_state_dict(target, ck)
        assert str(side) in str(e.value) and DATA in str(e.value)
        assert bool((target["a"] == 7).all()) and bool((target["b"] == 7).all())  # nothing written
        rep = verify_checkpoint(ck)
        assert not rep.intact and any(words in p.message for p in rep.problems)
        side.write_bytes(good)
    loaded = {"a": torch.zeros(896, 4096), "b": torch.zeros(1000, dtype=torch.float64), "step": 0}
    load_state_dict(loaded, ck)
    assert torch.equal(loaded["a"], _state()["a"]) and torch.equal(loaded["b"], _state()["b"])


@pytest.mark.parametrize("bad", ["", "0123", "0123456789ABCDEF", "../../etc/passwd", 12345, None])
def test_a_malformed_digests_checksum_is_refused(ck, bad):
    from oarlock.checkpoint.errors import CheckpointFormatError

    path = ck / "metadata.json"
    meta = json.loads(path.read_text())
    meta["extra"]["checksums"]["files"][DATA]["digests_xxh3"] = bad
    path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointFormatError, match="digests_xxh3.*not 16 hex digits"):
        load_state_dict({"a": torch.zeros(896, 4096), "b": torch.zeros(1000, dtype=torch.float64), "step": 0}, ck)


def test_inline_digests_of_earlier_versions_still_verify(ck):
    """A checkpoint whose metadata holds the digests inline (format 3) loads, and a flipped byte is still caught."""
    import base64

    path = ck / "metadata.json"
    meta = json.loads(path.read_text())
    rec = meta["extra"]["checksums"]["files"][DATA]
    raw = (ck / (DATA + ".xxh3")).read_bytes()
    del rec["digests_xxh3"]
    rec["digests"] = base64.b64encode(raw).decode()
    meta["version"] = 3
    path.write_text(json.dumps(meta))
    (ck / (DATA + ".xxh3")).unlink()
    loaded = {"a": torch.zeros(896, 4096), "b": torch.zeros(1000, dtype=torch.float64), "step": 0}
    load_state_dict(loaded, ck)
    assert torch.equal(loaded["a"], _state()["a"])
    assert verify_checkpoint(ck).intact
    _flip(ck / DATA, 2 * BLOCK_SIZE + 5)
    with pytest.raises(ChecksumError, match=r"block 2\)"):
        load_state_dict(loaded, ck)


def test_digests_of_many_files_are_read_together_and_a_bad_one_is_named(tmp_path, monkeypatch):
    """A load hashing blocks of several files reads their digests files together (prefetch_digests, on a pool);
    a corrupt one among them still fails the load naming it, with nothing written."""
    import oarlock.checkpoint.integrity.verify as integrity  # the module whose verify_group looks it up

    key = "model.layers.0.mlp.down_proj.weight"  # row-parallel: split along dim 1 over the tp ranks
    full = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    save_file({key: full}, tmp_path / "src.safetensors")
    convert_checkpoint(tmp_path / "src.safetensors", tmp_path / "ck", tp=4)
    sides = sorted((tmp_path / "ck").glob("rank-*.safetensors.xxh3"))
    assert len(sides) == 4
    seen: list[int] = []
    real = integrity.prefetch_digests
    monkeypatch.setattr(integrity, "prefetch_digests", lambda sums: (seen.append(len(sums)), real(sums))[1])
    out = {key: torch.zeros(64, 32)}
    load_state_dict(out, tmp_path / "ck", strict=False)
    assert torch.equal(out[key], full) and seen == [4]
    _flip(sides[2], 0)
    out = {key: torch.full((64, 32), 5.0)}
    with pytest.raises(ChecksumError, match=re.escape(str(sides[2])) + ".*does not match"):
        load_state_dict(out, tmp_path / "ck", strict=False)
    assert bool((out[key] == 5).all())


def test_verify_names_a_damaged_file_once_per_problem(tmp_path, capsys):
    """`verify` of a checkpoint whose data file lost 10 bytes: each problem line names the file once (before:
    'rank-00000.safetensors: trunc/rank-00000.safetensors: file has ...'), with both byte counts; the JSON
    problem messages carry no second copy either."""
    ck = tmp_path / "trunc"
    save_state_dict({"w": torch.randn(4, 4)}, ck)
    f = ck / "rank-00000.safetensors"
    size = os.path.getsize(f)
    os.truncate(f, size - 10)
    assert main(["verify", str(ck)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [
        f"rank-00000.safetensors: file has {size - 10} bytes, {size} were written at save (truncated or overwritten)",
        f"rank-00000.safetensors: invalid safetensors file: the header's data offsets run to byte {size}, the file "
        f"has only {size - 10} bytes (truncated, or a corrupt header)"], lines
    assert main(["verify", str(ck), "--json"]) == 1
    probs = json.loads(capsys.readouterr().out)["problems"]
    assert [p["file"] for p in probs] == ["rank-00000.safetensors"] * 2
    assert not any("rank-00000.safetensors" in p["message"] for p in probs), probs


def test_verify_of_a_truncated_lone_file_names_it_once(tmp_path, capsys):
    """`oarlock verify` of a truncated safetensors file (written by the safetensors library) and of a directory
    holding one: exit 1, the problem line names the file once (not "x: x: ..."), and the summary says the
    checkpoint could not be opened instead of counting "0 file(s)"."""
    for target, victim in ((tmp_path / "m.safetensors", tmp_path / "m.safetensors"),
                           (tmp_path / "d", tmp_path / "d" / "model.safetensors")):
        victim.parent.mkdir(exist_ok=True)
        save_file({"a": torch.randn(100, 10)}, str(victim))
        os.truncate(victim, victim.stat().st_size - 10)
        assert main(["verify", str(target)]) == 1
        out = capsys.readouterr().out
        problem, summary = out.strip().splitlines()
        assert problem.count(str(victim)) == 1 and problem.startswith(f"{victim}: ") and "truncated" in problem, out
        assert "could not be opened" in summary and "0 file(s)" not in summary, out


def test_verify_report_names_the_header_as_the_file_header_not_as_a_key(tmp_path):
    """A flipped byte in a data file's first block: oarlock verify says the block holds the file header and the
    key, never quoting 'header' as if it were a tensor name."""
    save_state_dict({"w": torch.arange(64, dtype=torch.float32)}, tmp_path / "ck")
    f = tmp_path / "ck" / DATA
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF  # w's data; the file is one block, so that block also holds the header
    f.write_bytes(bytes(raw))
    rep = verify_checkpoint(tmp_path / "ck")
    assert not rep.intact
    msg = rep.problems[0].message
    assert "holding the file header, key 'w'" in msg and "'header'" not in msg
