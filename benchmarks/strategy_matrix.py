"""Strategy-conversion matrix: time per conversion and bytes per rank, oarlock next to torch.distributed.checkpoint.

For each pair of the FlexCheckpoint matrix (``shared/design/flexcheckpoint.md`` 6.11, the pairs of
``tests/checkpoint/_matrix_scenarios.py``, whose layouts, meshes and runs this script reuses) on 4 gloo ranks (one
launch), with a larger model than the test's
(dense: hidden 256, 4 layers, vocabulary 32000, ~13M parameters; MoE: 8 experts of width 256 plus a shared
expert, ~15M parameters when either side is expert parallel):

* oarlock, model + optimizer: layout A saves ``sharded_state_dict`` + ``sharded_optimizer_state_dict`` (ZeRO-1
  flattened states when ``d > 1``, else ``torch.optim.AdamW`` after one step); layout B restores both with
  ``load_sharded_optimizer_state_dict(load_model=True)`` (``tp_relayout_aoa_config`` when the TP degree changes);
  B's weights are then checked bit for bit against A's;
* oarlock, model only, and the anchor DCP (``dcp.save`` / ``dcp.load`` of ``model.state_dict()``, DTensors for
  TP) on the same layouts. DCP cannot convert ZeRO flattened optimizer states or the TP-degree-dependent fused
  gate/up layout, so it is timed on the weights only and its TP-changing loads give wrong gate/up values
  (timing anchor only).

Times are between barriers (slowest rank; hot page cache, both libraries fsync on save); best of ``--reps``; in
each repetition the saves (and the loads) run in a rotated order, so neither library always goes first. Neither
library reuses a save plan here: DCP plans every save by default, and oarlock's two saves alternate between two
different states, so its plan cache (one plan per process group) never matches.
Bytes: what each rank of A wrote (its data file) and what each rank of B read (``LoadReport.bytes_read``)
against the bytes of its own shards ("ideal": a reader that reads exactly its targets; oarlock moves no tensor
data between ranks). Usage: ``python benchmarks/strategy_matrix.py [--reps N] [--pairs A->B,...] [--smoke]
[--record]`` (``--smoke``: two pairs, one dense and one MoE, on the test's tiny models, one repetition: checks the
script runs; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import socket
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
# the matrix test's scenarios module, and the test helpers it imports (multirank, testkit)
sys.path[:0] = [str(REPO / "src"), str(REPO / "tests" / "checkpoint"), str(REPO / "tests")]

import _matrix_scenarios as W  # noqa: E402  (layouts, meshes, runs and the pair list of the matrix test)
from oarlock.checkpoint import load_state_dict, save_state_dict, sharded_optimizer_state_dict  # noqa: E402
from oarlock.models.llama import LlamaConfig, tp_relayout_aoa_config  # noqa: E402
from oarlock.models.parallel import ParallelLayout, single_device_state_dict  # noqa: E402

DENSE = LlamaConfig(vocab_size=16000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4)
MOE = LlamaConfig(**{**DENSE.to_dict(), "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                     "shared_expert_intermediate_size": 512})


def _nbytes(sd: dict) -> int:
    return sum(sw.local_tensor.numel() * sw.local_tensor.element_size() for sw in sd.values()
               if hasattr(sw, "local_tensor"))


def rotated(items: list, r: int) -> list:
    """``items`` rotated to start with the ``r``-th (modulo their number): repetition ``r``'s order."""
    k = r % len(items)
    return items[k:] + items[:k]


def rank_main(rank: int, world: int, port: int, root: str, reps: int, pairs: list[str], smoke: bool) -> None:
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    cluster = W.Cluster()
    root_p = Path(root)
    rows = []

    def timed(fn, group_member: bool) -> float:
        dist.barrier()
        t = time.perf_counter()
        if group_member:
            fn()
        dist.barrier()  # the slowest rank's time
        return time.perf_counter() - t

    dense, moe = (W.DENSE, W.MOE) if smoke else (DENSE, MOE)
    for pair in pairs:
        sa, sb = pair.split("->")
        la, lb = ParallelLayout.parse(sa), ParallelLayout.parse(sb)
        cfg = moe if la.ep > 1 or lb.ep > 1 else dense
        mesh_a, mesh_b = cluster.mesh(la), cluster.mesh(lb)
        ga, gb = cluster.group(la), cluster.group(lb)
        in_a, in_b = cluster.member(la), cluster.member(lb)
        d_full, d_model, d_dcp = (root_p / f"{pair}.{k}".replace("->", "_to_") for k in ("full", "model", "dcp"))
        a = W.Run(la, cfg, mesh_a, None, seed=0) if in_a else None
        if a is not None:  # one step: real optimizer states (torch AdamW creates its states lazily)
            a.step(0)
        t = {"save_full": [], "save_model": [], "save_dcp": [], "load_full": [], "load_model": [], "load_dcp": []}
        saves = [("save_full", lambda: a.save(d_full, ga)),
                 ("save_model", lambda: save_state_dict(a.sharded(), d_model, process_group=ga)),
                 ("save_dcp", lambda: dcp.save(a.model.state_dict(), checkpoint_id=str(d_dcp), process_group=ga))]
        for r in range(reps):
            for name, fn in rotated(saves, r):
                if name == "save_dcp" and in_a and rank == 0 and d_dcp.exists():
                    shutil.rmtree(d_dcp)  # untimed (timed() starts with a barrier): DCP writes into a fresh directory
                t[name].append(timed(fn, in_a))
        written = sum(f.stat().st_size for f in d_full.glob(f"rank-{rank:05d}.safetensors")) if in_a else 0
        saved = W.gather_weights(single_device_state_dict(a.model) if in_a else {})
        a = None  # frees layout A before B is built
        b = W.Run(lb, cfg, mesh_b, None, seed=1) if in_b else None
        aoa = {"aoa_statements": tp_relayout_aoa_config(cfg)} if la.tp != lb.tp else None
        reports = []
        loads = [("load_full", lambda: reports.append(b.load(d_full, gb, aoa))),
                 ("load_model", lambda: load_state_dict(b.sharded(), d_model, aoa_config=aoa, process_group=gb)),
                 ("load_dcp", lambda: dcp.load(b.model.state_dict(), checkpoint_id=str(d_dcp), process_group=gb))]
        for r in range(reps):
            for name, fn in rotated(loads, r):
                t[name].append(timed(fn, in_b))
        ok = True
        if in_b:
            # untimed, last: DCP's load may have written wrong gate/up values (TP-changing pairs), which the check
            # must not see
            reports.append(b.load(d_full, gb, aoa))
            got = single_device_state_dict(b.model)
            ok = all(torch.equal(v, saved[k]) for k, v in got.items())
            msd = b.sharded()
            ideal = _nbytes(msd) + _nbytes({k: v for k, v in sharded_optimizer_state_dict(b.opt, msd).items()
                                            if not k.startswith("optimizer.")})
            read = reports[-1].bytes_read
        else:
            ideal = read = 0
        b = None
        per_rank: list = [None] * world
        dist.all_gather_object(per_rank, {"written": written, "read": read, "ideal": ideal, "ok": ok})
        rows.append({"pair": pair, "model": "moe" if cfg is moe else "dense",
                     **{k: min(v) for k, v in t.items()}, "ranks": per_rank})
        for d in (d_full, d_model, d_dcp):
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
        dist.barrier()
    if rank == 0:
        (root_p / "rows.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def table(rows: list[dict]) -> str:
    out = ["| pair | model | oarlock save A (model+opt) s | oarlock load B (model+opt) s | oarlock save / DCP save "
           "(weights) | oarlock load / DCP load (weights) | MiB written per A rank | MiB read per B rank | "
           "read / ideal (max over B ranks) | B == A bitwise |",
           "|---|---|---:|---:|---:|---:|---|---|---:|---|"]
    for r in rows:
        ranks = r["ranks"]
        wr = "/".join(_mib(x["written"]) for x in ranks if x["written"])
        rd = "/".join(_mib(x["read"]) for x in ranks if x["read"])
        over = max(x["read"] / x["ideal"] for x in ranks if x["ideal"])
        ok = all(x["ok"] for x in ranks)
        out.append(f"| {r['pair']} | {r['model']} | {r['save_full']:.3f} | {r['load_full']:.3f} | "
                   f"{r['save_model'] / r['save_dcp']:.2f} | {r['load_model'] / r['load_dcp']:.2f} | {wr} | {rd} | "
                   f"{over:.2f} | {ok} |")
    tot = {k: sum(r[k] for r in rows) for k in ("save_full", "load_full", "save_model", "save_dcp", "load_model",
                                                "load_dcp")}
    out.append(f"| **all {len(rows)}** | | {tot['save_full']:.2f} | {tot['load_full']:.2f} | "
               f"{tot['save_model'] / tot['save_dcp']:.2f} | {tot['load_model'] / tot['load_dcp']:.2f} | | | | |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2, help="repetitions per timed row (best is reported)")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    ap.add_argument("--pairs", default=None, help="comma-separated pairs A->B (default: every pair of the matrix)")
    ap.add_argument("--smoke", action="store_true", help="d2->t2 and t2->e2 on the test's tiny models, one "
                    "repetition: checks the script runs")
    ap.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    pairs = list(W.PAIRS)
    if args.smoke:
        args.reps, pairs = 1, ["d2->t2", "t2->e2"]
    if args.pairs:
        pairs = [x.strip() for x in args.pairs.split(",") if x.strip()]
    for pair in pairs:  # refused before the launch, naming the pair and the reason
        try:
            ParallelLayout.parse(pair.split("->")[0]), ParallelLayout.parse(pair.split("->")[1])
        except Exception as e:
            ap.error(f"--pairs: {pair!r} is not a pair A->B of layouts: {e}")
    root = Path(tempfile.mkdtemp(prefix="strategy_matrix_", dir=args.dir))
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        t0 = time.perf_counter()
        mp.start_processes(rank_main, args=(4, port, str(root), args.reps, pairs, args.smoke), nprocs=4,
                           start_method="spawn")
        rows = json.loads((root / "rows.json").read_text())
        text = table(rows)
        print(text)
        print(f"wall time of the launch: {time.perf_counter() - t0:.1f} s")
        if args.record and not args.smoke:
            cmd = "PYTHONPATH=src python benchmarks/strategy_matrix.py " + " ".join(
                argv if argv is not None else sys.argv[1:])
            from _results import write_section  # benchmarks/_results.py: this script's own section

            write_section(__file__, "strategy-conversion matrix",
                          f"### run {datetime.date.today()} (`{cmd.strip()}`)\n\n{text}\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
