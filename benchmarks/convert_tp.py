"""``oarlock convert --tp 3`` against the plain torch script a user would write, at equal durability.

Workload: one Llama-shaped HF ``model.safetensors`` (fp32, about 540 MiB: vocabulary 32,000, hidden 1,024, MLP
2,816, 6 layers, untied ``lm_head``) split for tensor parallel degree 3 with Megatron's rules (q/k/v/gate/up and
the embeddings by rows, o/down by columns, norms whole).

* ``oarlock``: ``convert_checkpoint(src, dst, tp=3)`` (what ``oarlock convert SRC DST --tp 3`` runs).
* ``torch script``: ``safetensors.torch.load_file``, ``torch.chunk`` per rank along the same axes, one
  ``save_file`` per rank (the norms in rank 0's file only, as oarlock stores a replicated tensor once), then an
  ``fsync`` of every file written and of the directory: the durability oarlock gives its outputs.

Each run is its own process; the table reports the *work time* each measures after its imports (what the user
waits for beyond starting Python) and the process's wall time, both from the same run. The page cache holds the
input (read once before every run); before every run, untimed, the previous outputs are removed and ``sync`` has
written everything back, so no run pays for another's writeback. The order alternates between repetitions.
Reports the best and the median of ``--repeat`` runs and the ratio oarlock / torch script, with the load average.

Usage: ``.venv/bin/python benchmarks/convert_tp.py [--repeat 5] [--tiny]`` (``--tiny``: 2 small layers, seconds
long, checks that the script works; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import os, sys, time, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
T0 = time.perf_counter()
src, dst, tp = Path(sys.argv[1]), Path(sys.argv[2]), 3
ROWS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight",
        "embed_tokens.weight", "lm_head.weight")
COLS = ("o_proj.weight", "down_proj.weight")
sd = load_file(str(src / "model.safetensors"))
dst.mkdir(parents=True, exist_ok=True)
shards = [{} for _ in range(tp)]
for k, v in sd.items():
    axis = 0 if k.endswith(ROWS) else 1 if k.endswith(COLS) else None
    if axis is None:
        shards[0][k] = v
        continue
    for r, piece in enumerate(torch.chunk(v, tp, dim=axis)):
        shards[r][k] = piece.contiguous()
for r, d in enumerate(shards):
    f = dst / f"rank-{r:05d}.safetensors"
    save_file(d, str(f))
    fd = os.open(f, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
fd = os.open(dst, os.O_RDONLY)
os.fsync(fd)
os.close(fd)
print(time.perf_counter() - T0)
"""

OARLOCK = r"""
import sys, time
from oarlock.checkpoint import convert_checkpoint
T0 = time.perf_counter()
convert_checkpoint(sys.argv[1], sys.argv[2], tp=3, show_progress=False)
print(time.perf_counter() - T0)
"""


def make_model(d: Path, tiny: bool) -> int:
    """Write a random Llama-shaped ``model.safetensors`` and ``config.json`` into ``d``; returns its bytes."""
    import torch
    from safetensors.torch import save_file

    vocab, hidden, inter, layers = (3000, 96, 264, 2) if tiny else (32000, 1024, 2816, 6)
    heads, kv = (4, 2) if tiny else (16, 8)
    hd = hidden // heads
    g = torch.Generator().manual_seed(0)
    sd = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
          "model.norm.weight": torch.ones(hidden), "lm_head.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (heads * hd, hidden)), ("self_attn.k_proj", (kv * hd, hidden)),
                            ("self_attn.v_proj", (kv * hd, hidden)), ("self_attn.o_proj", (hidden, heads * hd)),
                            ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
                            ("mlp.down_proj", (hidden, inter))):
            sd[p + name + ".weight"] = torch.randn(*shape, generator=g)
        sd[p + "input_layernorm.weight"] = torch.ones(hidden)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    d.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "tie_word_embeddings": False}))
    return (d / "model.safetensors").stat().st_size


def run(code: str, src: Path, dst: Path) -> tuple[float, float]:
    """(work seconds measured by the script after its imports, process wall seconds)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, str(src), str(dst)], capture_output=True, text=True,
                         cwd=REPO)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1]), wall


def check_equal(src: Path, ours: Path) -> int:
    """Every stored shard of the oarlock conversion equals the source tensor's box (read with safetensors), and the
    shards of each key hold exactly its elements, split 3 ways where the rules split it; returns the keys checked.
    (The torch script's pieces are ``torch.chunk`` of the same tensors.)"""
    import torch
    from safetensors.torch import load_file

    from oarlock.checkpoint import open_checkpoint

    ref = load_file(str(src / "model.safetensors"))
    with open_checkpoint(ours) as reader:
        meta = reader.metadata
        for k, v in ref.items():
            t = meta.tensors[k[len("model."):]] if k not in meta.tensors else meta.tensors[k]
            covered = 0
            for sh in t.shards:
                box = tuple(slice(o, o + n) for o, n in zip(sh.global_offset, sh.local_shape))
                assert torch.equal(reader.read(t.key, sh), v[box]), (k, sh)
                covered += v[box].numel()
            assert covered == v.numel(), (k, covered)
    return len(ref)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="oarlock-convert-tp-"))
    try:
        src = scratch / "hf"
        nbytes = make_model(src, args.tiny)
        steps = {"oarlock": OARLOCK, "torch script": SCRIPT}
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in steps}
        for r in range(args.repeat):
            order = list(steps) if r % 2 == 0 else list(steps)[::-1]
            for name in order:
                out = scratch / name.replace(" ", "_")
                shutil.rmtree(out, ignore_errors=True)
                os.sync()  # untimed: no run pays for the previous one's writeback
                with open(src / "model.safetensors", "rb") as f:  # the input in the page cache for every run
                    while f.read(1 << 24):
                        pass
                times[name].append(run(steps[name], src, out))
        checked = check_equal(src, scratch / "oarlock")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [f"HF {nbytes / 2**20:.0f} MiB fp32 -> TP=3, every output fsynced; {args.repeat} runs each, alternating; "
             f"load average {load} on {os.cpu_count()} cores", "",
             "| step | work best s | work median s | process median s | every run (work) |", "|---|---:|---:|---:|---|"]
    for name, v in times.items():
        work = [w for w, _ in v]
        lines.append(f"| {name} | {min(work):.3f} | {statistics.median(work):.3f} | "
                     f"{statistics.median(p for _, p in v):.3f} | {' '.join(f'{w:.2f}' for w in work)} |")
    o, t = ([w for w, _ in times[k]] for k in ("oarlock", "torch script"))
    lines += ["", f"oarlock / torch script: work best {min(o) / min(t):.2f}, work median "
              f"{statistics.median(o) / statistics.median(t):.2f}, process median "
              f"{statistics.median(p for _, p in times['oarlock']) / statistics.median(p for _, p in times['torch script']):.2f}"
              f". The oarlock output was read back: all {checked} keys' shards equal the source boxes."]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
