"""Convert SmolLM2-135M (fp32 HF safetensors, 538 MB) to a TP=3 oarlock checkpoint with fused QKV and gate/up, and
back to HF, with ``oarlock convert``; side by side with the anchors of issue 5:

* ``cp`` of the same bytes (the model file, once per direction);
* a torch-only script that loads the full state dict, rearranges it (fuse/split QKV and gate/up, cut TP=3 shards)
  and saves it with ``safetensors.torch.save_file``; and the same script followed by an fsync of what it wrote
  (``torch-only+fsync``: the durability oarlock gives its files, issue 27's equal-durability row).

Every step runs in its own process (peak RSS from ``wait4``), with the page cache warm (the input is read once
before each step). Between steps, untimed, everything written is flushed to disk (``sync``) and the step's output
is removed, so no step runs while an earlier one's output is still being written back or while earlier outputs
fill the page cache. The TP=3 -> HF steps read TP=3 inputs made once before the timed runs by the same commands
as the HF -> TP=3 steps. The steps run in a new order in every repetition (rotated, and reversed in odd
repetitions). Each step reports the run with the shortest work time: its work time, process time and peak RSS
all come from that one run. Reports the ratios oarlock / anchor. The TP=3 -> HF outputs of the first repetition
are set aside (written back and dropped from the page cache) instead of removed, and checked at the end: each
round trip must reproduce every tensor of the original file exactly.

*Work* time starts at the same point for oarlock and the torch-only script: after ``import torch`` and
``safetensors.torch``; oarlock's own modules are imported inside it. It ends after the last write (and fsync,
where a step fsyncs).

The TP=3 -> HF step reads an oarlock checkpoint that records block checksums, which ``convert`` verifies first;
it is also timed with ``--no-verify`` so the table shows what verification costs. The machine's load average
is printed with the table.

Usage: ``.venv/bin/python benchmarks/convert_smollm2.py [--repeat 3] [--quick] [--tiny] [--append-results]``
(``--quick``: one run of each step, to check the script works; ``--tiny``: the same on a random 2-layer model
instead of SmolLM2, seconds long; figures from either mean nothing.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TORCH_ONLY = r"""
import sys, json, time, torch
from pathlib import Path
from safetensors.torch import load_file, save_file
T0 = time.perf_counter()
src, dst, direction = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
cfg = json.loads((Path(sys.argv[4])).read_text())
H, G, TP, L = cfg["num_attention_heads"], cfg["num_key_value_heads"], 3, cfg["num_hidden_layers"]
I = cfg["intermediate_size"]
COL = ("qkv_proj.weight", "gate_up_proj.weight", "embed_tokens.weight")
ROW = ("o_proj.weight", "down_proj.weight")
def order():
    r = H // G
    return [(n, i) for g in range(G) for n, i in [("q", g * r + j) for j in range(r)] + [("k", g), ("v", g)]]
dst.mkdir(parents=True, exist_ok=True)
if direction == "to_tp":
    sd = load_file(str(src / "model.safetensors"))
    out = {}
    for k, v in sd.items():
        k2 = k[len("model."):] if k.startswith("model.") else k
        if ".q_proj." in k or ".k_proj." in k or ".v_proj." in k or ".up_proj." in k:
            continue
        if ".gate_proj." in k:
            up = sd[k.replace("gate_proj", "up_proj")]
            w = I // TP  # TP-blocked fused_ffn layout: [gate_r | up_r] per rank
            v = torch.cat([t for r in range(TP) for t in (v[r * w:(r + 1) * w], up[r * w:(r + 1) * w])])
            k2 = k2.replace("gate_proj", "gate_up_proj")
        out[k2] = v
    for l in range(L):
        a = f"model.layers.{l}.self_attn."
        parts = {"q": sd[a + "q_proj.weight"].chunk(H), "k": sd[a + "k_proj.weight"].chunk(G),
                 "v": sd[a + "v_proj.weight"].chunk(G)}
        out[f"layers.{l}.self_attn.qkv_proj.weight"] = torch.cat([parts[n][i] for n, i in order()])
    for r in range(TP):
        shard = {}
        for k, v in out.items():
            if k.endswith(COL):
                shard[k] = v.chunk(TP, 0)[r].clone()
            elif k.endswith(ROW):
                shard[k] = v.chunk(TP, 1)[r].contiguous()
            elif r == 0:
                shard[k] = v
        save_file(shard, str(dst / f"rank-{r:05d}.safetensors"))
else:
    shards = [load_file(str(src / f"rank-{r:05d}.safetensors")) for r in range(TP)]
    full = {}
    for k in shards[0]:
        if k.endswith(COL):
            full[k] = torch.cat([s[k] for s in shards], 0)
        elif k.endswith(ROW):
            full[k] = torch.cat([s[k] for s in shards], 1)
        else:
            full[k] = shards[0][k]
    del shards
    hf = {}
    for k, v in full.items():
        if k.endswith("qkv_proj.weight"):
            pieces = v.chunk(H + 2 * G)
            got = {"q": {}, "k": {}, "v": {}}
            for p, (n, i) in zip(pieces, order()):
                got[n][i] = p
            base = "model." + k[: -len("qkv_proj.weight")]
            for n in "qkv":
                hf[base + f"{n}_proj.weight"] = torch.cat([got[n][i] for i in sorted(got[n])])
        elif k.endswith("gate_up_proj.weight"):
            blocks = v.chunk(2 * TP)
            base = "model." + k[: -len("gate_up_proj.weight")]
            hf[base + "gate_proj.weight"] = torch.cat(blocks[0::2])
            hf[base + "up_proj.weight"] = torch.cat(blocks[1::2])
        else:
            hf["model." + k] = v
    save_file(hf, str(dst / "model.safetensors"), metadata={"format": "pt"})
if len(sys.argv) > 5 and sys.argv[5] == "fsync":  # the equal-durability variant: what oarlock does at commit
    import os
    for f in [*sorted(dst.glob("*.safetensors")), dst]:  # the files, then the directory's entries
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
print(f"WORK {time.perf_counter() - T0}")
"""

# the clock starts after the imports the torch-only script makes before its own clock (torch, safetensors.torch);
# oarlock's own modules are imported inside the timed region, since the script has nothing more to import (issue 48
# item 4: leaving them out hid about 0.1 s of what `oarlock convert` costs beyond a plain script)
OARLOCK = r"""
import sys, time, torch
from safetensors.torch import load_file, save_file
T0 = time.perf_counter()
from oarlock.cli import main
import oarlock.checkpoint.aoa, oarlock.checkpoint.convert  # noqa: F401
rc = main(sys.argv[1:])
print(f"WORK {time.perf_counter() - T0}")
sys.exit(rc)
"""

PREPARE = r"""
import json, sys
from pathlib import Path
from oarlock.models.llama import LlamaConfig, hf_aoa_config
if sys.argv[3] == "tiny":  # the demo's random 2-layer Llama (6/3 heads, MLP 96): divisible by TP=3 like SmolLM2
    from oarlock.models.demo import _tiny_hf_dir
    hf = _tiny_hf_dir(Path(sys.argv[1]), 0)
else:
    from oarlock.models.smollm2 import ensure_hf_checkpoint
    hf = ensure_hf_checkpoint(sys.argv[1])
config = LlamaConfig.from_hf(json.loads((hf / "config.json").read_text()))
# the tied lm_head is absent from save_pretrained's file: drop the statement that removes it
statements = [s for s in hf_aoa_config(config) if not s.startswith("lm_head")]
open(sys.argv[2], "w").write(json.dumps({"aoa_statements": statements}))
print(hf)
"""


def run(cmd: list[str], env: dict | None = None) -> tuple[float, float, float]:
    """Process wall seconds, work seconds (what the child reports after its imports; the wall time for ``cp``)
    and peak RSS (MiB, from ``wait4``) of one command in its own process. This parent never imports torch, so the
    forked child's memory before ``exec`` does not inflate the figure."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t = time.perf_counter()
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=err)
        _, status, ru = os.wait4(p.pid, 0)
        dt = time.perf_counter() - t
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if p.returncode != 0:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{err.read().decode()[-2000:]}")
        work = [float(ln.split()[1]) for ln in out.read().decode().splitlines() if ln.startswith("WORK ")]
    return dt, work[0] if work else dt, ru.ru_maxrss / 1024


def warm(path: Path) -> None:
    for f in sorted(path.glob("*.safetensors")) if path.is_dir() else [path]:
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def settle(out: Path) -> None:
    """Untimed, between steps: flush every dirty page (the step's output included) to disk, then remove the
    output and flush again, so the next step neither competes with write-back nor finds the cache filled."""
    os.sync()
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    os.sync()


def evict(d: Path) -> None:
    """Drop the (written back, so clean) pages of every file under ``d`` from the page cache."""
    for f in d.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def step_order(names: list[str], rep: int, reps: int) -> list[str]:
    """Repetition ``rep``'s order: rotated by ``rep / reps`` of the list, reversed in odd repetitions (so no step
    always runs first, nor always right after the same other step)."""
    k = rep * len(names) // max(reps, 1) % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if rep % 2 else order


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per step; the one with the shortest work counts")
    ap.add_argument("--cache", default=str(REPO / ".cache" / "tests"), help="where the HF conversion is cached")
    ap.add_argument("--append-results", action="store_true", help="append the table to benchmarks/RESULTS.md")
    ap.add_argument("--quick", action="store_true", help="one run per step (checks the script works)")
    ap.add_argument("--tiny", action="store_true", help="a random 2-layer model, one run per step: a smoke run")
    args = ap.parse_args(argv)
    load_start = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"Load average (1/5/15 min) at the start of the run: {load_start}", flush=True)
    if args.quick or args.tiny:
        args.repeat = 1

    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OARLOCK_PROGRESS="0")
    py = sys.executable
    work = Path(tempfile.mkdtemp(prefix="oarlock-bench-convert-"))
    try:
        aoa = work / "llama.json"
        prep = work / "prepare.py"
        prep.write_text(PREPARE)
        cache = str(work / "tiny") if args.tiny else args.cache
        hf = Path(subprocess.run([py, str(prep), cache, str(aoa), "tiny" if args.tiny else "smollm2"], env=env,
                                 check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        model_bytes = (hf / "model.safetensors").stat().st_size
        (work / "torch_only.py").write_text(TORCH_ONLY)
        (work / "oarlock_cli.py").write_text(OARLOCK)
        cli = [py, str(work / "oarlock_cli.py"), "convert"]
        torch_only = [py, str(work / "torch_only.py")]
        cfg = str(hf / "config.json")
        model = str(hf / "model.safetensors")
        in_tp3, in_t_tp3 = work / "in_tp3", work / "in_t_tp3"
        out = work / "out"  # every step's output, removed after the step
        # name: (input read before the step, command, whether its output is an HF directory to check)
        steps = {
            "cp": (hf / "model.safetensors", ["cp", model, str(out)], False),
            # oarlock makes what it writes durable before it commits: the same for cp
            "cp + fsync": (hf / "model.safetensors", ["sh", "-c", 'cp "$0" "$1" && sync "$1"', model, str(out)],
                           False),
            "oarlock HF -> TP=3": (hf, cli + [str(hf), str(out), "--aoa", str(aoa), "--tp", "3"], False),
            "oarlock TP=3 -> HF": (in_tp3, cli + [str(in_tp3), str(out), "--aoa", str(aoa), "--reverse"], True),
            "oarlock TP=3 -> HF no-verify": (in_tp3, cli + [str(in_tp3), str(out), "--aoa", str(aoa), "--reverse",
                                                            "--no-verify"], True),
            "torch-only HF -> TP=3": (hf, torch_only + [str(hf), str(out), "to_tp", cfg], False),
            "torch-only TP=3 -> HF": (in_t_tp3, torch_only + [str(in_t_tp3), str(out), "to_hf", cfg], True),
            # equal durability: the same script, then an fsync of every file it wrote and of its directory
            "torch-only+fsync HF -> TP=3": (hf, torch_only + [str(hf), str(out), "to_tp", cfg, "fsync"], False),
            "torch-only+fsync TP=3 -> HF": (in_t_tp3, torch_only + [str(in_t_tp3), str(out), "to_hf", cfg, "fsync"],
                                            True),
        }
        # the TP=3 inputs of the reverse steps, untimed, by the commands the forward steps time
        for cmd in (cli + [str(hf), str(in_tp3), "--aoa", str(aoa), "--tp", "3"],
                    torch_only + [str(hf), str(in_t_tp3), "to_tp", cfg]):
            run(cmd, env)
        check = work / "check.py"  # each directory given reproduces every original tensor
        check.write_text("import sys, torch\nfrom pathlib import Path\nfrom safetensors.torch import load_file\n"
                         "ref = load_file(sys.argv[1])\n"
                         "for d in sys.argv[2:]:\n"
                         "    got = {}\n"
                         "    for f in sorted(Path(d).glob('*.safetensors')): got.update(load_file(str(f)))\n"
                         "    assert set(got) == set(ref), (d, sorted(set(got) ^ set(ref))[:5])\n"
                         "    bad = [k for k in ref if not torch.equal(got[k], ref[k])]\n"
                         "    assert not bad, f'{d}: {len(bad)} tensors differ from the original, e.g. {bad[:3]}'\n")
        runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in steps}
        kept = work / "kept"  # the first run's HF outputs, checked at the end
        kept.mkdir()
        settle(out)
        for r in range(args.repeat):
            for name in step_order(list(steps), r, args.repeat):
                inp, cmd, is_hf = steps[name]
                warm(inp)
                dt, wk, rss = run(cmd, env)
                runs[name].append((dt, wk, rss))
                print(f"{name:<28} process {dt:7.2f} s  work {wk:7.2f} s  peak RSS {rss:7.0f} MiB", flush=True)
                if is_hf and r == 0:  # kept for the check (untimed), out of the page cache the later steps use
                    os.sync()
                    os.replace(out, kept / name.replace(" ", "_"))
                    evict(kept / name.replace(" ", "_"))
                settle(out)
        # every round trip reproduces the original
        subprocess.run([py, str(check), model, *(str(d) for d in sorted(kept.iterdir()))], env=env, check=True)
        checked = [name for name, (_, _, is_hf) in steps.items() if is_hf]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # per step, the run with the shortest work time: its process time and peak RSS too (one run's figures)
    best = {name: min(rs, key=lambda x: x[1]) for name, rs in runs.items()}
    print(f"round trips equal to the original: {', '.join(checked)}")

    cp_t = best["cp"][1]
    cps_t = best["cp + fsync"][1]
    mib = model_bytes / 2**20
    rows = []
    for d in ("HF -> TP=3", "TP=3 -> HF"):
        o_p, o_w, o_rss = best[f"oarlock {d}"]
        t_p, t_w, t_rss = best[f"torch-only {d}"]
        tf_w = best[f"torch-only+fsync {d}"][1]
        rows.append(f"| {d} | {o_w:.2f} | {o_p:.2f} | {o_rss:.0f} | {o_w / cp_t:.2f} | {o_w / cps_t:.2f} | "
                    f"{t_w:.2f} | {t_p:.2f} | {t_rss:.0f} | {o_w / t_w:.2f} | {tf_w:.2f} | {o_w / tf_w:.2f} | "
                    f"{o_rss / t_rss:.2f} | {o_rss / mib:.2f} |")
    nv = best["oarlock TP=3 -> HF no-verify"][1]
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    table = "\n".join([
        f"Load average (1/5/15 min) at the start of the run: {load_start}, at the end: {load} on {os.cpu_count()} "
        "cores. Checksum verification "
        f"of the TP=3 source: {best['oarlock TP=3 -> HF'][1]:.2f} s with, {nv:.2f} s without "
        f"({best['oarlock TP=3 -> HF'][1] / nv:.2f}x).",
        "",
        f"Model file {mib:.0f} MiB (fp32); `cp` of it: {cp_t:.2f} s, `cp` then `sync` of the copy: {cps_t:.2f} s. "
        f"Best of {args.repeat} runs (each step's figures from its run with the shortest work time), steps in a "
        "rotating order, page cache warm, everything flushed to disk and the step's output removed between steps, "
        "each step in its own process. *work* = time after `import torch` and `safetensors.torch` (oarlock's own "
        "modules are imported inside it, the script has nothing more to import), *process* = whole "
        "process including interpreter start and `import torch`; peak RSS includes the Python + torch runtime. "
        "oarlock fsyncs every file it writes, cp does not; *torch-only+fsync* is the torch-only script followed by "
        "an fsync of every file it wrote and of its directory (the same durability as oarlock's).",
        "",
        "| direction | oarlock work s | oarlock process s | oarlock peak RSS MiB | oarlock work / cp "
        "| oarlock work / (cp + fsync) | torch-only work s "
        "| torch-only process s | torch-only peak RSS MiB | oarlock / torch-only (work) | torch-only+fsync work s "
        "| oarlock / torch-only+fsync (work) | oarlock / torch-only (RSS) | oarlock RSS / model size |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ])
    print(table)
    if args.append_results and not args.tiny:
        from _results import write_section  # benchmarks/_results.py: this script's own section

        write_section(__file__, "oarlock convert SmolLM2-135M HF <-> TP=3 with fused QKV and gate/up", ""
                    f"Command: `.venv/bin/python benchmarks/convert_smollm2.py --repeat {args.repeat} "
                    "--append-results`.\n\n"
                    + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
