"""Scenarios of test_live_spread.py (4 gloo ranks): replicated sources send per requested slice, balanced by bytes
over their holders. Ranks 0 and 1 are the trainer (both hold the replicated tensors), ranks 2 and 3 the engine.
Every scenario checks the values against plain torch slicing and each rank's exact bytes."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, distribute_tensor

from oarlock.checkpoint import ShardedWeight, WeightSync, reshard_state_dict
from testkit import seeded_tensor

warnings.filterwarnings("ignore")


def all_sent(rep) -> list[int]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, rep.bytes_sent)
    return out


def cols(key: str, W: torch.Tensor, part: int, parts: int) -> ShardedWeight:
    n = W.shape[1] // parts
    return ShardedWeight(key, torch.zeros(W.shape[0], n, dtype=W.dtype), (W.shape[0], n), tuple(W.shape),
                         (0, part * n))


def scenario_replicated_tensor_into_column_halves(ctx):
    # the case: [256, 128] fp32 held whole by two trainer ranks, column halves wanted by two engine ranks
    W = seeded_tensor((256, 128), torch.float32, 1)
    src = {"w": W.clone()} if ctx.rank < 2 else {}
    tgt = {"w": cols("w", W, ctx.rank - 2, 2)} if ctx.rank >= 2 else {}
    rep = reshard_state_dict(src, tgt)
    if ctx.rank >= 2:
        c = (ctx.rank - 2) * 64
        assert torch.equal(tgt["w"].local_tensor, W[:, c:c + 64])
        assert rep.bytes_received == 256 * 64 * 4
    sent = all_sent(rep)
    assert sent == [65536, 65536, 0, 0], sent  # was [131072, 0, 0, 0]: one holder sent everything
    return sent


def scenario_one_receiver_wants_the_whole_replicated_tensor(ctx):
    W = seeded_tensor((256, 128), torch.float32, 2)
    src = {"w": W.clone()} if ctx.rank < 2 else {}
    tgt = {"w": torch.zeros(256, 128)} if ctx.rank == 2 else {}
    sync = WeightSync(src, tgt, strict=False)
    for step in range(2):  # planned, then replayed: the same split
        if ctx.rank < 2:
            src["w"].copy_(W + step)
        rep = sync.run()
        if ctx.rank == 2:
            assert torch.equal(tgt["w"], W + step)
            assert rep.bytes_received == 131072 and rep.messages_received >= 2
        sent = all_sent(rep)
        assert sent == [65536, 65536, 0, 0], sent  # row halves, one per holder
    assert rep.plan_reused


def scenario_big_replicated_tensor_split_into_unstaged_row_ranges(ctx):
    # 4 MiB: two row ranges of 2 MiB, each sent from the source and received into the target without staging
    W = seeded_tensor((1024, 1024), torch.float32, 3)
    src = {"emb": W.clone()} if ctx.rank < 2 else {}
    tgt = {"emb": torch.zeros(1024, 1024)} if ctx.rank == 2 else {}
    rep = reshard_state_dict(src, tgt, strict=False)
    if ctx.rank == 2:
        assert torch.equal(tgt["emb"], W)
        assert rep.staging_peak_bytes == 0, rep
    assert all_sent(rep) == [2 << 20, 2 << 20, 0, 0]


def scenario_replicated_dtensor_on_trainer_mesh(ctx):
    # a DTensor replicated over the trainer's 2-rank mesh (a grid rule with a replica dim): same spreading
    trainer = dist.device_mesh.DeviceMesh("cpu", [0, 1])
    W = seeded_tensor((256, 128), torch.float32, 4)
    src = {"w": distribute_tensor(W.clone(), trainer, [Replicate()])} if ctx.rank < 2 else {}
    tgt = {"w": cols("w", W, ctx.rank - 2, 2)} if ctx.rank >= 2 else {}
    rep = reshard_state_dict(src, tgt)
    if ctx.rank >= 2:
        c = (ctx.rank - 2) * 64
        assert torch.equal(tgt["w"].local_tensor, W[:, c:c + 64])
    assert all_sent(rep) == [65536, 65536, 0, 0]


def scenario_listed_row_blocks_replicated_with_transpose_and_cast(ctx):
    # each trainer rank holds the same two uneven row blocks (listed shards, two per rank: stored names key@offset);
    # the engine wants the transpose in bf16, column halves: slices of both blocks, split over both holders
    W = seeded_tensor((384, 160), torch.float32, 5)
    blocks = [(0, 150), (150, 384)]
    src = {"w": [ShardedWeight("w", W[a:b].clone(), (b - a, 160), (384, 160), (a, 0)) for a, b in blocks]} \
        if ctx.rank < 2 else {}
    T = W.t().contiguous().bfloat16()
    tgt = {"wt": cols("wt", T, ctx.rank - 2, 2)} if ctx.rank >= 2 else {}
    rep = reshard_state_dict(src, tgt, aoa_config=["w -> wt, permute='[1, 0]'", "wt -> wt, dtype='bfloat16'"])
    if ctx.rank >= 2:
        c = (ctx.rank - 2) * 192
        assert torch.equal(tgt["wt"].local_tensor, T[:, c:c + 192])
    sent = all_sent(rep)
    # receiver 2 reads 150 + 42 rows of the two blocks, receiver 3 192 rows of the second: each slice halved
    assert sum(sent) == 384 * 160 * 2 and max(sent[:2]) <= 1.05 * min(sent[:2]), sent


def scenario_many_small_replicated_tensors_balanced(ctx):
    # 24 tensors of 1 KiB (below the split size): each receiver asks its holders in turn
    ws = {f"n{i}": seeded_tensor((16, 16), torch.float32, 10 + i) for i in range(24)}
    src = {k: v.clone() for k, v in ws.items()} if ctx.rank < 2 else {}
    tgt = {k: cols(k, v, ctx.rank - 2, 2) for k, v in ws.items()} if ctx.rank >= 2 else {}
    rep = reshard_state_dict(src, tgt)
    if ctx.rank >= 2:
        c = (ctx.rank - 2) * 8
        for k, v in ws.items():
            assert torch.equal(tgt[k].local_tensor, v[:, c:c + 8])
    sent = all_sent(rep)
    assert sum(sent) == 24 * 1024 and max(sent[:2]) <= 1.25 * min(sent[:2]), sent


def scenario_a_holder_that_also_receives_copies_its_own(ctx):
    # colocated: ranks 0 and 1 hold the tensor and want column halves of it; ranks 2 and 3 want them too
    W = seeded_tensor((64, 32), torch.float32, 6)
    src = {"w": W.clone()} if ctx.rank < 2 else {}
    tgt = {"w": cols("w", W, ctx.rank % 2, 2)}
    rep = reshard_state_dict(src, tgt)
    c = (ctx.rank % 2) * 16
    assert torch.equal(tgt["w"].local_tensor, W[:, c:c + 16])
    if ctx.rank < 2:
        assert rep.bytes_local == 64 * 16 * 4 and rep.bytes_received == rep.bytes_local  # no message to itself
    else:
        assert rep.bytes_local == 0 and rep.bytes_received == 64 * 16 * 4
    sent = all_sent(rep)
    assert sent[0] == sent[1] == 64 * 16 * 4 * 2, sent  # its own half, and half of each engine rank's half


def scenario_uneven_unreplicated_row_blocks(ctx):
    # one listed block per trainer rank, not a torch.chunk split: both stored under the name "w" in their own rank
    # "file"; a request names the shard by sender and name
    W = seeded_tensor((96, 40), torch.float32, 7)
    a, b = [(0, 30), (30, 96)][ctx.rank] if ctx.rank < 2 else (0, 0)
    src = {"w": ShardedWeight("w", W[a:b].clone(), (b - a, 40), (96, 40), (a, 0))} if ctx.rank < 2 else {}
    tgt = {"w": cols("w", W, ctx.rank - 2, 2)} if ctx.rank >= 2 else {}
    rep = reshard_state_dict(src, tgt)
    if ctx.rank >= 2:
        c = (ctx.rank - 2) * 20
        assert torch.equal(tgt["w"].local_tensor, W[:, c:c + 20])
    assert all_sent(rep) == [30 * 40 * 4, 66 * 40 * 4, 0, 0]
