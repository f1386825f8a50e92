"""Convert SmolLM2-135M (fp32 HF safetensors, 538 MB) to a TP=3 oarlock checkpoint with fused QKV and gate/up, and
back to HF, with ``oarlock convert``; side by side with the anchors of issue 5:

* ``cp`` of the same bytes (the model file, once per direction);
* a torch-only script that loads the full state dict, rearranges it (fuse/split QKV and gate/up, cut TP=3 shards)
  and saves it with ``safetensors.torch.save_file``; and the same script followed by an fsync of what it wrote
  (``torch-only+fsync``: the durability oarlock gives its files, issue 27's equal-durability row).

Every step runs in its own process (peak RSS from ``wait4``), with the page cache warm (the input is read once
before each step). Reports wall time and peak RSS per step and the ratios oarlock / anchor.

The TP=3 -> HF step reads an oarlock checkpoint that records block checksums, which ``convert`` verifies first;
it is also timed with ``--no-verify`` so the table shows what verification costs. The machine's load average
is printed with the table.

Usage: ``.venv/bin/python benchmarks/convert_smollm2.py [--repeat 3] [--quick] [--append-results]``
(``--quick``: one run of each step, to check the script works; figures from a busy machine mean nothing.)
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

OARLOCK = r"""
import sys, time
from oarlock.cli import main
import oarlock.checkpoint.aoa, oarlock.checkpoint.convert  # noqa: F401  (imports, torch included, are not work)
T0 = time.perf_counter()
rc = main(sys.argv[1:])
print(f"WORK {time.perf_counter() - T0}")
sys.exit(rc)
"""

PREPARE = r"""
import json, sys
from oarlock.models.llama import LlamaConfig, hf_aoa_config
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per step; the fastest is reported")
    ap.add_argument("--cache", default=str(REPO / ".cache" / "tests"), help="where the HF conversion is cached")
    ap.add_argument("--append-results", action="store_true", help="append the table to benchmarks/RESULTS.md")
    ap.add_argument("--quick", action="store_true", help="one run per step (checks the script works)")
    args = ap.parse_args()
    if args.quick:
        args.repeat = 1

    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OARLOCK_PROGRESS="0")
    py = sys.executable
    work = Path(tempfile.mkdtemp(prefix="oarlock-bench-convert-"))
    try:
        aoa = work / "llama.json"
        prep = work / "prepare.py"
        prep.write_text(PREPARE)
        hf = Path(subprocess.run([py, str(prep), args.cache, str(aoa)], env=env, check=True, capture_output=True,
                                 text=True).stdout.strip().splitlines()[-1])
        model_bytes = (hf / "model.safetensors").stat().st_size
        (work / "torch_only.py").write_text(TORCH_ONLY)
        (work / "oarlock_cli.py").write_text(OARLOCK)
        cli = [py, str(work / "oarlock_cli.py"), "convert"]
        torch_only = [py, str(work / "torch_only.py")]
        steps = {
            "cp": (hf / "model.safetensors", ["cp", str(hf / "model.safetensors"), str(work / "cp.st")]),
            # oarlock makes what it writes durable before it commits: the same for cp
            "cp + fsync": (hf / "model.safetensors", ["sh", "-c", 'cp "$0" "$1" && sync "$1"',
                                                      str(hf / "model.safetensors"), str(work / "cps.st")]),
            "oarlock HF -> TP=3": (hf, cli + [str(hf), str(work / "tp3"), "--aoa", str(aoa), "--tp", "3"]),
            "oarlock TP=3 -> HF": (work / "tp3", cli + [str(work / "tp3"), str(work / "back"), "--aoa", str(aoa),
                                                        "--reverse"]),
            "oarlock TP=3 -> HF no-verify": (work / "tp3", cli + [str(work / "tp3"), str(work / "back_nv"), "--aoa",
                                                                  str(aoa), "--reverse", "--no-verify"]),
            "torch-only HF -> TP=3": (hf, torch_only + [str(hf), str(work / "t_tp3"), "to_tp",
                                                        str(hf / "config.json")]),
            "torch-only TP=3 -> HF": (work / "t_tp3", torch_only + [str(work / "t_tp3"), str(work / "t_back"),
                                                                    "to_hf", str(hf / "config.json")]),
            # equal durability: the same script, then an fsync of every file it wrote and of its directory
            "torch-only+fsync HF -> TP=3": (hf, torch_only + [str(hf), str(work / "tf_tp3"), "to_tp",
                                                              str(hf / "config.json"), "fsync"]),
            "torch-only+fsync TP=3 -> HF": (work / "t_tp3", torch_only + [str(work / "t_tp3"), str(work / "tf_back"),
                                                                          "to_hf", str(hf / "config.json"), "fsync"]),
        }
        best: dict[str, list[float]] = {}
        for _ in range(args.repeat):
            for name, (inp, cmd) in steps.items():
                warm(inp)
                dt, wk, rss = run(cmd, env)
                old = best.get(name)
                best[name] = [min(dt, old[0]), min(wk, old[1]), max(rss, old[2])] if old else [dt, wk, rss]
                print(f"{name:<24} process {dt:7.2f} s  work {wk:7.2f} s  peak RSS {rss:7.0f} MiB", flush=True)
        check = work / "check.py"  # both round trips reproduce every original tensor
        check.write_text("import sys, torch\nfrom pathlib import Path\nfrom safetensors.torch import load_file\n"
                         "ref = load_file(sys.argv[1])\n"
                         "for d in sys.argv[2:]:\n"
                         "    got = {}\n"
                         "    for f in sorted(Path(d).glob('*.safetensors')): got.update(load_file(str(f)))\n"
                         "    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref), d\n")
        subprocess.run([py, str(check), str(hf / "model.safetensors"), str(work / "back"), str(work / "t_back"),
                        str(work / "tf_back")], check=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

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
        f"Load average (1/5/15 min) at the end of the run: {load} on {os.cpu_count()} cores. Checksum verification "
        f"of the TP=3 source: {best['oarlock TP=3 -> HF'][1]:.2f} s with, {nv:.2f} s without "
        f"({best['oarlock TP=3 -> HF'][1] / nv:.2f}x).",
        "",
        f"Model file {mib:.0f} MiB (fp32); `cp` of it: {cp_t:.2f} s, `cp` then `sync` of the copy: {cps_t:.2f} s. "
        f"Best of {args.repeat} runs, page cache warm, "
        "each step in its own process. *work* = time after imports (the conversion itself), *process* = whole "
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
    if args.append_results:
        with open(REPO / "benchmarks" / "RESULTS.md", "a") as f:
            f.write("\n## checkpoint: `oarlock convert` SmolLM2-135M HF <-> TP=3 with fused QKV and gate/up (issues 5, 17, 27)\n\n"
                    f"Command: `.venv/bin/python benchmarks/convert_smollm2.py --repeat {args.repeat} "
                    "--append-results`.\n\n"
                    + table + "\n")


if __name__ == "__main__":
    main()
