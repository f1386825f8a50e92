"""Save and restore model + AdamW state (single process), oarlock next to torch.distributed.checkpoint (DCP).

Model: oarlock Llama, hidden 512, 4 layers, vocab 16000 (~25M parameters, fp32), AdamW after one step, so the
checkpoint holds ~300 MB (weights + two moments). oarlock: ``sharded_state_dict`` + ``sharded_optimizer_state_dict``
-> ``save_state_dict``; restore with ``load_sharded_optimizer_state_dict(load_model=True)`` into a fresh model and
optimizer (lazy states created first). Anchor: DCP's ``get_state_dict`` -> ``dcp.save``; ``dcp.load`` +
``set_state_dict`` into a fresh model and optimizer (whose states are initialised by DCP itself). Both restores
are checked to give the same optimizer state as the saved one.

Saves are timed with and without plan caching on both sides: oarlock reuses the previous save's plan unless its
plan cache is cleared first (``save.plan_cache.clear()``); DCP caches plans only with
``DefaultSavePlanner(enable_plan_caching=True)``. Every operation runs once untimed first (warm-up, and the plans
the cached rows reuse), then the repetitions interleave the operations, each repetition starting with another.

Run: ``python benchmarks/optim_resume.py`` (pins itself to one core; CPU seconds of this process, best of
--repeat). Appends to benchmarks/RESULTS.md with ``--record``. ``--smoke``: a 2-layer model of hidden 64, one
run: checks the script runs (its figures mean nothing).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from oarlock.checkpoint import (load_sharded_optimizer_state_dict, save_state_dict,  # noqa: E402
                                sharded_optimizer_state_dict, sharded_state_dict)
from oarlock.models.llama import Llama, LlamaConfig  # noqa: E402

CFG = LlamaConfig(vocab_size=16000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4)


SMOKE = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)


def trained():
    torch.manual_seed(0)
    m = Llama(CFG)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    ids = torch.randint(0, CFG.vocab_size, (1, 8))
    m(ids).float().logsumexp(-1).mean().backward()
    opt.step()
    return m, opt


def fresh():
    torch.manual_seed(1)
    m = Llama(CFG)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


def cpu_time(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--record", action="store_true", help="append the result to benchmarks/RESULTS.md")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, one run: checks the script runs")
    args = ap.parse_args(argv)
    global CFG
    if args.smoke:  # trained() and fresh() build CFG
        CFG, args.repeat, args.record = SMOKE, 1, False
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from oarlock.checkpoint.runtime.save import plan_cache

    model, opt = trained()
    nparams = sum(p.numel() for p in model.parameters())
    tmp = Path(tempfile.mkdtemp(prefix="optim_bench_"))
    try:
        def oar_save(cached: bool = True):
            if not cached:  # forget the previous save's plan: this one plans as a first save does
                plan_cache.clear()
            msd = sharded_state_dict(model)
            save_state_dict({**msd, **sharded_optimizer_state_dict(opt, msd)}, tmp / "oar")

        def dcp_save(cached: bool = False):
            shutil.rmtree(tmp / "dcp", ignore_errors=True)
            msd, osd = get_state_dict(model, opt)
            # DCP's plan cache is class-level and used only by a planner that enables it
            planner = DefaultSavePlanner(enable_plan_caching=True) if cached else None
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / "dcp"), planner=planner)

        loaded = {}

        def oar_load():
            m, o = fresh()
            load_sharded_optimizer_state_dict(o, sharded_state_dict(m), tmp / "oar", load_model=True)
            loaded["oar"] = o

        def dcp_load():
            m, o = fresh()
            msd, osd = get_state_dict(m, o)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=str(tmp / "dcp"))
            set_state_dict(m, o, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            loaded["dcp"] = o

        ops = {"oarlock save": oar_save, "oarlock save (no plan cache)": lambda: oar_save(False),
               "DCP save": dcp_save, "DCP save (plan cached)": lambda: dcp_save(True),
               "oarlock load": oar_load, "DCP load": dcp_load}
        for fn in ops.values():  # untimed: warm-up, and the plans the cached rows reuse
            fn()
        times = {name: float("inf") for name in ops}
        names = list(ops)
        for r in range(args.repeat):
            k = r * len(names) // args.repeat  # each repetition starts with another operation
            for name in names[k:] + names[:k]:
                times[name] = min(times[name], cpu_time(ops[name], 1))
        for name in ("oar", "dcp"):
            for p, q in zip(opt.param_groups[0]["params"], loaded[name].param_groups[0]["params"]):
                for s in ("exp_avg", "exp_avg_sq", "step"):
                    assert torch.equal(opt.state[p][s], loaded[name].state[q][s]), (name, s)
        size = sum(f.stat().st_size for f in (tmp / "oar").iterdir())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lines = [f"model + AdamW state: {nparams / 1e6:.1f}M parameters, {size / 2**20:.0f} MiB on disk (oarlock)"]
    for label, o, d in (("save, plans cached", "oarlock save", "DCP save (plan cached)"),
                        ("save, no plan caching", "oarlock save (no plan cache)", "DCP save"),
                        ("load", "oarlock load", "DCP load")):
        o, d = times[o], times[d]
        lines.append(f"{label}: oarlock {o:7.3f} s   DCP {d:7.3f} s   ratio {o / d:5.2f}x")
    text = "\n".join(lines)
    print(text)
    if args.record:
        from _results import write_section  # benchmarks/_results.py: this script's own section

        write_section(__file__, "Optimizer state save/restore, single process (issue 6)", ""
                    f"Command: `python benchmarks/optim_resume.py --record` (one core, CPU seconds, best of "
                    f"{args.repeat})\n\n```\n{text}\n```\n\nRestores include building the fresh model/optimizer and "
                    "creating lazy states; both restores are checked bit-equal to the saved optimizer state. "
                    "CPU time (user + system) excludes waiting for the disk. The machine was shared with other "
                    "sessions; the ratio is the figure to compare.\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
