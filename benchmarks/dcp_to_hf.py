"""DCP -> HuggingFace conversion of an FSDP2 checkpoint: oarlock vs the DCP-native route, time and peak RSS.

Workload: a Llama model (HF ``LlamaForCausalLM`` key names; hidden 1024, 12 layers, MLP 4096, vocab 42000,
untied: 268.5 M parameters, 1.00 GiB fp32) sharded with FSDP2 (``fully_shard``) on 4 gloo CPU ranks and saved with
``dcp.save`` of ``get_model_state_dict`` (default ``torch.save`` serialisation), written once into ``--dir`` and
reused.

Routes, each in a fresh process (peak RSS = that process's ``ru_maxrss``; time = wall clock of the conversion,
imports excluded), in the same run:

* ``oarlock``: ``oarlock.checkpoint.convert.export_hf(DCP, OUT)`` (``oarlock convert DCP OUT --to hf``): each
  output tensor is assembled from the byte ranges of its chunks and streamed into ``model.safetensors``.
* ``dcp``: the DCP-native route (as torchtitan's conversion script does): ``dcp`` loads every key into a full
  state dict in memory (``_load_state_dict_from_keys``), then ``safetensors.torch.save_file``.

The routes alternate: repetition ``r`` runs oarlock first when ``r`` is even, DCP first when it is odd (so, with
the default 2 repetitions, each route goes first once); before every run, untimed, the machine's dirty pages are
flushed (``sync``), so no run competes with the write-back of the previous one's output. Each route reports its
fastest run (time and peak RSS from that run). Both outputs are checked to hold identical tensors. Goal
(issue 16): oarlock faster, with peak RSS below a quarter of the model size. ``--quick`` uses a 40 MiB model (a
check that the script works, not a measurement).

Usage: python benchmarks/dcp_to_hf.py [--dir DIR] [--quick] [--reps N] (``--reps`` default 2)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

FULL = dict(vocab_size=42000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=12,
            num_attention_heads=16, num_key_value_heads=4)
QUICK = dict(vocab_size=8000, hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
             num_attention_heads=4, num_key_value_heads=2)
WORLD = 4


def _config(shape: dict):
    from transformers import LlamaConfig

    return LlamaConfig(max_position_embeddings=128, tie_word_embeddings=False, **shape)


def _write_rank(rank: int, world: int, port: int, out: str, shape: dict) -> None:
    """One FSDP2 rank: the model is built on the meta device, sharded, then only the local shards are
    materialised (so no rank ever holds the whole model) and filled with seeded values."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = LlamaForCausalLM(_config(shape))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(generator=g)
    dcp.save(get_model_state_dict(model), checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


def ensure_checkpoint(root: Path, shape: dict) -> Path:
    tag = "quick" if shape is QUICK else "full1g"
    out = root / f"fsdp2_{tag}"
    if (out / ".metadata").is_file():
        return out
    import torch.multiprocessing as mp

    tmp = root / f".fsdp2_{tag}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_write_rank, args=(WORLD, port, str(tmp), shape), nprocs=WORLD, start_method="spawn",
                       join=True)
    os.replace(tmp, out)
    return out


# ---------------------------------------------------------------- the two routes (run in child processes)

def route_oarlock(src: str, out: str) -> float:
    from oarlock.checkpoint.convert import export_hf

    t = time.perf_counter()
    export_hf(src, out, show_progress=False)
    return time.perf_counter() - t


def route_dcp(src: str, out: str) -> float:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    warnings.filterwarnings("ignore")
    t = time.perf_counter()
    sd = _load_state_dict_from_keys(checkpoint_id=src)
    os.makedirs(out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(out, "model.safetensors"))
    return time.perf_counter() - t


def _child(route: str, src: str, out: str) -> None:
    fn = {"oarlock": route_oarlock, "dcp": route_dcp}[route]
    # the route's imports first: the peak RSS they alone cause (Python + torch runtime) is the floor that no
    # conversion can go below; what a route adds above it is its working memory
    mods = (["oarlock.checkpoint.convert"] if route == "oarlock" else
            ["safetensors.torch", "torch.distributed.checkpoint.state_dict_loader"])
    for m in mods:
        importlib.import_module(m)
    floor = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = fn(src, out)
    print(json.dumps({"seconds": seconds, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "floor_rss": floor}))


def run_route(route: str, src: Path, out: Path) -> dict:
    """One conversion by ``route`` in a fresh process, after removing its previous output and flushing every dirty
    page to disk (untimed)."""
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    r = subprocess.run([sys.executable, __file__, "--child", route, str(src), str(out)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{route} route failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def same_tensors(a: Path, b: Path) -> bool:
    from safetensors import safe_open

    fa = sorted(a.glob("*.safetensors"))
    with safe_open(str(b / "model.safetensors"), "pt") as g:
        keys_b = set(g.keys())
        keys_a: set[str] = set()
        for f in fa:
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    keys_a.add(k)
                    if not torch.equal(h.get_tensor(k), g.get_tensor(k)):
                        return False
    return keys_a == keys_b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=None, help="where the FSDP2 checkpoint is written once and kept")
    ap.add_argument("--quick", action="store_true", help="40 MiB model: checks that the script works")
    ap.add_argument("--reps", type=int, default=2, help="repetitions per route, the routes alternating first "
                    "(the fastest is reported)")
    ap.add_argument("--child", nargs=3, metavar=("ROUTE", "SRC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(*args.child)
        return
    shape = QUICK if args.quick else FULL
    root = args.dir or Path(tempfile.gettempdir()) / "oarlock-bench-dcp-to-hf"
    root.mkdir(parents=True, exist_ok=True)
    src = ensure_checkpoint(root, shape)
    size = sum(p.stat().st_size for p in src.glob("*.distcp"))
    routes = ("oarlock", "dcp")
    runs: dict[str, list[dict]] = {route: [] for route in routes}
    for rep in range(args.reps):
        for route in routes if rep % 2 == 0 else routes[::-1]:  # neither route always goes first
            runs[route].append(run_route(route, src, root / f"out_{route}"))
    results = {route: min(rs, key=lambda r: r["seconds"]) | {"peak_rss_all": [r["peak_rss"] for r in rs]}
               for route, rs in runs.items()}
    assert same_tensors(root / "out_oarlock", root / "out_dcp"), "the two routes wrote different tensors"
    gib = 1024 ** 3
    print(f"DCP -> HF, FSDP2 checkpoint of {size / gib:.2f} GiB on {WORLD} ranks ({os.cpu_count()} CPUs)")
    print(f"{'route':10s} {'time s':>8s} {'peak RSS GiB':>13s} {'RSS / model':>12s} {'import floor MiB':>17s} "
          f"{'above floor MiB':>16s}")
    for route, r in results.items():
        print(f"{route:10s} {r['seconds']:8.2f} {r['peak_rss'] / gib:13.2f} {r['peak_rss'] / size:12.2f} "
              f"{r['floor_rss'] / 2**20:17.0f} {(r['peak_rss'] - r['floor_rss']) / 2**20:16.0f}")
    o, d = results["oarlock"], results["dcp"]
    print(f"oarlock / dcp: time x{o['seconds'] / d['seconds']:.2f}, peak RSS x{o['peak_rss'] / d['peak_rss']:.2f}")
    print("every run (s), in order of repetition: " + "; ".join(
        f"{route} " + ", ".join(f"{r['seconds']:.2f}" for r in rs) for route, rs in runs.items()))
    print(f"load average: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(json.dumps({"model_bytes": size, **{k: {"seconds": v["seconds"], "peak_rss": v["peak_rss"],
                                                  "floor_rss": v["floor_rss"]}
                                              for k, v in results.items()}}))


if __name__ == "__main__":
    main()
