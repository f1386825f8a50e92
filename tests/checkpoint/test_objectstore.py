"""Checkpoints in an S3-compatible object store (``s3://bucket/prefix``), against a real SeaweedFS server
started by the ``s3_server`` fixture (tests/s3server.py): save and resharded load on several ranks, the commit
protocol (a killed save never loads, the next save cleans it), checksums, hostile keys, retries through a
proxy that drops connections, the CLI and the manager. Expected values come from the saved tensors
themselves (independent of the loader)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from oarlock.checkpoint import load_state_dict, save_state_dict
from oarlock.checkpoint.errors import CheckpointDestinationError, CheckpointFormatError
from oarlock.checkpoint.storage.backend import ObjectStoreError, UnsupportedLocationError
from oarlock.checkpoint.storage.location import ObjectPath, location

REPO = Path(__file__).resolve().parents[2]


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(64, 33, generator=g), "b": torch.randint(0, 1000, (129,), generator=g),
            "h": torch.randn(5, 7, generator=g).to(torch.float16), "n": 3}


def _empty_like(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}


def _assert_equal(got: dict, want: dict) -> None:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


# ---------------------------------------------------------------- locations (no server)

def test_location_parsing():
    assert location("s3://my-bucket/run/ckpt/") == ObjectPath("my-bucket", "run/ckpt")
    assert str(location("s3://my-bucket/run//ckpt")) == "s3://my-bucket/run/ckpt"
    assert location("relative/dir") == Path("relative/dir")
    assert location("ckpt:v1") == Path("ckpt:v1")  # a colon in a local name is not a scheme
    for bad, words in [("gs://b/x", "scheme 'gs'"), ("http://host/x", "scheme 'http'"),
                       ("file:///tmp/x", "scheme 'file'"), ("file:x", "scheme 'file'"),
                       ("az://c/x", "scheme 'az'"), ("s3:/b/x", "lost a slash"),
                       ("s3://B_ad/x", "not a valid S3 bucket"), ("s3://bucket/a/../b", "'..'")]:
        with pytest.raises(UnsupportedLocationError, match=words):
            location(bad)


@pytest.mark.parametrize("url", ["gs://bucket/run/ckpt", "http://127.0.0.1:1/x", "file:///tmp/x", "s3:/b/x"])
def test_other_schemes_never_write_locally(tmp_path, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedLocationError):
        save_state_dict(_state(), url)
    with pytest.raises(UnsupportedLocationError):
        load_state_dict(_empty_like(_state()), url)
    assert list(tmp_path.iterdir()) == []  # no 'gs:' or 's3:' directory appeared


# ---------------------------------------------------------------- against the server

def test_save_load_roundtrip_writes_nothing_locally(s3, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = _state(1)
    url = s3.url + "/ckpt"
    save_state_dict(state, url)
    assert list(tmp_path.iterdir()) == []  # the old bug: a local 's3:/bucket/...' directory
    names = {o["Key"].rsplit("/", 1)[1] for o in s3.client().list_objects_v2(
        Bucket=s3.bucket, Prefix=s3.prefix + "/ckpt/")["Contents"]}
    assert names == {"metadata.json", ".oarlock-files", "rank-00000.safetensors", "rank-00000.safetensors.xxh3"}
    out = _empty_like(state)
    rep = load_state_dict(out, url)
    _assert_equal(out, state)
    assert rep.bytes_hashed > 0
    # an async save to the bucket
    state3 = _state(9)
    save_state_dict(state3, s3.url + "/async", async_save=True).wait()
    out = _empty_like(state3)
    load_state_dict(out, s3.url + "/async")
    _assert_equal(out, state3)
    # saving again replaces it (the old commit record first)
    state2 = _state(2)
    save_state_dict(state2, url)
    out = _empty_like(state)
    load_state_dict(out, url)
    _assert_equal(out, state2)


def test_a_verified_load_fetches_each_block_once(s3):
    """With verification on, the data file's blocks are fetched once (to hash) and the reads copy the verified
    bytes: the bytes fetched from the store stay within one copy of the data file (plus its header reads),
    where a second fetch of every block would double them; the values are still exact."""
    from s3server import counted_fetches

    g = torch.Generator().manual_seed(11)
    state = {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(10)}  # 10 MiB: three 4 MiB blocks
    url = s3.url + "/once"
    save_state_dict(state, url)
    size = s3.client().head_object(Bucket=s3.bucket, Key=s3.prefix + "/once/rank-00000.safetensors")["ContentLength"]
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    with counted_fetches() as fetched:
        rep = load_state_dict(out, url)
    _assert_equal(out, state)
    assert rep.bytes_hashed == size
    assert size <= sum(fetched) <= size + 256 * 1024, (sum(fetched), size)


def test_a_load_lists_nothing_and_a_missing_object_is_named(s3):
    """A load from a store makes no listing request (a listing costs one request per 1,000 objects, on every
    rank: O(ranks of the save) per rank at scale): the commit record is found with one HEAD, the data objects are
    those it names. When one of them is gone after the commit, the load fails naming its key, and the targets
    keep their values."""
    state = _state(4)
    url = s3.url + "/nolist"
    save_state_dict(state, url)
    client = location(url).storage.client
    ops: list[str] = []

    def note(model, **_):
        ops.append(model.name)

    client.meta.events.register("before-call.s3", note)
    try:
        out = _empty_like(state)
        load_state_dict(out, url)
    finally:
        client.meta.events.unregister("before-call.s3", note)
    _assert_equal(out, state)
    assert "ListObjectsV2" not in ops, ops
    # the commit record, the prefix itself (once per process) and the size of the data object read
    assert ops.count("HeadObject") <= 3, ops
    s3.client().delete_object(Bucket=s3.bucket, Key=s3.prefix + "/nolist/rank-00000.safetensors")
    out = _empty_like(state)
    with pytest.raises(CheckpointFormatError, match="nolist/rank-00000.safetensors: .*no such object"):
        load_state_dict(out, url)
    _assert_equal(out, _empty_like(state))


def test_kept_blocks_stay_within_their_budget(s3, monkeypatch):
    """OARLOCK_S3_KEEP_BYTES bounds the verified blocks a load keeps for its reads: with room for one 4 MiB block
    of the three (4, 4 and about 2 MiB), the load is still exact, never holds more than one block, and fetches
    the blocks it could not keep a second time (to read them)."""
    from s3server import counted_fetches

    from oarlock.checkpoint.storage import s3 as s3_storage

    g = torch.Generator().manual_seed(12)
    state = {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(10)}  # 10 MiB: three 4 MiB blocks
    url = s3.url + "/budget"
    save_state_dict(state, url)
    size = s3.client().head_object(Bucket=s3.bucket, Key=s3.prefix + "/budget/rank-00000.safetensors")["ContentLength"]
    monkeypatch.setenv("OARLOCK_S3_KEEP_BYTES", str(4 * 1024 * 1024))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    with counted_fetches() as fetched:
        rep = load_state_dict(out, url)
    _assert_equal(out, state)
    assert rep.bytes_hashed == size
    kept = s3_storage._verified.peak
    assert 0 < kept <= 4 * 1024 * 1024  # one block kept (whichever fetch finished first), never two
    # the blocks not kept are fetched again for the reads (less the file's header, which no tensor read covers)
    assert 2 * size - kept - 256 * 1024 <= sum(fetched) <= 2 * size - kept + 256 * 1024, (sum(fetched), size, kept)


def test_a_save_holds_at_most_two_upload_parts(s3, monkeypatch):
    """Issue 28's memory bound: a save streams its tensors into multipart uploads, holding no more of its own
    memory than two part buffers (one uploading while the next fills); whole parts go straight from the tensors.
    Measured with tracemalloc (Python allocations: part buffers, request bodies) after a first save has created
    the client and loaded the service model; 48 MiB of tensors of odd sizes, 5 MiB parts."""
    import tracemalloc

    monkeypatch.setenv("OARLOCK_S3_PART_BYTES", str(5 * 1024 * 1024))
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(1024 * 1024 + 7 * i, generator=g) for i in range(12)}  # 48 MiB
    save_state_dict(state, s3.url + "/mem-warm")
    tracemalloc.start()
    try:
        save_state_dict(state, s3.url + "/mem")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 2 * 5 * 1024 * 1024 + 1024 * 1024, f"peak {peak / 2**20:.1f} MiB for two 5 MiB parts"
    out = _empty_like(state)
    load_state_dict(out, s3.url + "/mem")
    _assert_equal(out, state)


def test_async_save_on_the_last_line_of_a_script_is_uploaded(s3):
    """Python ends its thread pools before ``atexit`` hooks run; the async save finishing in the hook must still
    upload its parts (several, on the upload threads when they are alive) and commit."""
    n = 3 * 1024 * 1024  # 12 MiB of float32: three 5 MiB parts
    script = textwrap.dedent(f"""
        import torch
        from oarlock.checkpoint import save_state_dict
        save_state_dict({{"w": torch.arange({n}, dtype=torch.float32)}}, {s3.url + '/last'!r}, async_save=True)
    """)
    env = {**os.environ, **s3.env, "OARLOCK_S3_PART_BYTES": str(5 * 1024 * 1024)}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "FAILED" not in r.stderr, r.stderr
    out = {"w": torch.zeros(n)}
    load_state_dict(out, s3.url + "/last")
    assert torch.equal(out["w"], torch.arange(n, dtype=torch.float32))


def test_multipart_upload_and_partial_ranged_reads(s3, monkeypatch):
    monkeypatch.setenv("OARLOCK_S3_PART_BYTES", str(5 * 1024 * 1024))
    g = torch.Generator().manual_seed(5)
    big = torch.randn(3 * 1024 * 1024 + 17, generator=g)  # 12 MiB: three parts of 5 MiB
    url = s3.url + "/big"
    save_state_dict({"big": big}, url)
    from oarlock.checkpoint import ShardedWeight

    # a slice in the middle: only the blocks it touches are hashed, only its bytes read
    part = ShardedWeight("big", torch.zeros(1000), (1000,), tuple(big.shape), (2_000_000,))
    rep = load_state_dict({"big": part}, url)
    assert torch.equal(part.local_tensor, big[2_000_000:2_001_000])
    assert rep.bytes_read == 4000
    assert 0 < rep.bytes_hashed <= 2 * 4 * 1024 * 1024


@pytest.mark.parametrize("sign", ["0", "1"])
def test_upload_bodies_are_unsigned_unless_asked(s3, monkeypatch, sign):
    """Part bodies go as ``UNSIGNED-PAYLOAD`` (no SHA-256 pass over every byte; their integrity is the block
    checksums); ``OARLOCK_S3_SIGN_PAYLOAD=1`` restores body signing. The header each UploadPart carried is
    captured on the wire side of botocore and compared with hashlib's SHA-256 of the part."""
    import hashlib

    monkeypatch.setenv("OARLOCK_S3_PART_BYTES", str(5 * 1024 * 1024))
    monkeypatch.setenv("OARLOCK_S3_SIGN_PAYLOAD", sign)
    big = torch.arange(3 * 1024 * 1024, dtype=torch.int32)  # 12 MiB: parts of 5, 5 and 2 MiB
    url = s3.url + f"/sign{sign}"
    client = location(url).storage.client
    seen: list[tuple[str, bytes]] = []

    def capture(request, **_):
        body = request.body
        data = bytes(body.read()) if hasattr(body, "read") else bytes(body or b"")
        if hasattr(body, "seek"):
            body.seek(0)
        seen.append((request.headers["x-amz-content-sha256"].decode(), data))

    client.meta.events.register("before-send.s3.UploadPart", capture)
    try:
        save_state_dict({"big": big}, url)
    finally:
        client.meta.events.unregister("before-send.s3.UploadPart", capture)
    assert len(seen) >= 2, "the 12 MiB file should go as a multipart upload"
    for header, data in seen:
        want = hashlib.sha256(data).hexdigest() if sign == "1" else "UNSIGNED-PAYLOAD"
        assert header == want, (header, len(data))
    out = {"big": torch.zeros_like(big)}
    load_state_dict(out, url)
    assert torch.equal(out["big"], big)


@pytest.mark.multiproc
def test_multirank_save_and_resharded_load(s3, multirank):
    out = multirank("_objectstore_scenarios", 3, env={**s3.env, "OARLOCK_TEST_S3_URL": s3.url})
    out.check()


def test_flipped_byte_is_a_checksum_error(s3):
    from oarlock.checkpoint.integrity import ChecksumError, verify_checkpoint

    state = _state(3)
    url = s3.url + "/ckpt"
    save_state_dict(state, url)
    c = s3.client()
    key = f"{s3.prefix}/ckpt/rank-00000.safetensors"
    data = bytearray(c.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    data[-100] ^= 0x01  # in the data section (the last tensor)
    c.put_object(Bucket=s3.bucket, Key=key, Body=bytes(data))
    with pytest.raises(ChecksumError, match=r"rank-00000\.safetensors: checksum mismatch"):
        load_state_dict(_empty_like(state), url)
    rep = verify_checkpoint(url)
    assert not rep.intact and any("checksum mismatch" in p.message for p in rep.problems)


def test_killed_save_never_loads_and_is_cleaned_by_the_next(s3, tmp_path):
    good = _state(4)
    save_state_dict(good, s3.url + "/old")
    script = textwrap.dedent(f"""
        import os, signal, torch
        import oarlock.checkpoint.storage.commit.objects as objects
        from oarlock.checkpoint import save_state_dict
        # die as a killed job would: after every data object is uploaded, before the commit record
        objects.publish_objects = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        save_state_dict({{"x": torch.ones(1000)}}, {s3.url + '/new'!r})
    """)
    env = {**os.environ, **s3.env}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert p.returncode == -9, p.stderr.decode()[-2000:]
    c = s3.client()
    left = {o["Key"].rsplit("/", 1)[1] for o in c.list_objects_v2(Bucket=s3.bucket,
                                                                 Prefix=s3.prefix + "/new/")["Contents"]}
    assert left == {".oarlock-incomplete", "rank-00000.safetensors", "rank-00000.safetensors.xxh3"}
    with pytest.raises(CheckpointFormatError, match="incomplete checkpoint"):
        load_state_dict({"x": torch.zeros(1000)}, s3.url + "/new")
    out = _empty_like(good)
    load_state_dict(out, s3.url + "/old")  # the previous checkpoint is intact
    _assert_equal(out, good)
    save_state_dict({"y": torch.full((3,), 2.0)}, s3.url + "/new")  # cleans the killed save's objects
    left = {o["Key"].rsplit("/", 1)[1] for o in c.list_objects_v2(Bucket=s3.bucket,
                                                                 Prefix=s3.prefix + "/new/")["Contents"]}
    assert left == {"metadata.json", ".oarlock-files", "rank-00000.safetensors", "rank-00000.safetensors.xxh3"}
    y = {"y": torch.zeros(3)}
    load_state_dict(y, s3.url + "/new")
    assert torch.equal(y["y"], torch.full((3,), 2.0))


def test_foreign_objects_are_refused_and_kept(s3):
    c = s3.client()
    c.put_object(Bucket=s3.bucket, Key=f"{s3.prefix}/ckpt/notes.txt", Body=b"mine")
    with pytest.raises(CheckpointDestinationError, match="notes.txt"):
        save_state_dict(_state(), s3.url + "/ckpt")
    save_state_dict(_state(), s3.url + "/ckpt", overwrite=True)
    assert c.get_object(Bucket=s3.bucket, Key=f"{s3.prefix}/ckpt/notes.txt")["Body"].read() == b"mine"


@pytest.mark.parametrize("bad, why", [("../other/rank-00000.safetensors", "'..'"),
                                      ("/abs/rank-00000.safetensors", "absolute"),
                                      ("s3://other-bucket/rank-00000.safetensors", "another bucket"),
                                      ("sub//rank-00000.safetensors", "plain relative object key")])
def test_hostile_metadata_key_is_refused_before_reading(s3, bad, why):
    state = {"a": torch.arange(6.0)}
    url = s3.url + "/ckpt"
    save_state_dict(state, url)
    c = s3.client()
    # an object the hostile entry would reach, outside the checkpoint's prefix
    c.put_object(Bucket=s3.bucket, Key=f"{s3.prefix}/other/rank-00000.safetensors", Body=b"secret")
    mkey = f"{s3.prefix}/ckpt/metadata.json"
    meta = json.loads(c.get_object(Bucket=s3.bucket, Key=mkey)["Body"].read())
    meta["tensors"]["a"] = {"global_shape": [6], "dtype": "float32",
                            "shards": [{"global_offset": [0], "local_shape": [6], "file": bad, "name": "a"}]}
    c.put_object(Bucket=s3.bucket, Key=mkey, Body=json.dumps(meta).encode())
    with pytest.raises(CheckpointFormatError, match=f"refusing to open it"):
        load_state_dict({"a": torch.zeros(6)}, url)
    with pytest.raises(CheckpointFormatError, match=why):
        load_state_dict({"a": torch.zeros(6)}, url)


def test_retries_through_a_proxy_that_drops_connections(s3, monkeypatch):
    from s3server import DroppingProxy

    host, port = s3.endpoint.rsplit(":", 1)
    proxy = DroppingProxy(("127.0.0.1", int(port)), drop=3)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        state = _state(6)
        save_state_dict(state, s3.url + "/ckpt")
        out = _empty_like(state)
        load_state_dict(out, s3.url + "/ckpt")
        _assert_equal(out, state)
        assert proxy.accepted > 3
    finally:
        proxy.close()
    dead = DroppingProxy(("127.0.0.1", int(port)), drop=10 ** 9)  # every connection drops
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", dead.endpoint)
        monkeypatch.setenv("OARLOCK_S3_MAX_ATTEMPTS", "2")
        # the error names the bucket, the object key and the operation
        with pytest.raises(ObjectStoreError, match=rf"s3://{s3.bucket}/{s3.prefix}/ckpt\S*: \w+ failed after 2 "
                                                   "attempts"):
            load_state_dict(_empty_like(state), s3.url + "/ckpt")
        assert dead.accepted == 2
    finally:
        dead.close()


def test_manager_keep_last_and_load_latest(s3):
    from oarlock.checkpoint.lifecycle.manager import CheckpointManager

    root = s3.url + "/run"
    m = CheckpointManager(root, keep_last=2)
    states = {s: _state(10 + s) for s in (1, 2, 3)}
    for step, st in states.items():
        m.save(step, st)
    assert m.steps() == [2, 3] and m.latest() == 3
    c = s3.client()
    assert c.get_object(Bucket=s3.bucket, Key=f"{s3.prefix}/run/latest")["Body"].read() == b"step-00000003\n"
    left = c.list_objects_v2(Bucket=s3.bucket, Prefix=f"{s3.prefix}/run/step-00000001/").get("Contents", [])
    assert left == []  # the deleted step: every object gone
    out = _empty_like(states[3])
    assert CheckpointManager(root).load_latest(out) == 3
    _assert_equal(out, states[3])
    # a killed save of step 4 (data uploaded, no commit record): not the latest; the next save cleans it
    c.put_object(Bucket=s3.bucket, Key=f"{s3.prefix}/run/step-00000004/.oarlock-incomplete",
                 Body=b'{"save_id": "x", "world": 1}')
    c.put_object(Bucket=s3.bucket, Key=f"{s3.prefix}/run/step-00000004/rank-00000.safetensors", Body=b"partial")
    assert m.latest() == 3
    m.save(5, states[1])
    assert m.steps() == [3, 5]
    assert c.list_objects_v2(Bucket=s3.bucket, Prefix=f"{s3.prefix}/run/step-00000004/").get("Contents", []) == []


@pytest.mark.slow
def test_cli_inspect_verify_diff_convert(s3, tmp_path):
    env = {**os.environ, **s3.env}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "oarlock.cli", *args], env=env, capture_output=True,
                              text=True, timeout=300)

    state = _state(7)
    del state["n"]  # conversions carry tensors only
    url = s3.url + "/ckpt"
    save_state_dict(state, url)
    r = cli("inspect", url, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert {t["key"]: t["shape"] for t in info["tensors"]} == {"a": [64, 33], "b": [129], "h": [5, 7]}
    r = cli("verify", url)
    assert r.returncode == 0, r.stdout + r.stderr
    # convert: from the bucket to a local directory, then from there back into the bucket at TP 2
    r = cli("convert", url, str(tmp_path / "local"))
    assert r.returncode == 0, r.stderr
    r = cli("convert", str(tmp_path / "local"), s3.url + "/tp2", "--tp", "2")
    assert r.returncode == 0, r.stderr
    out = _empty_like(state)
    load_state_dict(out, s3.url + "/tp2")
    _assert_equal(out, state)
    r = cli("diff", url, s3.url + "/tp2")
    assert r.returncode == 0, r.stdout + r.stderr
    save_state_dict({**state, "a": state["a"] + 1}, s3.url + "/other")
    r = cli("diff", url, s3.url + "/other")
    assert r.returncode != 0 and "a" in r.stdout
    # export_hf into the bucket: the files, the index last
    from oarlock.checkpoint.convert import export_hf

    export_hf(url, s3.url + "/hf")
    names = {o["Key"].rsplit("/", 1)[1] for o in s3.client().list_objects_v2(
        Bucket=s3.bucket, Prefix=s3.prefix + "/hf/")["Contents"]}
    assert any(n.endswith(".safetensors") for n in names), names


def test_cli_convert_into_the_bucket_as_hf_and_dcp(s3):
    """``oarlock convert`` writes HF safetensors and DCP into a bucket (it used to upload them, then fail on its
    own read-back). Checked independently: the HF objects with the safetensors library, the DCP prefix with
    torch's ``dcp.load`` through AWS's s3torchconnector reader (oarlock reads only its own format from a store)."""
    import safetensors.torch

    env = {**os.environ, **s3.env}
    state = _state(8)
    del state["n"]
    url = s3.url + "/ckpt"
    save_state_dict(state, url)
    r = subprocess.run([sys.executable, "-m", "oarlock.cli", "convert", url, s3.url + "/hf", "--to", "hf"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "3 tensors in 1 safetensors file(s)" in r.stdout, r.stdout
    c = s3.client()
    names = [o["Key"].rsplit("/", 1)[1] for o in c.list_objects_v2(Bucket=s3.bucket,
                                                                  Prefix=s3.prefix + "/hf/")["Contents"]]
    files = [n for n in names if n.endswith(".safetensors")]
    assert len(files) == 1, names
    got = safetensors.torch.load(c.get_object(Bucket=s3.bucket, Key=f"{s3.prefix}/hf/{files[0]}")["Body"].read())
    _assert_equal(got, state)

    r = subprocess.run([sys.executable, "-m", "oarlock.cli", "convert", url, s3.url + "/dcp", "--to", "dcp",
                        "--tp", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "torch.distributed.checkpoint (DCP), 3 tensors" in r.stdout, r.stdout
    s3dcp = pytest.importorskip("s3torchconnector.dcp", reason="s3torchconnector (test extra) not installed")
    import torch.distributed.checkpoint as dcp

    out = _empty_like(state)
    dcp.load(out, storage_reader=s3dcp.S3StorageReader(region=s3.env["AWS_REGION"], path=s3.url + "/dcp"),
             no_dist=True)
    _assert_equal(out, state)


def test_verify_reports_a_missing_data_object_as_a_problem(s3, tmp_path):
    """A deleted data object is a finding of ``oarlock verify`` (exit 1, the file named), as a deleted local file
    is, not a failure to run (exit 2)."""
    env = {**os.environ, **s3.env}
    state = _state(9)
    url = s3.url + "/ckpt"
    save_state_dict(state, url)
    save_state_dict(state, tmp_path / "local")
    s3.client().delete_object(Bucket=s3.bucket, Key=f"{s3.prefix}/ckpt/rank-00000.safetensors")
    (tmp_path / "local" / "rank-00000.safetensors").unlink()
    for where in (url, str(tmp_path / "local")):
        r = subprocess.run([sys.executable, "-m", "oarlock.cli", "verify", where], env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 1, (where, r.stdout, r.stderr)
        assert "rank-00000.safetensors" in r.stdout and "missing" in r.stdout, (where, r.stdout)
        assert "1 problem(s)" in r.stdout, (where, r.stdout)


def test_wrong_credentials_are_named_as_the_likely_cause(s3, monkeypatch):
    """A refused request (wrong secret key, on the real server) says to check the credentials, naming the
    variables, and leaves the target untouched."""
    save_state_dict({"x": torch.ones(4)}, s3.url + "/ckpt")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    monkeypatch.setenv("OARLOCK_S3_MAX_ATTEMPTS", "1")
    out = {"x": torch.zeros(4)}
    with pytest.raises(ObjectStoreError, match=r"HTTP 403.*check the credentials \(AWS_ACCESS_KEY_ID and "
                                               r"AWS_SECRET_ACCESS_KEY, or AWS_PROFILE\)"):
        load_state_dict(out, s3.url + "/ckpt")
    assert torch.equal(out["x"], torch.zeros(4))


def test_storage_protocol_local_and_s3_agree(s3, tmp_path, monkeypatch):
    from oarlock.checkpoint.storage.local import LocalStorage
    from oarlock.checkpoint.storage.s3 import S3Storage

    monkeypatch.setenv("OARLOCK_S3_PART_BYTES", str(5 * 1024 * 1024))
    payload = os.urandom(11 * 1024 * 1024 + 3)  # three parts: two from memory, one gathered
    results = []
    for st, base in ((LocalStorage(), str(tmp_path)), (S3Storage(s3.bucket), s3.prefix + "/proto")):
        with st.open_writer(f"{base}/big") as w:
            w.write(payload[:100])
            w.write(memoryview(payload)[100:])
        st.put_bytes(f"{base}/small", b"abc")
        buf = bytearray(9 * 1024 * 1024)  # a ranged read split into parallel GETs on S3
        st.read_into(f"{base}/big", 12345, memoryview(buf))
        assert bytes(buf) == payload[12345:12345 + len(buf)]
        with pytest.raises(CheckpointFormatError):
            st.read_into(f"{base}/small", 1, memoryview(bytearray(10)))  # past the end
        listing = st.list(base)
        results.append((listing, st.size(f"{base}/big"), st.exists(f"{base}/small"), st.read_bytes(f"{base}/small")))
        st.delete([f"{base}/small", f"{base}/missing"])
        assert not st.exists(f"{base}/small")
    assert results[0] == results[1] == ({"big": len(payload), "small": 3}, len(payload), True, b"abc")


def test_retry_policy_throttling_and_5xx_retried_4xx_not(monkeypatch):
    from botocore.exceptions import ClientError, EndpointConnectionError

    from oarlock.checkpoint.storage.s3 import S3Storage

    def answer(code: str, status: int) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                           "GetObject")

    monkeypatch.setenv("OARLOCK_S3_MAX_ATTEMPTS", "4")
    st = S3Storage("some-bucket")
    for failures in ([answer("SlowDown", 503)] * 3, [answer("InternalError", 500)],
                     [answer("TooManyRequests", 429)], [EndpointConnectionError(endpoint_url="http://x")]):
        left = list(failures)

        def fn():
            if left:
                raise left.pop(0)
            return "ok"

        assert st.call("GetObject", "k", fn) == "ok" and not left
    calls = []

    def denied():
        calls.append(1)
        raise answer("AccessDenied", 403)

    with pytest.raises(ObjectStoreError, match=r"s3://some-bucket/run/k: PutObject failed after 1 attempt: "
                                               r"AccessDenied \(HTTP 403\)"):
        st.call("PutObject", "run/k", denied)
    assert len(calls) == 1  # a refusal is not retried

    def always():
        raise answer("SlowDown", 503)

    with pytest.raises(ObjectStoreError, match="UploadPart 3 failed after 4 attempts: SlowDown"):
        st.call("UploadPart 3", "run/k", always)
