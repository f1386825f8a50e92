"""``oarlock convert --tp 3`` against the plain torch script a user would write, at equal durability, with and
without equal checksum work.

Workload: one Llama-shaped HF ``model.safetensors`` (fp32, about 540 MiB: vocabulary 32,000, hidden 1,024, MLP
2,816, 6 layers, untied ``lm_head``) split for tensor parallel degree 3 with
Megatron's rules (q/k/v/gate/up and the embeddings by rows, o/down by columns, norms whole).

Steps, every one fsyncing every file it writes and its directory:

* ``oarlock``: ``convert_checkpoint(src, dst, tp=3)`` (what ``oarlock convert SRC DST --tp 3`` runs). It also
  records block checksums of every output file (xxh3_64 per 4 MiB block; bytes it copied in the kernel are read
  back from the file to be hashed) and writes them beside the files: work the plain script does not do.
* ``oarlock, no checksums``: the same call with the checksum recording switched off by a patch in this benchmark
  only (no option does it: a checkpoint without checksums is not what oarlock writes); its output is checked to
  load bit-exact too. With ``torch script`` it gives the figure at equal work without checksums.
* ``torch script``: ``safetensors.torch.load_file``, ``torch.chunk`` per rank along the same axes, one
  ``save_file`` per rank (the norms in one file only, as oarlock stores a replicated tensor once), then an
  ``fsync`` of every file written and of the directory: the durability oarlock gives its outputs.
* ``torch script + checksums``: the script, then the same checksums as oarlock's (each output file read back in
  4 MiB blocks, xxh3_64 each, the digests written as one JSON file per output file, fsynced). With ``oarlock`` it
  gives the figure at equal work with checksums.

Each run is its own process; the table reports the *work time* each measures, the CPU time of the same region
(user + system, all threads: steadier than wall time on a loaded machine) and the process's wall time, all from
the same run. Every step's clock starts at the same point, after ``import torch`` and ``safetensors.torch``
(the script's imports): oarlock's own modules (about 0.1 s on the project machine, plus the modules its first
conversion imports) are inside its work time, since the script has nothing more to import; the clock stops after
the last fsync. The page cache holds the input (read once
before every run); before every run, untimed, the previous outputs are removed and ``sync`` has written
everything back, so no run pays for another's writeback. The order of the steps rotates by one per repetition.
Reports per step the best, median and min-max of ``--repeat`` runs, and for the three pairings the ratio of work
medians (with the per-repetition min-max), of the best runs and of the CPU medians, with the load average at the
start and the end. ``--runs N`` repeats everything in N rounds (each with a fresh input file) and summarises the
ratios of medians over rounds.

Usage: ``.venv/bin/python benchmarks/convert_tp.py [--repeat 5] [--runs 3] [--tiny]`` (``--tiny``: 2 small
layers, seconds long, checks that the script works; its figures mean nothing).
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
T0, C0 = time.perf_counter(), time.process_time()
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
print(time.perf_counter() - T0, time.process_time() - C0)
"""

# the script's checksums: what oarlock records for a file it wrote (xxh3_64 of every 4 MiB block, the bytes read
# back from the file), written as a JSON file beside it and fsynced
CHECKSUMS = r"""
import json, xxhash
def record_checksums(f, block=4 << 20):
    digests = []
    with open(f, "rb", buffering=0) as fh:
        buf = bytearray(block)
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            digests.append(xxhash.xxh3_64_hexdigest(memoryview(buf)[:n]))
    out = f.with_name(f.name + ".xxh3.json")
    with open(out, "w") as fh:
        json.dump({"algorithm": "xxh3_64", "block_size": block, "blocks": digests}, fh)
        fh.flush()
        os.fsync(fh.fileno())
"""

SCRIPT_CHECKSUMS = SCRIPT.replace("T0, C0 =", CHECKSUMS + "T0, C0 =").replace(
    "    save_file(d, str(f))\n", "    save_file(d, str(f))\n    record_checksums(f)\n")
assert SCRIPT_CHECKSUMS.count("record_checksums(f)") == 1

# every step's clock starts after the same imports (torch and safetensors.torch, what the script needs): oarlock's
# own modules are imported inside its timed region, as the script has nothing more to import
OARLOCK = r"""
import sys, time, torch
from safetensors.torch import load_file, save_file
T0, C0 = time.perf_counter(), time.process_time()
from oarlock.checkpoint import convert_checkpoint
convert_checkpoint(sys.argv[1], sys.argv[2], tp=3, show_progress=False)
print(time.perf_counter() - T0, time.process_time() - C0)
"""

# the same call with the checksum recording off: the writers get no hasher, no digests files are written and the
# metadata records none (loads of the output then verify nothing); a patch of this benchmark only
OARLOCK_NO_CHECKSUMS = r"""
import sys, time, torch
from safetensors.torch import load_file, save_file
T0, C0 = time.perf_counter(), time.process_time()
from oarlock.checkpoint import convert_checkpoint
import oarlock.checkpoint.convert.export as export
export.BlockHasher = lambda: None
export.write_digests = lambda directory, file, record: None
export.make_record = lambda files: None
meta = convert_checkpoint(sys.argv[1], sys.argv[2], tp=3, show_progress=False)
print(time.perf_counter() - T0, time.process_time() - C0)
"""

STEPS = {"oarlock": OARLOCK, "oarlock, no checksums": OARLOCK_NO_CHECKSUMS, "torch script": SCRIPT,
         "torch script + checksums": SCRIPT_CHECKSUMS}
# (label, oarlock step, script step): the figures this benchmark publishes
PAIRS = (("oarlock (checksums) / torch script (none): as shipped, unequal work", "oarlock", "torch script"),
         ("oarlock / torch script + checksums: equal work, with checksums", "oarlock", "torch script + checksums"),
         ("oarlock no checksums / torch script: equal work, without checksums", "oarlock, no checksums",
          "torch script"))


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


def run(code: str, src: Path, dst: Path) -> tuple[float, float, float]:
    """(work seconds measured by the script after its imports, process wall seconds, CPU seconds of the work: user
    + system time of all the process's threads over the same region, less sensitive to a loaded machine)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, str(src), str(dst)], capture_output=True, text=True,
                         cwd=REPO)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    work, cpu = (float(x) for x in out.stdout.strip().splitlines()[-1].split())
    return work, wall, cpu


def check_equal(src: Path, ours: Path) -> int:
    """Every stored shard of an oarlock conversion equals the source tensor's box (read with safetensors), and the
    shards of each key hold exactly its elements, split 3 ways where the rules split it; returns the keys checked.
    (The torch script's pieces are ``torch.chunk`` of the same tensors.)

    Raises:
        AssertionError: a shard differs or a key is not covered exactly (the benchmark then exits non-zero)."""
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


def check_script(src: Path, out: Path, with_checksums: bool) -> None:
    """The torch script's rank files hold ``torch.chunk`` of every source tensor (read back with safetensors), and
    with checksums, a digests file per rank file whose blocks match the file.

    Raises:
        AssertionError: they do not."""
    import torch
    import xxhash
    from safetensors.torch import load_file

    ref = load_file(str(src / "model.safetensors"))
    ranks = [load_file(str(out / f"rank-{r:05d}.safetensors")) for r in range(3)]
    for k, v in ref.items():
        pieces = [rk[k] for rk in ranks if k in rk]
        whole = pieces[0] if len(pieces) == 1 else torch.cat(pieces, 1 if k.endswith(("o_proj.weight",
                                                                                     "down_proj.weight")) else 0)
        assert torch.equal(whole, v), k
    if with_checksums:
        for r in range(3):
            f = out / f"rank-{r:05d}.safetensors"
            rec = json.loads((out / (f.name + ".xxh3.json")).read_text())
            data = f.read_bytes()
            blk = rec["block_size"]
            assert rec["blocks"] == [xxhash.xxh3_64_hexdigest(data[i:i + blk]) for i in range(0, len(data), blk)]


def one_round(scratch: Path, tiny: bool, repeat: int) -> tuple[int, dict[str, list[tuple[float, ...]]], int]:
    """Make the input, run every step ``repeat`` times in a rotated order, check every step's last output; returns
    (input bytes, step -> [(work s, process s, work CPU s)], keys checked)."""
    src = scratch / "hf"
    shutil.rmtree(src, ignore_errors=True)
    nbytes = make_model(src, tiny)
    times: dict[str, list[tuple[float, ...]]] = {k: [] for k in STEPS}
    names = list(STEPS)
    for r in range(repeat):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out = scratch / name.replace(" ", "_").replace(",", "").replace("+", "plus")
            shutil.rmtree(out, ignore_errors=True)
            os.sync()  # untimed: no run pays for the previous one's writeback
            with open(src / "model.safetensors", "rb") as f:  # the input in the page cache for every run
                while f.read(1 << 24):
                    pass
            times[name].append(run(STEPS[name], src, out))
    checked = 0
    for name in STEPS:
        out = scratch / name.replace(" ", "_").replace(",", "").replace("+", "plus")
        if name.startswith("oarlock"):
            checked = check_equal(src, out)
            if name == "oarlock":
                # the shipped conversion records checksums (the patched one must not, or it measured nothing)
                assert "checksums" in json.loads((out / "metadata.json").read_text()).get("extra", {}), name
            else:
                assert not (json.loads((out / "metadata.json").read_text()).get("extra") or {}).get("checksums"), name
        else:
            check_script(src, out, name.endswith("checksums"))
    return nbytes, times, checked


def _ratio(times: dict, a: str, b: str) -> tuple[float, float, float]:
    """Ratio of the work medians a / b, and the min-max of the per-repetition ratios."""
    wa, wb = ([x[0] for x in times[k]] for k in (a, b))
    each = [x / y for x, y in zip(wa, wb)]
    return statistics.median(wa) / statistics.median(wb), min(each), max(each)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="runs of every step per round (rotated order)")
    ap.add_argument("--runs", type=int, default=1, help="rounds, each with a fresh input file; the summary gives "
                    "the ratios of medians over rounds")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    load0 = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average at the start: {load0} on {os.cpu_count()} cores", flush=True)
    rounds = []
    for rnd in range(args.runs):
        scratch = Path(tempfile.mkdtemp(prefix="oarlock-convert-tp-"))
        try:
            nbytes, times, checked = one_round(scratch, args.tiny, args.repeat)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        rounds.append(times)
        load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
        lines = [f"Round {rnd + 1}/{args.runs}: HF {nbytes / 2**20:.0f} MiB fp32 -> TP=3, every output and directory "
                 f"fsynced; {args.repeat} runs per step, order rotated; load average {load}", "",
                 "| step | work best s | work median s | work min-max s | work CPU median s | process median s | "
                 "every run (work) |", "|---|---:|---:|---|---:|---:|---|"]
        for name, v in times.items():
            work = [x[0] for x in v]
            lines.append(f"| {name} | {min(work):.3f} | {statistics.median(work):.3f} | "
                         f"{min(work):.3f}-{max(work):.3f} | {statistics.median(x[2] for x in v):.3f} | "
                         f"{statistics.median(x[1] for x in v):.3f} | {' '.join(f'{w:.2f}' for w in work)} |")
        lines += ["", "| figure | work median ratio | per-repetition min-max | work best ratio | work CPU median "
                  "ratio |", "|---|---:|---|---:|---:|"]
        for label, a, b in PAIRS:
            med, lo, hi = _ratio(times, a, b)
            best = min(x[0] for x in times[a]) / min(x[0] for x in times[b])
            cpu = statistics.median(x[2] for x in times[a]) / statistics.median(x[2] for x in times[b])
            lines.append(f"| {label} | {med:.2f} | {lo:.2f}-{hi:.2f} | {best:.2f} | {cpu:.2f} |")
        lines += ["", f"Every output read back: oarlock's (with and without checksums) all {checked} keys' shards "
                  "equal the source boxes; the scripts' rank files concatenate to the source tensors, their "
                  "checksums match their files."]
        print("\n".join(lines), flush=True)
    if args.runs > 1:
        print(f"\nOver {args.runs} rounds (each round's ratio of work medians): | figure | median | min-max |")
        print("|---|---:|---|")
        for label, a, b in PAIRS:
            per = [_ratio(t, a, b)[0] for t in rounds]
            print(f"| {label} | {statistics.median(per):.2f} | {min(per):.2f}-{max(per):.2f} |")
    print(f"\nload average at the end: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
