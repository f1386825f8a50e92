"""PaddlePaddle 3.3.1 FlexCheckpoint on the checkpoint_comm.py workload (run by it in .paddle-venv through
``python -m paddle.distributed.launch --nproc_per_node 4``; gloo on CPU).

Saves 32 fp32 [4096, 2048] tensors as 2x2-mesh ShardedWeights ([Shard(0), Shard(1)]), then loads them as
[Shard(1), Replicate()] with ``comm_method="broadcast"``, cold and hot page cache, timed between barriers.
Paddle's load moves slices to CUDA before communicating; on a CPU build ``Tensor.cuda`` (and ``pin_memory``)
are patched at runtime to return the tensor itself, which is all its broadcast path needs.

Usage (by checkpoint_comm.py): _paddle_flex_load.py DIR REPS
"""

import json
import os
import sys
import time

import numpy as np
import paddle
import paddle.distributed as dist

N_TENSORS, ROWS, COLS = 32, 4096, 2048


def _patch_cuda() -> None:
    paddle.Tensor.cuda = lambda self, *a, **k: self
    paddle.Tensor.pin_memory = lambda self, *a, **k: self


def _drop_caches(rank: int) -> bool:
    ok = 1
    if rank == 0:
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError:
            ok = 0
    t = paddle.to_tensor([ok], dtype="int32")
    dist.broadcast(t, src=0)
    return bool(t.numpy()[0])


def main() -> None:
    root, reps = sys.argv[1], int(sys.argv[2])
    _patch_cuda()
    paddle.set_device("cpu")
    dist.init_parallel_env()
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    rank = dist.get_rank()
    i, j = divmod(rank, 2)
    r0, c0 = i * (ROWS // 2), j * (COLS // 2)
    src = {}
    for k in range(N_TENSORS):
        a = np.random.default_rng(1000 * k + rank).standard_normal((ROWS // 2, COLS // 2), dtype=np.float32)
        src[f"layers.{k}.weight"] = ShardedWeight(f"layers.{k}.weight", paddle.to_tensor(a), (ROWS // 2, COLS // 2),
                                                  (ROWS, COLS), (r0, c0))
    ckpt = os.path.join(root, "paddle_ckpt")
    dist.barrier()
    t0 = time.perf_counter()
    dist.save_state_dict(src, ckpt)
    dist.barrier()
    t_save = time.perf_counter() - t0
    del src
    res = {"rank": rank, "save": t_save, "rows": {}}
    cold_ok = True
    for temp in ("cold", "hot"):
        for _ in range(reps):
            tgt = {f"layers.{k}.weight": ShardedWeight(f"layers.{k}.weight",
                                                       paddle.zeros([ROWS, COLS // 2], dtype="float32"),
                                                       (ROWS, COLS // 2), (ROWS, COLS), (0, i * (COLS // 2)))
                   for k in range(N_TENSORS)}
            if temp == "cold":
                cold_ok = _drop_caches(rank) and cold_ok
            dist.barrier()
            t0 = time.perf_counter()
            dist.load_state_dict(tgt, ckpt, comm_method="broadcast")
            dist.barrier()
            res["rows"].setdefault(temp, []).append(time.perf_counter() - t0)
            # correctness: rows of source rank (a, i) of key 0 and 31
            for k in (0, N_TENSORS - 1):
                got = tgt[f"layers.{k}.weight"].local_tensor.numpy()
                for a in range(2):
                    want = np.random.default_rng(1000 * k + 2 * a + i).standard_normal(
                        (ROWS // 2, COLS // 2), dtype=np.float32)
                    assert np.array_equal(got[a * (ROWS // 2):(a + 1) * (ROWS // 2)], want), (k, a)
            del tgt
    res["cold_ok"] = cold_ok
    with open(os.path.join(root, f"paddle-result-{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()


if __name__ == "__main__":
    main()
