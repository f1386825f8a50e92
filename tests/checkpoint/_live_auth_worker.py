"""One process of the authenticated-rendezvous tests (test_live_auth.py).

Usage: python _live_auth_worker.py '<json spec>' OUT_FILE
spec: ``{"rank", "world", "port", "token" (or null), "timeout", "mode"}``; modes:

- ``join``: join_group, one all_reduce of ``rank + 1``, record the group's view;
- ``sync``: join_group (world 2), rank 0 sends a [64, 32] tensor to rank 1 with ``WeightSync(verify=True)``;
  with ``"forge": "xxh3" | "other-key" | "same-key"`` rank 0 replaces the first chunk's bytes by bytes of its own
  and re-hashes them as a process without the key would (XXH3, or another key), or as a member would;
- ``tcpstore``: a plain torch TCPStore client (what joined before the rendezvous was authenticated).

Writes OUT_FILE (JSON): ``ok``, ``error`` (type and message), and what the mode measured.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
import traceback

import torch


def main() -> None:
    spec, out = json.loads(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    res: dict = {"rank": spec["rank"]}
    t0 = time.monotonic()
    try:
        if spec["mode"] == "tcpstore":
            import torch.distributed as dist

            dist.TCPStore("127.0.0.1", spec["port"], spec["world"], False,
                          datetime.timedelta(seconds=spec["timeout"]))
            res["ok"] = True
        else:
            from oarlock.checkpoint import join_group

            g = join_group("127.0.0.1", spec["port"], spec["world"], spec["rank"], token=spec["token"],
                           timeout=spec["timeout"])
            res.update(authenticated=g.authenticated, refused=g.refused, keyed=g.verify_key is not None)
            if spec["mode"] == "join":
                t = torch.tensor([float(spec["rank"] + 1)])
                g.pg.allreduce([t]).wait()
                res["sum"] = float(t[0])
            else:
                sync(spec, g, res)
            res["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported to the test
        res["ok"] = False
        res["error"] = f"{type(e).__name__}: {e}"
        res["trace"] = traceback.format_exc()
    res["seconds"] = time.monotonic() - t0
    with open(out, "w") as f:
        json.dump(res, f)


def sync(spec: dict, group, res: dict) -> None:
    from oarlock.checkpoint import ShardedWeight, WeightSync
    from oarlock.checkpoint.runtime import transfer

    W = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    if spec["rank"] == 0:
        sources, targets = {"w": W.clone()}, {}
    else:
        sources = {}
        targets = {"w": ShardedWeight("w", torch.zeros(64, 32), (64, 32), (64, 32), (0, 0))}
    forge = spec.get("forge")
    if forge and spec["rank"] == 0:
        def forged(sender, receiver, k, buf):
            if k:
                return
            n = buf.numel() - 8
            buf[:n] = 7  # bytes of the forger's choosing
            key = {"xxh3": None, "other-key": b"k" * 32, "same-key": group.verify_key}[forge]
            buf[n:] = torch.tensor([transfer.chunk_hash(buf[:n], key)], dtype=torch.int64).view(torch.uint8)

        transfer._tamper = forged
    sync = WeightSync(sources, targets, process_group=group, verify=True, bucket_bytes=4096)
    try:
        rep = sync.run()
        res["bytes_received"] = rep.bytes_received
    except Exception as e:  # noqa: BLE001
        res["raised"] = f"{type(e).__name__}: {e}"
    res["torn"] = sync.torn
    if spec["rank"] == 1:
        got = targets["w"].local_tensor
        res["equal"] = bool(torch.equal(got, W))
        forged_value = float(torch.full((4,), 7, dtype=torch.uint8).view(torch.float32)[0])
        res["forged_elements"] = int((got == forged_value).sum())  # the forger's bytes that landed


if __name__ == "__main__":
    main()
