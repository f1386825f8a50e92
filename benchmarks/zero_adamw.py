"""ZeRO-1 AdamW (oarlock.models.zero) against replicated torch.optim.AdamW on data-parallel ranks.

Both sides average the same random gradients over a gloo DP group and update the parameters of a SmolLM2-shaped
model (fewer layers). Anchor: ``all_reduce`` of every gradient + ``torch.optim.AdamW`` on every rank (what DDP
does). oarlock: ``ZeroRedundancyAdamW.step()`` (one flat ``all_reduce``, update of this rank's slice,
``all_gather``). Reports optimizer-state bytes per rank and step time (median of the timed steps), as ratios.

    python benchmarks/zero_adamw.py [--dp 2] [--layers 4] [--steps 5] [--record]
"""

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from oarlock.models.llama import Llama, LlamaConfig  # noqa: E402
from oarlock.models.zero import ZeroRedundancyAdamW  # noqa: E402


def state_bytes(states) -> int:
    return sum(t.numel() * t.element_size() for s in states for k, t in s.items()
               if isinstance(t, torch.Tensor) and k != "step")


def worker(rank, world, port, args, out):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = LlamaConfig.smollm2_135m()
    cfg.num_hidden_layers = args.layers
    torch.manual_seed(0)
    results = {}
    for kind in ("anchor", "zero"):
        model = Llama(cfg)
        params = list(model.parameters())
        if kind == "anchor":
            opt = torch.optim.AdamW(params, lr=1e-3)
        else:
            opt = ZeroRedundancyAdamW(model.named_parameters(), lr=1e-3, group=dist.group.WORLD)
        times = []
        g = torch.Generator().manual_seed(rank)
        for step in range(args.steps + 1):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            dist.barrier()
            t = time.perf_counter()
            if kind == "anchor":
                for p in params:
                    dist.all_reduce(p.grad)
                    p.grad /= world
            opt.step()
            dist.barrier()
            if step:  # the first step allocates the states
                times.append(time.perf_counter() - t)
        sb = state_bytes(opt.state.values()) if kind == "anchor" else \
            sum(g_["exp_avg"].numel() * 4 * 2 for g_ in opt.param_groups)
        results[kind] = (statistics.median(times), sb, sum(p.numel() for p in params))
        del model, opt, params
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--record", action="store_true", help="append the result to benchmarks/RESULTS.md")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.spawn(worker, args=(args.dp, port, args, q), nprocs=args.dp)
    r = q.get()
    (ta, ba, n), (tz, bz, _) = r["anchor"], r["zero"]
    text = (f"SmolLM2-shaped model, {args.layers} layers, {n / 1e6:.1f} M fp32 parameters, DP={args.dp} (gloo, CPU)\n"
            f"optimizer state per rank:  torch AdamW {ba / 2**20:8.1f} MiB   ZeRO-1 {bz / 2**20:8.1f} MiB"
            f"   ({bz / ba:.2f}x anchor)\n"
            f"step (grad average + update + param sync), median of {args.steps}:\n"
            f"                           torch AdamW {ta:8.3f} s     ZeRO-1 {tz:8.3f} s     ({tz / ta:.2f}x anchor)\n")
    print(text)
    if args.record:
        cmd = "python benchmarks/zero_adamw.py " + " ".join(sys.argv[1:])
        load = os.getloadavg()[0]
        from _results import write_section  # benchmarks/_results.py: this script's own section

        write_section(__file__, "ZeRO-1 AdamW vs replicated torch.optim.AdamW (oarlock.models.zero)", f"Command: `{cmd}`\n\n"
                    f"```\n{text}```\n\nMeasured at a load average of {load:.0f}; both sides share the load, compare "
                    "the ratios.\n")


if __name__ == "__main__":
    main()
