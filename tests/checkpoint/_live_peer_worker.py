"""One process of the disaggregated live-reshard test (test_live_peer.py): a "trainer" job (ranks 0-1 of the joint
group, its own default group of 2 on one port) and an "engine" job (ranks 2-3, its own default group of 2 on
another port) meet through oarlock.checkpoint.join_group on a third port, without touching their default groups.

Usage: python _live_peer_worker.py JOINT_RANK TRAINER_PORT ENGINE_PORT JOINT_PORT OUT_DIR MODE
MODE ``ok``: reshard, replay, and check values; ``kill``: joint rank 1 dies in the middle of the second round.
Writes OUT_DIR/rank-N.json with what happened.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.device_mesh import init_device_mesh

from oarlock.checkpoint import ShardedWeight, WeightSync, join_group, reshard_state_dict
from oarlock.checkpoint.runtime import transfer


def main() -> None:
    rank, tport, eport, jport, out, mode = int(sys.argv[1]), *map(int, sys.argv[2:5]), sys.argv[5], sys.argv[6]
    torch.set_num_threads(1)
    job_rank = rank % 2
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(tport if rank < 2 else eport))
    dist.init_process_group("gloo", rank=job_rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    W = torch.randn(64, 40, generator=torch.Generator().manual_seed(7))
    result: dict = {"rank": rank}
    try:
        group = join_group("127.0.0.1", jport, 4, rank, timeout=20 if mode == "kill" else 60)
        if rank < 2:  # trainer: FSDP2-style rows over its own default mesh
            mesh = init_device_mesh("cpu", (2,))
            sources, targets = {"model.w": distribute_tensor(W.clone(), mesh, [Shard(0)])}, {}
        else:  # engine: TP2 columns, written in place
            c = (rank - 2) * 20
            sources = {}
            targets = {"w": ShardedWeight("w", torch.zeros(64, 20), (64, 20), (64, 40), (0, c))}
        aoa = ["model.w -> w"]
        if mode == "ok":
            rep = reshard_state_dict(sources, targets, process_group=group, aoa_config=aoa)
            result["first"] = rep.bytes_received
            sync = WeightSync(sources, targets, process_group=group, aoa_config=aoa, bucket_bytes=4096)
            if rank < 2:
                sources["model.w"].to_local().mul_(2)
            sync.run()
            rep = sync.run()
            result.update(reused=rep.plan_reused, received=rep.bytes_received, rounds=rep.rounds)
            if rank >= 2:
                c = (rank - 2) * 20
                result["equal"] = bool(torch.equal(targets["w"].local_tensor, 2 * W[:, c:c + 20]))
        else:
            sync = WeightSync(sources, targets, process_group=group, aoa_config=aoa, bucket_bytes=4096)
            sync.run()  # a good first run
            real_post = transfer.post
            calls = [0]

            def dying_post(dw, sends, recvs):
                calls[0] += 1
                if rank == 1 and calls[0] == 2:
                    os._exit(3)  # a sender dies mid-sync
                return real_post(dw, sends, recvs)

            transfer.post = dying_post
            try:
                sync.run()
                result["raised"] = None
            except Exception as e:  # every survivor must get here within the group's timeout
                result["raised"] = f"{type(e).__name__}: {e}"
            result["torn"] = sync.torn
    except Exception:
        result["error"] = traceback.format_exc()
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)  # skip gloo's teardown with a dead peer


if __name__ == "__main__":
    main()
