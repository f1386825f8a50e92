"""Multi-rank scenarios against the real S3 server of ``tests/s3server.py`` (the parent passes the ``AWS_*``
variables and ``OARLOCK_TEST_S3_URL``, a fresh ``s3://bucket/prefix``). Expected values are slices of full
tensors every rank builds from one seed, never the code under test's output."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from oarlock.checkpoint import ShardedWeight, load_state_dict, save_state_dict

SHAPE = (48, 40)


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {"w": torch.randn(SHAPE, generator=g), "e": torch.randn(37, generator=g).to(torch.bfloat16),
            "step": torch.arange(7, dtype=torch.int64)}


def rows(t: torch.Tensor, rank: int, world: int) -> tuple[int, int]:
    n = t.shape[0]
    return n * rank // world, n * (rank + 1) // world


def data_object_sizes(url: str) -> dict[str, int]:
    """``{file name: bytes}`` of the data objects under ``url`` (``s3://bucket/prefix``), from the store's own
    listing through boto3 (endpoint and keys from the ``AWS_*`` variables), not through oarlock."""
    import boto3
    from botocore.config import Config

    bucket, _, prefix = url[len("s3://"):].partition("/")
    client = boto3.client("s3", config=Config(s3={"addressing_style": "path"}))
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]
    return {o["Key"].rsplit("/", 1)[1]: o["Size"] for o in listed if o["Key"].endswith(".safetensors")}


def scenario_save_rows_load_columns(ctx):
    url = os.environ["OARLOCK_TEST_S3_URL"] + "/ckpt"
    full = full_tensors()
    r, w = dist.get_rank(), dist.get_world_size()
    a, b = rows(full["w"], r, w)
    state = {"w": ShardedWeight("w", full["w"][a:b].clone(), (b - a, SHAPE[1]), SHAPE, (a, 0)),
             "e": full["e"].clone(), "step": full["step"].clone(), "note": "run-7"}
    save_state_dict(state, url)
    dist.barrier()
    # resharded: each rank asks for a column band of w (crossing every saved row shard)
    c0, c1 = SHAPE[1] * r // w, SHAPE[1] * (r + 1) // w
    dst = {"w": ShardedWeight("w", torch.full((SHAPE[0], c1 - c0), float("nan")), (SHAPE[0], c1 - c0), SHAPE,
                              (0, c0)),
           "e": torch.zeros(37, dtype=torch.bfloat16), "step": torch.zeros(7, dtype=torch.int64), "note": ""}
    rep = load_state_dict(dst, url)
    assert torch.equal(dst["w"].local_tensor, full["w"][:, c0:c1]), "column band differs"
    assert torch.equal(dst["e"].view(torch.int16), full["e"].view(torch.int16))
    assert torch.equal(dst["step"], full["step"])
    assert dst["note"] == "run-7"
    assert rep.missing_keys == []
    # Every column band crosses every saved row shard, so the load touches every data object; each is smaller
    # than one 4 MiB checksum block, read by no rank (almost) whole, so the group hashes each object once.
    sizes = data_object_sizes(url)
    assert len(sizes) == w and max(sizes.values()) < 4 * 1024 * 1024, sizes
    hashed = [None] * w
    dist.all_gather_object(hashed, rep.bytes_hashed)
    assert sum(hashed) == sum(sizes.values()), (hashed, sizes)
    return {"files": sorted(rep.files_read), "hashed": hashed}


def scenario_replicated_readers_fetch_each_block_once(ctx):
    """Every rank loads the whole of a 12 MiB tensor that rank 0 saved (three 4 MiB blocks): each block has one
    owner, and the other ranks, which read it whole too, hash it from the same fetch instead of fetching it a
    second time after the verdict. Every rank fetches the data object's bytes once and hashes all of them."""
    from s3server import counted_fetches

    url = os.environ["OARLOCK_TEST_S3_URL"] + "/replicated"
    g = torch.Generator().manual_seed(77)
    full = torch.randn(3 * 1024 * 1024, generator=g)  # 12 MiB fp32
    r = dist.get_rank()
    # rank 0 holds the tensor, the others an empty piece of it: one data file with all the bytes
    mine = full if r == 0 else full[:0]
    state = {"big": ShardedWeight("big", mine.clone(), tuple(mine.shape), tuple(full.shape), (0,))}
    save_state_dict(state, url)
    dist.barrier()
    out = {"big": torch.zeros_like(full)}
    with counted_fetches() as fetched:
        rep = load_state_dict(out, url)
    assert torch.equal(out["big"], full)
    data = full.numel() * 4
    sizes = data_object_sizes(url)
    assert sizes["rank-00000.safetensors"] > data, sizes
    # every block it reads whole, owned or not: the whole of the one object holding the tensor, header included
    assert rep.bytes_hashed == sizes["rank-00000.safetensors"], (rep.bytes_hashed, sizes)
    assert data <= sum(fetched) <= data + 256 * 1024, (sum(fetched), data)  # once, plus header reads
    return {"hashed": rep.bytes_hashed}


def scenario_one_rank_refused_by_the_store_fails_every_rank(ctx):
    """Only the last rank holds a wrong secret key. Its refused request must reach every rank as an error of the
    same load, and of the same save (no rank left waiting in a collective); no target is written."""
    from oarlock.checkpoint import CheckpointError

    url = os.environ["OARLOCK_TEST_S3_URL"] + "/refused"
    r, w = dist.get_rank(), dist.get_world_size()
    save_state_dict({"x": torch.arange(12.0)}, url)
    dist.barrier()
    saved = dict(os.environ)
    if r == w - 1:
        os.environ["AWS_SECRET_ACCESS_KEY"] = "not-the-secret"
    os.environ["OARLOCK_S3_MAX_ATTEMPTS"] = "1"
    out = {"x": torch.zeros(12)}
    mine = {"y": ShardedWeight("y", torch.ones(2), (2,), (2 * w,), (2 * r,))}  # every rank uploads its rows
    texts = []
    try:
        for step in (lambda: load_state_dict(out, url), lambda: save_state_dict(mine, url + "-2")):
            try:
                step()
            except CheckpointError as e:
                texts.append(str(e))
            else:
                texts.append("")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    for text in texts:  # the load, then a save
        assert "HTTP 403" in text and "check the credentials" in text, repr(text)
        if r != w - 1:
            assert f"rank {w - 1}" in text, text
    assert torch.equal(out["x"], torch.zeros(12))
