"""One GPU check of every CUDA path of oarlock (issue 40), ready to run the moment a GPU is lent.

    bash scripts/gpu_check.sh OUTDIR             # on the GPU machine (<= 8 minutes by design)
    bash scripts/gpu_check.sh --dry-run OUTDIR   # anywhere: every GPU section says "skipped: no CUDA"

Writes ``OUTDIR/report.md`` (what a person reads), ``OUTDIR/figures.json`` (every figure, per section) and
``OUTDIR/logs/`` (each section's raw output, pytest's log, nvidia-smi). Each section runs in its own process with
its own time budget: the section checks its budget between work items and lists what it skipped, and the driver
kills it at the budget plus a grace period (a hung kernel or a CUDA error that poisons the context cannot take
the other sections with it). What each section measures, and where its figures go in benchmarks/RESULTS.md:
``docs/gpu.md``.

Sections: ``header`` (nvidia-smi, versions, commit, the torch APIs the GPU paths use), ``tests`` (``pytest -m
cuda``), ``flashmask`` (Triton kernels vs a float32 reference, compiled FlexAttention and SDPA),
``memory`` (VMM remap allocator on the CUDA driver vs PyTorch's caching allocator and expandable segments),
``async_save`` (oarlock ``async_save`` of CUDA tensors vs DCP ``async_save``), ``reshard`` (live resharding,
colocated on one GPU). The code reused: ``benchmarks/flashmask_gpu.py``, ``benchmarks/memory_gpu.py``,
``benchmarks/async_save.py``, ``tests/attention/attention_cases.py`` and ``oarlock`` itself.

Options: ``--only a,b`` runs some sections; ``--budget name=seconds`` changes one section's budget (repeatable);
``--total S`` caps the whole run (default 470 s).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import inspect
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOTAL_S = 470  # the whole run; scripts/gpu_check.sh kills the driver at 478 s
GRACE_S = 8  # a section is killed this long after its budget
# (name, title, budget in seconds): the budgets plus grace add up to TOTAL_S
SECTIONS = [
    ("header", "Machine, versions, commit, torch APIs", 10),
    ("tests", "The test suite's CUDA cases (pytest -m cuda)", 60),
    ("flashmask", "FlashMask Triton kernels vs float32 reference, compiled FlexAttention and SDPA", 210),
    ("memory", "VMM remap allocator vs PyTorch's caching allocator and expandable segments", 45),
    ("async_save", "async_save of CUDA tensors vs DCP async_save", 70),
    ("reshard", "Live resharding, colocated on one GPU", 25),
]
STATUSES = ("ok", "partial", "failed", "error", "skipped", "timeout")

# Every torch API the GPU paths use (the check's own and oarlock's), with the parameter whose presence matters;
# the header section resolves each on the machine's torch. All are present in torch 2.11 (docs/gpu.md).
API_CHECKS = [
    ("torch.library.custom_op", None, "attention: the FlashMask custom ops"),
    ("torch.library.register_autograd", None, "attention: the FlashMask backward"),
    ("torch.compiler.is_compiling", None, "attention: dispatch under torch.compile"),
    ("torch.nn.attention.flex_attention.flex_attention", None, "flashmask: the FlexAttention anchor"),
    ("torch.nn.attention.flex_attention.BlockMask.from_kv_blocks", "seq_lengths", "attention.masks.to_flex_block_mask"),
    ("torch.nn.attention.sdpa_kernel", None, "flashmask: the SDPA anchor"),
    ("torch.nn.attention.SDPBackend.CUDNN_ATTENTION", None, "flashmask: SDPA with a dense mask"),
    ("torch._dynamo.config.recompile_limit", None, "flashmask: one compile per shape (else cache_size_limit)"),
    ("torch.cuda.mem_get_info", None, "memory: device memory used"),
    ("torch.cuda.max_memory_reserved", None, "memory: peak reserved"),
    ("torch.cuda.memory._record_memory_history", None, "memory observer"),
    ("torch.cuda.memory._snapshot", None, "memory observer"),
    ("torch.cuda._memory_viz._profile_to_snapshot", None, "memory observer"),
    ("torch.Tensor.record_stream", None, "checkpoint.async_save: side-stream copies"),
    ("torch.cuda.Stream", None, "checkpoint.async_save: side stream"),
    ("torch.bfloat16.itemsize", None, "benchmarks/async_save.py: bf16 shapes"),
    ("torch.distributed.checkpoint.async_save", "async_stager", "async_save: the DCP anchor"),
    ("torch.distributed.checkpoint.state_dict_saver.AsyncCheckpointerType.THREAD", None, "async_save: DCP"),
    ("torch.distributed.checkpoint.state_dict_saver.AsyncSaveResponse", None, "async_save: DCP staging future"),
    ("torch.distributed.checkpoint.staging.DefaultStager", None, "async_save: DCP's stager"),
    ("torch.distributed.checkpoint.staging.StagingOptions", "use_non_blocking_copy", "async_save: DCP's stager"),
    ("torch.distributed.device_mesh.init_device_mesh", None, "async_save: DTensors"),
    ("torch.distributed.tensor.DTensor.from_local", "shape", "async_save: DTensors"),
    ("torch.distributed.batch_isend_irecv", None, "reshard: the transfers"),
]


# ----------------------------------------------------------------------------------------------------------
# section side: a context that keeps the budget, the figures and what was skipped, saved after every item
# ----------------------------------------------------------------------------------------------------------

class Ctx:
    """One section's state. ``run(what, fn)`` runs a work item: skipped when the budget is spent or CUDA is
    unusable after an earlier error, its exception recorded (with the traceback) without stopping the section."""

    def __init__(self, name: str, out: Path, budget: float, dry_run: bool):
        self.name, self.out, self.dry_run = name, out, dry_run
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget
        self.cuda = False
        self.cuda_broken: str | None = None
        self.data = {"name": name, "status": "running", "reason": None, "budget_s": budget, "seconds": 0.0,
                     "skipped": [], "failed": [], "errors": [], "notes": [], "figures": {}, "tables": {}, "md": []}
        self.path = out / "sections" / f"{name}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, msg: str) -> None:
        print(f"[{self.name} {time.monotonic() - self.t0:6.1f}s] {msg}", flush=True)

    def skip(self, what: str, why: str) -> None:
        self.data["skipped"].append(f"{what}: {why}")
        self.log(f"skipped {what}: {why}")

    def skip_section(self, why: str) -> None:
        self.data["status"], self.data["reason"] = "skipped", why
        self.log(f"section skipped: {why}")

    def fail(self, what: str) -> None:
        self.data["failed"].append(what)
        self.log(f"FAILED {what}")

    def note(self, text: str) -> None:
        self.data["notes"].append(text)

    def fig(self, key: str, value) -> None:
        self.data["figures"][key] = value

    def row(self, table: str, row: dict) -> None:
        self.data["tables"].setdefault(table, []).append(row)

    def md(self, text: str) -> None:
        self.data["md"].append(text)

    def save(self) -> None:
        self.data["seconds"] = round(time.monotonic() - self.t0, 2)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_json_default))
        os.replace(tmp, self.path)

    def run(self, what: str, fn, *args, need_s: float = 0.0, **kw):
        if self.cuda_broken:
            self.skip(what, f"CUDA unusable after an earlier error ({self.cuda_broken})")
            return None
        if self.left() < need_s:
            self.skip(what, f"time budget spent ({self.data['budget_s']:.0f} s)")
            return None
        try:
            return fn(*args, **kw)
        except Exception as e:  # noqa: BLE001 - every failure is a finding: record it and go on
            self.error(what, e)
            return None
        finally:
            self.save()

    def error(self, what: str, e: BaseException) -> None:
        tb = traceback.format_exc()
        self.data["errors"].append({"what": what, "error": f"{type(e).__name__}: {e}"[:2000], "traceback": tb[-6000:]})
        self.log(f"ERROR {what}: {type(e).__name__}: {str(e)[:300]}")
        if re.search(r"CUDA error|illegal memory access|device-side assert|unspecified launch failure|"
                     r"CUBLAS_STATUS|cudaErrorLaunch", str(e)):
            self.cuda_broken = f"{what}: {str(e)[:120]}"

    def finish(self) -> None:
        d = self.data
        # an error or a failed check shows even in a section that skipped its GPU part (its CPU plumbing failed)
        if d["errors"]:
            d["status"] = "error"
        elif d["failed"]:
            d["status"] = "failed"
        elif d["status"] == "running":
            d["status"] = "partial" if d["skipped"] else "ok"
        self.save()


def _json_default(o):
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def _timer(cuda: bool):
    """``time(fn) -> seconds``: Triton's ``do_bench`` median on CUDA (CUDA events if triton is missing), the best
    of 3 on CPU."""
    if cuda:
        try:
            from triton.testing import do_bench

            def t(fn):
                try:
                    return do_bench(fn, warmup=10, rep=40, return_mode="median") / 1e3
                except TypeError:  # an older do_bench without return_mode
                    return do_bench(fn, warmup=10, rep=40) / 1e3
            return t
        except ImportError:
            import torch

            def t(fn):
                fn()
                torch.cuda.synchronize()
                times = []
                for _ in range(5):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    fn()
                    b.record()
                    b.synchronize()
                    times.append(a.elapsed_time(b) / 1e3)
                return statistics.median(times)
            return t

    def t(fn):  # CPU (the dry run): one warm-up, one timed call
        fn()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return t


def _table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """Markdown table of ``rows``; ``cols`` = (header, key, format)."""
    out = ["| " + " | ".join(h for h, _, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for _, k, f in cols:
            v = r.get(k)
            cells.append("-" if v is None else (format(v, f) if f and isinstance(v, (int, float)) else str(v)))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------------
# header
# ----------------------------------------------------------------------------------------------------------

def resolve_api(path: str, param: str | None):
    """``(present, detail)`` for a dotted torch name (and a parameter or field of it)."""
    import importlib

    parts = path.split(".")
    obj, i = None, len(parts)
    while i > 0:
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            i -= 1
    if obj is None:
        return False, "not importable"
    for name in parts[i:]:
        if not hasattr(obj, name):
            return False, f"no attribute {name!r}"
        obj = getattr(obj, name)
    if param is not None:
        try:
            params = inspect.signature(obj).parameters
        except (TypeError, ValueError):
            return False, f"no signature to find {param!r} in"
        if param not in params:
            return False, f"no parameter {param!r}"
    return True, ""


def section_header(ctx: Ctx) -> None:
    import torch

    ctx.cuda = torch.cuda.is_available()
    info = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "cuda_available": ctx.cuda, "cpus": os.cpu_count(),
            "dry_run": ctx.dry_run, "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    for mod, attr in (("triton", "__version__"), ("cuda.bindings", "__version__"), ("numpy", "__version__")):
        try:
            m = __import__(mod, fromlist=["_"])
            info[mod] = getattr(m, attr, "?")
        except Exception as e:  # noqa: BLE001
            info[mod] = f"missing ({type(e).__name__})"
    info["commit"] = os.environ.get("OARLOCK_COMMIT") or _git("rev-parse", "HEAD") or "unknown (no .git here; set OARLOCK_COMMIT)"
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    info["dirty_files"] = len(dirty.splitlines()) if dirty is not None else None
    with contextlib.suppress(OSError):
        st = shutil.disk_usage(tempfile.gettempdir())
        info["tmp_free_gib"] = round(st.free / 2**30, 1)
    if ctx.cuda:
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, capability=f"{p.major}.{p.minor}", device_memory_gib=round(p.total_memory / 2**30, 1),
                    sms=p.multi_processor_count, devices=torch.cuda.device_count())
    ctx.data["figures"].update(info)
    smi = shutil.which("nvidia-smi")
    if smi:
        for args, name in (([], "nvidia-smi.txt"), (["--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
                                                       "power.limit,temperature.gpu", "--format=csv"], None)):
            try:
                r = subprocess.run([smi, *args], capture_output=True, text=True, timeout=20)
                if name:
                    (ctx.out / "logs" / name).write_text(r.stdout + r.stderr)
                else:
                    ctx.fig("nvidia_smi", r.stdout.strip())
            except (OSError, subprocess.SubprocessError) as e:
                ctx.note(f"nvidia-smi {' '.join(args)} failed: {e}")
    else:
        ctx.note("nvidia-smi: not found on PATH")
    ctx.md("| item | value |\n|---|---|\n" + "\n".join(f"| {k} | {str(v).replace(chr(10), '<br>')} |"
                                                         for k, v in {**info, **({"nvidia-smi": ctx.data['figures'].get('nvidia_smi')} if smi else {})}.items()))
    apis = []
    for path, param, used in API_CHECKS:
        ok, detail = resolve_api(path, param)
        apis.append({"api": path + (f"({param}=)" if param else ""), "present": ok, "detail": detail, "used_by": used})
        if not ok:
            ctx.fail(f"torch {torch.__version__} lacks {path}{'(' + param + '=)' if param else ''}: {detail} "
                     f"(used by {used})")
    ctx.data["tables"]["torch_apis"] = apis
    ctx.md(f"torch APIs the GPU paths use, on torch {torch.__version__}:\n\n" +
           _table(apis, [("API", "api", ""), ("present", "present", ""), ("used by", "used_by", ""),
                         ("detail", "detail", "")]))


def _git(*args) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


# ----------------------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------------------

def cuda_test_files() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                  if "pytest.mark.cuda" in p.read_text(errors="replace"))


def section_tests(ctx: Ctx) -> None:
    import torch

    ctx.cuda = torch.cuda.is_available()
    files = cuda_test_files()
    ctx.fig("files", files)
    base = [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", *files]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    log = ctx.out / "logs" / "tests-pytest.log"
    if not ctx.cuda:
        def collect():
            r = subprocess.run(base + ["--collect-only", "-q"], cwd=REPO, env=env, capture_output=True, text=True,
                               timeout=max(5.0, ctx.left()))
            log.write_text(r.stdout + r.stderr)
            ids = [line for line in r.stdout.splitlines() if "::" in line]
            if r.returncode != 0 or not ids:
                ctx.fail(f"collecting the CUDA cases failed (exit {r.returncode}; logs/tests-pytest.log)")
            ctx.fig("cases", ids)
            ctx.md(f"{len(ids)} cases marked `cuda` in {len(files)} files (collected, not run: no CUDA).")
        ctx.run("collect the CUDA cases", collect)
        ctx.skip_section("no CUDA (the cases were collected only)")
        return
    cmd = base + ["-v", "-rA", f"--junitxml={ctx.out / 'logs' / 'tests-junit.xml'}"]
    ctx.fig("command", " ".join(cmd[1:]))
    timed_out = False
    with open(log, "w") as f:
        try:
            r = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                               timeout=max(5.0, ctx.left() - 3))
            rc = r.returncode
        except subprocess.TimeoutExpired:
            timed_out, rc = True, None
    text = log.read_text(errors="replace")
    summary = next((line.strip("= ") for line in reversed(text.splitlines())
                    if re.search(r"\d+ (passed|failed|error|skipped|deselected)", line)), None)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", summary or "")}
    bad = [line for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    ctx.fig("exit_code", rc)
    ctx.fig("summary", summary)
    ctx.fig("counts", counts)
    ctx.fig("failures", bad)
    if timed_out:
        last = [line for line in text.splitlines() if "::" in line][-1:]
        ctx.skip("the rest of pytest -m cuda", f"time budget spent; last line: {last[0] if last else '-'}")
    for line in bad:
        ctx.fail(line)
    if rc not in (0, None) and not bad:
        ctx.fail(f"pytest exited {rc} (logs/tests-pytest.log)")
    ctx.md(f"`python -m pytest -m cuda` over {len(files)} files: **{summary or 'no summary line'}** "
           f"(exit {rc}{', timed out' if timed_out else ''}); full log: logs/tests-pytest.log" +
           ("".join(f"\n- {b}" for b in bad)))


# ----------------------------------------------------------------------------------------------------------
# flashmask
# ----------------------------------------------------------------------------------------------------------

# every mask type of docs/flashmask.md section 2 (causal_document_mask_from_ids builds causal_document's mask)
MASK_KINDS = ["causal", "sliding_window", "bidirectional_window", "causal_document", "document", "shared_question",
              "global_sliding_window", "prefix_lm_causal", "prefix_lm_document", "qk_sparse", "random_eviction",
              "causal_blockwise"]
CHEAP_TILE_DENSITY = 0.31  # masks this sparse (unmasked 128x128 tiles) also run at S = 128k
REF_GRAD_MAX_S = 8192  # float32 reference forward+backward up to here
REF_FWD_MAX_S = 32768  # forward only up to here (the reference is chunked by rows: memory O(S * 1024))
SDPA_DENSE_MAX_S = 32768  # SDPA with a dense mask up to here (a bool S x S mask, 1 GiB at 32k)
# max |error| / max |reference|: outputs; gradients get GRAD_TOL_FACTOR times more
OUT_TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}
GRAD_TOL_FACTOR = 5.0


def _rel_err(got, ref) -> float:
    got, ref = got.detach().float(), ref.detach().float()
    return float((got - ref).abs().max()) / float(ref.abs().max().clamp_min(1e-6))


def section_flashmask(ctx: Ctx) -> None:
    import torch

    sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "tests" / "attention")]
    from attention_cases import make_mask
    from flashmask_gpu import FLOP_BLOCK, attention_fns, forward_flops, mask_stats

    from oarlock.attention import flashmask_attention, to_flex_block_mask
    from oarlock.attention.masks import canonicalize
    from oarlock.attention.reference import attention_reference

    ctx.cuda = cuda = torch.cuda.is_available()
    if cuda:
        seqlens, long_s, (b, h, d) = [4096, 8192, 32768], 131072, (1, 8, 128)
        dtypes = [torch.bfloat16, torch.float16]
    else:  # dry run: the same code on CPU at small sizes (the CPU kernel, eager FlexAttention), figures meaningless
        seqlens, long_s, (b, h, d) = [1024], None, (1, 1, 16)  # S > 768: the tiled CPU kernel, not SDPA
        dtypes = [torch.float32]
        ctx.skip_section("no CUDA (the CPU plumbing below ran 3 masks at S = 1024 with eager FlexAttention, forward "
                         "only; its figures mean nothing)")
    dev = torch.device("cuda" if cuda else "cpu")
    timer = _timer(cuda)
    ctx.fig("shape", {"B": b, "H": h, "Hk": h, "D": d, "seqlens": seqlens, "long_seqlen": long_s,
                      "dtypes": [str(x).split(".")[-1] for x in dtypes], "flop_block": FLOP_BLOCK})
    masks: dict = {}  # (kind, S) -> (idx on dev, causal, stats)
    inputs: dict = {}  # (S, dtype) -> (q, k, v, dout)
    outs: dict = {}  # (kind, S, dtype) -> (oarlock out, reference out or None)

    def get_mask(kind, s):
        if (kind, s) not in masks:
            idx, causal, _ = make_mask(kind, s, batch=b)
            idx = idx.to(dev)
            masks[(kind, s)] = (idx, causal, mask_stats(idx, causal, s))
        return masks[(kind, s)]

    def get_inputs(s, dtype):
        if (s, dtype) not in inputs:
            for key in [k for k in inputs if k[0] != s]:  # keep one sequence length's inputs at a time
                del inputs[key]
            g = torch.Generator(device=dev).manual_seed(s)
            q, k, v = (torch.randn(b, s, h, d, device=dev, generator=g).to(dtype).requires_grad_(True) for _ in range(3))
            inputs[(s, dtype)] = (q, k, v, torch.randn(b, s, h, d, device=dev, generator=g).to(dtype))
        return inputs[(s, dtype)]

    kinds = MASK_KINDS if cuda else ["causal", "document", "global_sliding_window"]  # dry run: n = 1, 2, 4
    # pass A's order: both dtypes at the shortest S first (a kernel bug shows there), then bf16 at every S, then
    # fp16 at the longer ones; pass B (compiles per S) goes bf16 first, shortest S first
    grid = [(seqlens[0], dt) for dt in dtypes] + [(s, dt) for dt in dtypes for s in seqlens[1:] + ([long_s] if long_s else [])]
    cases = [(s, dt, kind) for s, dt in grid for kind in kinds]

    # pass A: oarlock against the float32 reference, timed with SDPA (at most ~45% of the budget)
    pass_a_end = time.monotonic() + 0.45 * max(0.0, ctx.left())

    def case_a(s, dtype, kind):
        dname = str(dtype).split(".")[-1]
        idx, causal, st = get_mask(kind, s)
        if s == long_s and st["tile_density"] > CHEAP_TILE_DENSITY:
            return "dense"
        q, k, v, dout = get_inputs(s, dtype)
        row = {"mask": kind, "S": s, "dtype": dname, "causal": causal, **st}
        # correctness
        want_grad = s <= REF_GRAD_MAX_S
        out = flashmask_attention(q, k, v, idx, causal=causal)
        grads = torch.autograd.grad(out, (q, k, v), dout) if want_grad else None
        row["finite"] = bool(torch.isfinite(out).all()) and (grads is None or all(bool(torch.isfinite(x).all()) for x in grads))
        if not row["finite"]:
            ctx.fail(f"{kind} S={s} {dname}: non-finite output or gradient")
        ref_out = None
        if s <= REF_FWD_MAX_S:
            canon = canonicalize(idx, causal=causal, seqlen_q=s)
            q32, k32, v32 = (x.detach().float().requires_grad_(want_grad) for x in (q, k, v))
            with torch.set_grad_enabled(want_grad):
                ref_out, _ = attention_reference(q32, k32, v32, canon, causal=causal)
            row["out_err"] = _rel_err(out, ref_out)
            tol = OUT_TOL[dname]
            bad = [f"out {row['out_err']:.2e} > {tol:.0e}"] if row["out_err"] > tol else []
            if want_grad:
                rg = torch.autograd.grad(ref_out, (q32, k32, v32), dout.float())
                for name, got, want in zip(("dq", "dk", "dv"), grads, rg):
                    row[f"{name}_err"] = _rel_err(got, want)
                    if row[f"{name}_err"] > tol * GRAD_TOL_FACTOR:
                        bad.append(f"{name} {row[f'{name}_err']:.2e} > {tol * GRAD_TOL_FACTOR:.0e}")
                del rg
            ref_out = ref_out.detach()
            if bad:
                ctx.fail(f"{kind} S={s} {dname} vs float32 reference (max|err|/max|ref|): {', '.join(bad)}")
        outs[(kind, s, dtype)] = (out.detach(), ref_out)
        del grads
        # timing (SDPA: the flash back end for the plain causal mask, a dense mask otherwise, up to 32k)
        sdpa = "causal" if kind == "causal" else ("dense" if s <= SDPA_DENSE_MAX_S else None)
        fns, _ = attention_fns(q, k, v, dout, idx, causal, sdpa=sdpa)
        fl = forward_flops(st["tile_density"], b, h, s, s, d)
        for name in ("oarlock_fwd", "oarlock_fwdbwd", "sdpa_fwd", "sdpa_fwdbwd"):
            if name in fns and time.monotonic() < ctx.deadline:
                try:
                    row[f"{name}_ms"] = timer(fns[name]) * 1e3
                    row[f"{name}_tflops"] = fl * (3.5 if name.endswith("fwdbwd") else 1.0) / (row[f"{name}_ms"] / 1e3) / 1e12
                except Exception as e:  # noqa: BLE001 - SDPA may refuse a mask/back end: a note, not a kernel failure
                    if not name.startswith("sdpa"):
                        raise
                    row[f"{name}_note"] = f"{type(e).__name__}: {str(e)[:160]}"
        if sdpa is None:
            row["sdpa_note"] = f"no SDPA above S={SDPA_DENSE_MAX_S} (dense mask)"
        del fns
        ctx.row("kernels", row)
        ctx.log(f"A {kind} S={s} {dname}: tile density {st['tile_density']:.3f}, out err {row.get('out_err', float('nan')):.1e}, "
                f"fwd+bwd {row.get('oarlock_fwdbwd_ms', float('nan')):.2f} ms vs sdpa {row.get('sdpa_fwdbwd_ms', float('nan')):.2f} ms")
        return "done"

    skipped_dense = []
    for s, dtype, kind in cases:
        label = f"A {kind} S={s} {str(dtype).split('.')[-1]}"
        if time.monotonic() > pass_a_end:
            ctx.skip(label, "pass A's share of the budget spent")
            continue
        if ctx.run(label, case_a, s, dtype, kind) == "dense":
            skipped_dense.append(f"{kind} {str(dtype).split('.')[-1]}")
        if cuda:
            torch.cuda.empty_cache()
    if skipped_dense:
        ctx.note(f"S={long_s} runs the masks with at most {CHEAP_TILE_DENSITY} of their 128x128 tiles unmasked only; "
                 f"not run there: {', '.join(skipped_dense)}")

    # pass B: compiled FlexAttention with the equivalent BlockMask: agreement with oarlock, and timing
    from torch.nn.attention.flex_attention import flex_attention

    if cuda:
        import torch._dynamo.config as dcfg

        # every (S, dtype, causal) compiles once; the default limit (8) would fall back to eager silently
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dcfg, name):
                setattr(dcfg, name, 256)
                break
        flex = torch.compile(flex_attention, dynamic=False)
    else:
        flex = flex_attention  # eager on CPU: the plumbing only
    # bf16 at every S first (the paper's setting), then fp16
    order = sorted((c for c in cases if (c[2], c[0], c[1]) in outs), key=lambda c: (dtypes.index(c[1]), c[0]))

    def case_b(s, dtype, kind):
        dname = str(dtype).split(".")[-1]
        idx, causal, st = get_mask(kind, s)
        q, k, v, dout = get_inputs(s, dtype)
        row = {"mask": kind, "S": s, "dtype": dname, "tile_density": st["tile_density"]}
        bm = to_flex_block_mask(idx, causal=causal, block_size=FLOP_BLOCK)
        fns, lay = attention_fns(q, k, v, dout, idx, causal, flex=flex, block_mask=bm)
        if not cuda:  # FlexAttention has no backward on CPU and refuses inputs that require grad there
            qt, kt, vt = (x.detach() for x in lay)
            fns = {"flex_fwd": lambda: flex(qt, kt, vt, block_mask=bm)}
        t0 = time.monotonic()
        fo = fns["flex_fwd"]().transpose(1, 2)
        _sync(cuda)
        row["first_call_s"] = time.monotonic() - t0  # includes compilation when this shape is new
        oo, ref = outs[(kind, s, dtype)]
        row["vs_oarlock"] = _rel_err(oo, fo)
        if ref is not None:
            row["flex_err"] = _rel_err(fo, ref)
            row["oarlock_err"] = _rel_err(oo, ref)
            # oarlock may be at most twice as far from float32 as FlexAttention (plus one rounding step)
            tol = 2 * row["flex_err"] + 2.0 ** -(8 if dtype == torch.bfloat16 else 11)
            if row["oarlock_err"] > tol:
                ctx.fail(f"{kind} S={s} {dname}: oarlock error {row['oarlock_err']:.2e} > 2x FlexAttention's "
                         f"{row['flex_err']:.2e} (+1 ulp)")
        elif row["vs_oarlock"] > OUT_TOL[dname]:
            ctx.fail(f"{kind} S={s} {dname}: oarlock vs FlexAttention {row['vs_oarlock']:.2e} > {OUT_TOL[dname]:.0e}")
        del fo
        fl = forward_flops(st["tile_density"], b, h, s, s, d)
        for name in ("flex_fwd", "flex_fwdbwd"):
            if name in fns and time.monotonic() < ctx.deadline:
                row[f"{name}_ms"] = timer(fns[name]) * 1e3
                row[f"{name}_tflops"] = fl * (3.5 if name.endswith("fwdbwd") else 1.0) / (row[f"{name}_ms"] / 1e3) / 1e12
        ctx.row("flex", row)
        ctx.log(f"B {kind} S={s} {dname}: vs oarlock {row['vs_oarlock']:.1e}, flex fwd+bwd "
                f"{row.get('flex_fwdbwd_ms', float('nan')):.2f} ms (first call {row['first_call_s']:.1f} s)")

    for s, dtype, kind in order:
        ctx.run(f"B {kind} S={s} {str(dtype).split('.')[-1]}", case_b, s, dtype, kind, need_s=5.0 if cuda else 0.0)
        if cuda:
            torch.cuda.empty_cache()
    inputs.clear()
    outs.clear()
    _flashmask_summary(ctx)


def _flashmask_summary(ctx: Ctx) -> None:
    """The joined table (one row per mask, S, dtype) and the headline ratios."""
    flex = {(r["mask"], r["S"], r["dtype"]): r for r in ctx.data["tables"].get("flex", [])}
    rows = []
    for r in ctx.data["tables"].get("kernels", []):
        f = flex.get((r["mask"], r["S"], r["dtype"]), {})
        j = {**r, **{k: v for k, v in f.items() if k.startswith(("flex_", "vs_"))}}
        for a in ("flex", "sdpa"):
            if j.get(f"{a}_fwdbwd_ms") and j.get("oarlock_fwdbwd_ms"):
                j[f"{a}_over_oarlock_fwdbwd"] = j[f"{a}_fwdbwd_ms"] / j["oarlock_fwdbwd_ms"]
            if j.get(f"{a}_fwd_ms") and j.get("oarlock_fwd_ms"):
                j[f"{a}_over_oarlock_fwd"] = j[f"{a}_fwd_ms"] / j["oarlock_fwd_ms"]
        rows.append(j)
    ctx.data["tables"]["joined"] = rows
    for a in ("flex", "sdpa"):
        for p in ("fwd", "fwdbwd"):
            xs = [r[f"{a}_over_oarlock_{p}"] for r in rows if r.get(f"{a}_over_oarlock_{p}")]
            if xs:
                ctx.fig(f"{a}_over_oarlock_{p}", {"median": statistics.median(xs), "min": min(xs), "max": max(xs),
                                                  "n": len(xs)})
    ctx.md("Times in ms; TFLOP/s count only the unmasked 128x128 tiles (4 * tile density * B * H * S^2 * D forward, "
           "3.5x that forward+backward); errors are max |x - ref| / max |ref| against the float32 reference "
           "(out; dq/dk/dv up to 8k); ratios > 1 mean oarlock is faster.\n\n" + _table(rows, [
               ("mask", "mask", ""), ("S", "S", ""), ("dtype", "dtype", ""), ("tile dens.", "tile_density", ".3f"),
               ("out err", "out_err", ".1e"), ("dq err", "dq_err", ".1e"), ("dk err", "dk_err", ".1e"),
               ("dv err", "dv_err", ".1e"), ("vs flex", "vs_oarlock", ".1e"),
               ("oarlock fwd ms", "oarlock_fwd_ms", ".3f"), ("oarlock f+b ms", "oarlock_fwdbwd_ms", ".3f"),
               ("oarlock f+b TFLOP/s", "oarlock_fwdbwd_tflops", ".1f"), ("flex fwd ms", "flex_fwd_ms", ".3f"),
               ("flex f+b ms", "flex_fwdbwd_ms", ".3f"), ("flex f+b TFLOP/s", "flex_fwdbwd_tflops", ".1f"),
               ("sdpa f+b ms", "sdpa_fwdbwd_ms", ".3f"), ("flex/oarlock f+b", "flex_over_oarlock_fwdbwd", ".2f"),
               ("sdpa/oarlock f+b", "sdpa_over_oarlock_fwdbwd", ".2f")]))


# ----------------------------------------------------------------------------------------------------------
# memory
# ----------------------------------------------------------------------------------------------------------

def vmm_scenario(alloc, free, fill, check, ptr, pool, sync, page: int) -> dict:
    """Fragment the remap pool, then ask for a block no hole can hold: the pool remaps the pages under the free
    holes behind it (a defragmentation pass without moving data). Returns the figures; ``pointers_stable`` and
    ``data_intact``: every live block kept its address and bytes through it. ``page``: the pool's large page."""
    sizes = [1, 2, 3, 1, 2, 4]  # in large pages, plus a ragged tail
    live = {}
    for i in range(24):
        h = alloc(sizes[i % len(sizes)] * page + 512 * (i % 3))
        fill(h, i % 251)
        live[i] = (h, ptr(h))
    for i in list(live)[1::2]:
        free(live.pop(i)[0])
    sync()
    addrs = {ptr(h) for h, _ in live.values()}
    calls0, remapped0 = dict(pool.calls), pool.counters["granules_remapped"]
    t0 = time.perf_counter()
    big = alloc(8 * page)
    sync()
    t_defrag = time.perf_counter() - t0
    calls = {k: v - calls0.get(k, 0) for k, v in pool.calls.items() if v - calls0.get(k, 0)}
    remapped = pool.counters["granules_remapped"] - remapped0
    fill(big, 255)
    sync()
    # every live block is still handed out at its address (the pool moved pages, not blocks) ...
    active = {addr for addr, _, state, _ in pool.blocks() if state == "active"}
    stable = addrs <= active and all(ptr(h) == p for h, p in live.values())
    # ... and holds the bytes written before the remap
    intact = all(check(h, i % 251) for i, (h, _) in live.items()) and check(big, 255)
    free(big)
    for h, _ in live.values():
        free(h)
    live.clear()
    sync()
    t0 = time.perf_counter()
    released = pool.empty_cache()
    t_empty = time.perf_counter() - t0
    return {"pointers_stable": stable, "data_intact": intact, "defrag_alloc_s": t_defrag,
            "granules_remapped": remapped, "driver_calls_in_defrag": calls,
            "us_per_remapped_granule": 1e6 * t_defrag / remapped if remapped else None,
            "empty_cache_s": t_empty, "empty_cache_released_bytes": released}


def section_memory(ctx: Ctx) -> None:
    import torch

    sys.path[:0] = [str(REPO / "benchmarks")]
    from memory_gpu import make_trace

    from oarlock.memory.simulate import replay

    ctx.cuda = cuda = torch.cuda.is_available()
    scale = 1.0 if cuda else 0.25
    ctx.fig("trace", {"generator": "benchmarks/memory_gpu.py make_trace", "scale": scale})
    modes = ("caching", "expandable", "remap")

    def simulate():
        tr = make_trace(scale)
        for m in modes:
            r = replay(tr, m)
            ctx.row("simulated", {"mode": m, "fragmentation": r.fragmentation, "peak_reserved_mib": r.peak_reserved / 2**20})
    ctx.run("simulated replay of the trace", simulate)
    if not cuda:
        ctx.skip_section("no CUDA (the simulator and the pointer-stability scenario on the fake driver ran)")
    else:
        envs = {"caching": {}, "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "remap": {}}
        for m in modes:
            def measure(m=m):
                env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"} | envs[m]
                r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "memory_gpu.py"), "--mode", m,
                                    "--scale", str(scale)], env=env, capture_output=True, text=True,
                                   timeout=max(5.0, min(ctx.left() - 10, 60)))
                (ctx.out / "logs" / f"memory-{m}.log").write_text(r.stdout + r.stderr)
                if r.returncode != 0:
                    raise RuntimeError(f"memory_gpu.py --mode {m} exited {r.returncode}: {r.stderr[-1500:]}")
                res = json.loads(r.stdout.strip().splitlines()[-1])
                res["peak_allocated_mib"] = res["peak_allocated"] / 2**20
                res["peak_reserved_mib"] = res["peak_reserved"] / 2**20
                res["device_used_peak_mib"] = res["device_used_peak"] / 2**20
                ctx.row("measured", res)
                ctx.log(f"{m}: fragmentation {100 * res['fragmentation']:.2f}%, peak reserved "
                        f"{res['peak_reserved_mib']:.0f} MiB, {res['wall_s']:.2f} s")
            ctx.run(f"replay on the GPU: {m}", measure, need_s=10)

    def scenario():
        if cuda:
            from oarlock.memory.vmm import VmmArena

            arena = VmmArena(0)  # raises DriverUnavailable without cuda-python (cuda.bindings)
            pool = arena.pool
            res = vmm_scenario(alloc=lambda n: arena.empty(n, torch.uint8), free=lambda t: None,
                               fill=lambda t, v: t.fill_(v), check=lambda t, v: bool((t == v).all()),
                               ptr=lambda t: t.data_ptr(), pool=pool,
                               sync=lambda: (gc.collect(), torch.cuda.synchronize()), page=pool.big * pool.page)
            res["driver"] = "CUDA (cuda.bindings)"
        else:
            from oarlock.memory.driver import FakeDriver
            from oarlock.memory.vmm import RemapAllocator

            drv = FakeDriver(granularity=64 * 1024, store_data=True)  # 1/32 of the GPU's sizes
            pool = RemapAllocator(drv, small_size=32 * 1024)
            res = vmm_scenario(alloc=pool.malloc, free=pool.free,
                               fill=lambda blk, v: drv.write(blk.addr, bytes([v]) * blk.requested),
                               check=lambda blk, v: drv.read(blk.addr, blk.requested) == bytes([v]) * blk.requested,
                               ptr=lambda blk: blk.addr, pool=pool, sync=lambda: None, page=pool.big * pool.page)
            res["driver"] = "FakeDriver (dry run)"
        ctx.data["figures"]["defrag"] = res
        if not (res["pointers_stable"] and res["data_intact"]):
            ctx.fail(f"remap pool: pointers stable {res['pointers_stable']}, data intact {res['data_intact']}")
        if not res["granules_remapped"]:
            ctx.fail("remap pool: the scenario remapped no granule (no defragmentation happened)")
    ctx.run("pointer stability and a defragmentation pass", scenario)

    sim = {r["mode"]: r for r in ctx.data["tables"].get("simulated", [])}
    rows = [{**r, "sim_fragmentation": sim.get(r["mode"], {}).get("fragmentation")}
            for r in ctx.data["tables"].get("measured", [])]
    base = next((r for r in rows if r["mode"] == "caching"), None)
    for r in rows:
        r["wall_over_caching"] = r["wall_s"] / base["wall_s"] if base else None
    if rows:
        ctx.md("Synthetic MoE trace (benchmarks/memory_gpu.py, scale "
               f"{scale}) replayed with real allocations:\n\n" + _table(rows, [
                   ("mode", "mode", ""), ("peak alloc MiB", "peak_allocated_mib", ".0f"),
                   ("peak reserved MiB", "peak_reserved_mib", ".0f"), ("fragmentation", "fragmentation", ".4f"),
                   ("simulated", "sim_fragmentation", ".4f"), ("device used MiB", "device_used_peak_mib", ".0f"),
                   ("wall s", "wall_s", ".2f"), ("wall / caching", "wall_over_caching", ".2f")]))
    elif sim:
        ctx.md("Simulated only (no CUDA):\n\n" + _table(list(sim.values()), [
            ("mode", "mode", ""), ("fragmentation", "fragmentation", ".4f"), ("peak reserved MiB", "peak_reserved_mib", ".0f")]))
    if "defrag" in ctx.data["figures"]:
        ctx.md("Pointer stability and one defragmentation pass (24 blocks of 1-4 large pages, every other freed, "
               "then an 8-page block):\n\n" + "\n".join(f"- {k}: {v}" for k, v in ctx.data["figures"]["defrag"].items()))


# ----------------------------------------------------------------------------------------------------------
# async save
# ----------------------------------------------------------------------------------------------------------

def section_async_save(ctx: Ctx) -> None:
    import torch

    sys.path[:0] = [str(REPO / "benchmarks")]
    import async_save as bench

    ctx.cuda = cuda = torch.cuda.is_available()
    if cuda:
        size_mib, steps, matmul, device = 4096, 20, 2048, "cuda"
        free_gib = shutil.disk_usage(tempfile.gettempdir()).free / 2**30
        if free_gib < 7 * size_mib / 1024:  # six saves are kept until the end, plus slack
            size_mib = max(256, int(free_gib / 7 * 1024) // 256 * 256)
            ctx.note(f"only {free_gib:.0f} GiB free under {tempfile.gettempdir()}: saving {size_mib} MiB, not 4096")
    else:
        size_mib, steps, matmul, device = 8, 3, 64, "cpu"
        ctx.skip_section("no CUDA (the same code ran on CPU with 8 MiB; its figures mean nothing)")
    ctx.fig("workload", {"MiB": size_mib, "dtype": "bfloat16", "ranks": 1, "device": device, "tensors":
                         len(bench.tensor_shapes(size_mib, 2)), "shape": bench.tensor_shapes(size_mib, 2)[0],
                         "loop_steps_alone": steps, "matmul": matmul})
    scratch = Path(tempfile.mkdtemp(prefix="oarlock-gpucheck-"))

    def measure():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        bench.rank_main(0, 1, port, str(scratch), size_mib, device, steps, matmul, True, bench.LIBS, torch.bfloat16)
        res = json.loads((scratch / "result-0.json").read_text())
        summ = bench.summarize([res])
        ctx.data["figures"]["per_library"] = summ
        ctx.data["figures"]["loop_step_alone_s"] = res["alone"]
        for lib, f in summ.items():
            ctx.row("libraries", {"library": lib, **f})
            if not f["exact"]:
                ctx.fail(f"{lib}: the checkpoint loaded back differs from the values at the call")
        ctx.md(f"{size_mib} MiB of bf16 DTensors on 1 rank ({device}), benchmarks/async_save.py's rank_main:\n\n" +
               bench.table([summ]))
    try:
        ctx.run("async_save vs DCP", measure, need_s=5)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------
# live resharding
# ----------------------------------------------------------------------------------------------------------

def _spans(n: int, parts: int) -> list[tuple[int, int]]:
    cuts = [n * i // parts for i in range(parts + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def section_reshard(ctx: Ctx) -> None:
    import torch

    try:
        from oarlock.checkpoint import ShardedWeight, reshard_state_dict
    except (ImportError, AttributeError) as e:
        ctx.skip_section(f"not built (oarlock.checkpoint.reshard_state_dict: {type(e).__name__}: {e})")
        return
    ctx.cuda = cuda = torch.cuda.is_available()
    if cuda:
        dev, keys, (rows, cols), n_src, n_tgt = torch.device("cuda"), 4, (8192, 16384), 4, 4  # 4 x 256 MiB bf16
    else:
        dev, keys, (rows, cols), n_src, n_tgt = torch.device("cpu"), 2, (64, 96), 4, 3
        ctx.skip_section("no CUDA (the same code ran on CPU at 2 x 64 x 96; its figures mean nothing)")
    dtype = torch.bfloat16
    ctx.fig("workload", {"keys": keys, "shape": [rows, cols], "dtype": "bfloat16", "sources": f"{n_src} row shards",
                         "targets": f"{n_tgt} column shards", "GiB": keys * rows * cols * 2 / 2**30,
                         "process_group": "none (one process)"})
    g = torch.Generator(device=dev).manual_seed(0)
    dense = {f"layers.{i}.weight": torch.randn(rows, cols, device=dev, generator=g).to(dtype) for i in range(keys)}
    sources = {k: [ShardedWeight(k, w[r0:r1].clone(), (r1 - r0, cols), (rows, cols), (r0, 0))
                   for r0, r1 in _spans(rows, n_src)] for k, w in dense.items()}
    targets = {k: [ShardedWeight(k, torch.zeros(rows, c1 - c0, device=dev, dtype=dtype), (rows, c1 - c0), (rows, cols),
                                 (0, c0)) for c0, c1 in _spans(cols, n_tgt)] for k in dense}

    def zero():
        for sws in targets.values():
            for sw in sws:
                sw.local_tensor.zero_()

    def exact() -> bool:
        return all(torch.equal(sw.local_tensor, dense[k][:, sw.global_offset[1]:sw.global_offset[1] + sw.local_shape[1]])
                   for k, sws in targets.items() for sw in sws)

    def reshard():
        t0 = time.perf_counter()
        rep = reshard_state_dict(sources, targets)
        _sync(cuda)
        return time.perf_counter() - t0, rep

    def plain_copy():
        t0 = time.perf_counter()
        for k, tg in targets.items():
            for t in tg:
                c0, c1 = t.global_offset[1], t.global_offset[1] + t.local_shape[1]
                for s in sources[k]:
                    r0, r1 = s.global_offset[0], s.global_offset[0] + s.local_shape[0]
                    t.local_tensor[r0:r1].copy_(s.local_tensor[:, c0:c1])
        _sync(cuda)
        return time.perf_counter() - t0

    def measure():
        zero()
        first, rep = reshard()
        ok = exact()
        ctx.fig("bit_exact", ok)
        ctx.fig("report", {k: getattr(rep, k, None) for k in ("missing_keys", "unexpected_keys", "bytes_sent",
                                                              "bytes_received", "seconds")})
        if not ok:
            ctx.fail("reshard_state_dict: the column shards differ from the dense tensors' columns")
        times = [reshard()[0] for _ in range(3)]
        zero()
        copy_t = [plain_copy() for _ in range(4)][1:]
        ctx.fig("copy_exact", exact())
        nbytes = keys * rows * cols * 2
        f = {"first_call_s": first, "reshard_s": statistics.median(times), "plain_copy_s": statistics.median(copy_t)}
        f["reshard_GBps"] = nbytes / f["reshard_s"] / 1e9
        f["plain_copy_GBps"] = nbytes / f["plain_copy_s"] / 1e9
        f["reshard_over_copy"] = f["reshard_s"] / f["plain_copy_s"]
        ctx.data["figures"].update(f)
        ctx.md(f"{keys} x [{rows}, {cols}] bf16 ({nbytes / 2**30:.2f} GiB), {n_src} row shards -> {n_tgt} column "
               f"shards in one process on {dev.type}: bit-exact {ok}; reshard_state_dict {f['reshard_s'] * 1e3:.1f} ms "
               f"({f['reshard_GBps']:.1f} GB/s; first call {first * 1e3:.1f} ms), plain torch copy of the same slices "
               f"{f['plain_copy_s'] * 1e3:.1f} ms ({f['plain_copy_GBps']:.1f} GB/s): {f['reshard_over_copy']:.2f}x.")
    ctx.run("colocated reshard", measure, need_s=3)


# ----------------------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------------------

RUNNERS = {"header": section_header, "tests": section_tests, "flashmask": section_flashmask,
           "memory": section_memory, "async_save": section_async_save, "reshard": section_reshard}


def run_section(name: str, out: Path, budget: float, dry_run: bool) -> int:
    ctx = Ctx(name, out, budget, dry_run)
    ctx.save()
    if os.environ.get("GPU_CHECK_HANG") == name:  # tests/test_gpu_check.py: a section that never ends
        ctx.log("hanging on purpose (GPU_CHECK_HANG)")
        time.sleep(3600)
    try:
        RUNNERS[name](ctx)
    except Exception as e:  # noqa: BLE001
        ctx.error(f"section {name}", e)
    ctx.finish()
    return 0


def _load_section(out: Path, name: str) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((out / "sections" / f"{name}.json").read_text())
    return None


def drive(out: Path, dry_run: bool, only: list[str] | None, budgets: dict[str, float], total: float,
          grace: float = GRACE_S) -> int:
    t_start = time.monotonic()
    deadline = t_start + total
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "sections").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(REPO / "src"), os.environ.get("PYTHONPATH", "")] if p),
           "PYTHONUNBUFFERED": "1"}
    if dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the GPU sections see no CUDA, whatever the machine has
    results = {}
    print(f"gpu_check: {'DRY RUN, ' if dry_run else ''}writing to {out}", flush=True)
    for name, title, budget in SECTIONS:
        if only and name not in only:
            continue
        budget = budgets.get(name, budget)
        remaining = deadline - time.monotonic()
        hard = min(budget + grace, remaining)
        soft = max(1.0, min(budget, hard - grace))
        if remaining < grace + 2:
            results[name] = {"name": name, "status": "skipped", "reason": "the whole run's time budget is spent",
                             "seconds": 0, "skipped": [], "failed": [], "errors": [], "notes": [], "figures": {},
                             "tables": {}, "md": []}
            print(f"[{name}] skipped: the whole run's time budget is spent", flush=True)
            continue
        (out / "sections" / f"{name}.json").unlink(missing_ok=True)
        t0 = time.monotonic()
        print(f"[{name}] {title} (budget {soft:.0f} s)", flush=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--out", str(out), "--budget",
               f"{soft:.1f}"] + (["--dry-run"] if dry_run else [])
        killed = None
        with open(out / "logs" / f"{name}.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=hard)
            except subprocess.TimeoutExpired:
                killed = f"killed after {hard:.0f} s (budget {soft:.0f} s + {grace:.0f} s grace)"
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)  # the section and what it started (pytest, memory_gpu.py)
                rc = proc.wait()
        data = _load_section(out, name) or {"name": name, "status": "error", "reason": None, "skipped": [],
                                            "failed": [], "errors": [], "notes": [], "figures": {}, "tables": {},
                                            "md": []}
        data["seconds"] = round(time.monotonic() - t0, 1)
        if killed:
            data["status"], data["reason"] = "timeout", killed + "; figures up to then are kept"
        elif rc != 0 and data.get("status") in ("running", "ok", None):
            tail = (out / "logs" / f"{name}.log").read_text(errors="replace")[-3000:]
            data["status"] = "error"
            data["errors"] = data.get("errors", []) + [{"what": f"section process exited {rc}", "error": "",
                                                        "traceback": tail}]
        results[name] = data
        extra = f" ({data['reason']})" if data.get("reason") else ""
        print(f"[{name}] {data['status']} in {data['seconds']:.0f} s{extra}; {len(data.get('skipped', []))} items "
              f"skipped, {len(data.get('failed', []))} checks failed, {len(data.get('errors', []))} errors", flush=True)
        for kind, items in (("skipped", data.get("skipped", [])), ("FAILED", data.get("failed", [])),
                            ("ERROR", [f"{e['what']}: {e['error'][:200]}" for e in data.get("errors", [])])):
            for item in items[:15]:
                print(f"    {kind} {item}", flush=True)
            if len(items) > 15:
                print(f"    ... {len(items) - 15} more {kind} items in report.md", flush=True)
    wall = time.monotonic() - t_start
    meta = {"dry_run": dry_run, "wall_s": round(wall, 1), "total_budget_s": total,
            "argv": [("OUTDIR" if Path(x).resolve() == out else x) for x in sys.argv[1:]], "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "sections": [n for n, _, _ in SECTIONS if not only or n in only]}
    (out / "figures.json").write_text(json.dumps({"meta": meta, "sections": results}, indent=1, default=_json_default))
    (out / "report.md").write_text(render_report(meta, results))
    (out / "results-section.md").write_text(render_results_section(meta, results))
    print(f"gpu_check: done in {wall:.0f} s: {out / 'report.md'}", flush=True)
    for name, d in results.items():
        print(f"  {name:11s} {d['status']:8s} {d.get('reason') or ''}", flush=True)
    return 0


def render_report(meta: dict, results: dict) -> str:
    h = results.get("header", {}).get("figures", {})
    lines = [f"# oarlock GPU check{' (dry run)' if meta['dry_run'] else ''}", "",
             f"{meta['utc']}; {h.get('device', 'no CUDA device')}; torch {h.get('torch', '?')} (CUDA "
             f"{h.get('torch_cuda')}), triton {h.get('triton', '?')}; commit {h.get('commit', '?')}; "
             f"{meta['wall_s']:.0f} s of a {meta['total_budget_s']:.0f} s budget.", "",
             "| section | status | seconds | skipped items | failed checks | errors | reason |", "|---|---|---|---|---|---|---|"]
    for name in meta["sections"]:
        d = results.get(name)
        if d is None:
            continue
        lines.append(f"| {name} | {d['status']} | {d.get('seconds', 0):.0f} | {len(d.get('skipped', []))} | "
                     f"{len(d.get('failed', []))} | {len(d.get('errors', []))} | {d.get('reason') or ''} |")
    titles = {n: t for n, t, _ in SECTIONS}
    for name in meta["sections"]:
        d = results.get(name)
        if d is None:
            continue
        lines += ["", f"## {name}: {titles[name]}", "", f"Status: **{d['status']}**" +
                  (f" ({d['reason']})" if d.get("reason") else "") + f", {d.get('seconds', 0):.0f} s.", ""]
        if d["status"] == "skipped" and d.get("reason"):
            lines += [f"skipped: {d['reason']}", ""]
        for m in d.get("md", []):
            lines += [m, ""]
        for n in d.get("notes", []):
            lines.append(f"- note: {n}")
        if d.get("failed"):
            lines += ["", "Failed checks:", ""] + [f"- {x}" for x in d["failed"]]
        if d.get("skipped"):
            lines += ["", f"Skipped ({len(d['skipped'])}):", ""] + [f"- {x}" for x in d["skipped"]]
        for e in d.get("errors", []):
            lines += ["", f"Error in {e['what']}: {e['error']}", "", "```", e.get("traceback", "").rstrip(), "```"]
    lines += ["", "Raw: figures.json (every figure, per section), logs/ (each section's output).", ""]
    return "\n".join(lines)


def render_results_section(meta: dict, results: dict) -> str:
    """The block to append to benchmarks/RESULTS.md (docs/gpu.md, "Where the results go"): the run's line, the
    status table and each section's tables, without the tracebacks and skip lists (those stay in report.md)."""
    h = results.get("header", {}).get("figures", {})
    lines = ["", f"## GPU check (issue 40): {h.get('device', 'no CUDA device')}, {meta['utc'][:10]}", "",
             f"Command: `bash scripts/gpu_check.sh {' '.join(meta['argv'])}`; commit {str(h.get('commit', '?'))[:12]}; "
             f"torch {h.get('torch', '?')}, triton {h.get('triton', '?')}; nvidia-smi: "
             f"{((h.get('nvidia_smi') or '-').splitlines() or ['-'])[-1]}; {meta['wall_s']:.0f} s.", "",
             "| section | status | seconds | skipped items | failed checks | errors |", "|---|---|---|---|---|---|"]
    for name in meta["sections"]:
        d = results.get(name)
        if d is not None:
            lines.append(f"| {name} | {d['status']} | {d.get('seconds', 0):.0f} | {len(d.get('skipped', []))} | "
                         f"{len(d.get('failed', []))} | {len(d.get('errors', []))} |")
    for name in meta["sections"]:
        d = results.get(name)
        if d is None or name == "header" or not d.get("md"):
            continue
        lines += ["", f"### {name}", ""] + [m + "\n" for m in d["md"]]
        if d.get("failed"):
            lines += ["Failed checks: " + "; ".join(d["failed"]), ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", nargs="?", help="where report.md, figures.json and logs/ go")
    ap.add_argument("--dry-run", action="store_true", help="on CPU: GPU sections skip, the plumbing runs")
    ap.add_argument("--only", default=None, help="comma-separated sections: " + ",".join(n for n, _, _ in SECTIONS))
    ap.add_argument("--budget", action="append", default=[], metavar="NAME=SECONDS", help="one section's budget")
    ap.add_argument("--total", type=float, default=TOTAL_S, help=f"the whole run's budget in seconds ({TOTAL_S})")
    ap.add_argument("--grace", type=float, default=GRACE_S, help=argparse.SUPPRESS)
    ap.add_argument("--section", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    names = [n for n, _, _ in SECTIONS]
    if args.section:
        return run_section(args.section, Path(args.out), float(args.budget[0]) if args.budget else 60.0, args.dry_run)
    if not args.outdir:
        ap.error("OUTDIR is required")
    only = [x.strip() for x in args.only.split(",")] if args.only else None
    bad = [x for x in only or [] if x not in names]
    budgets = {}
    for item in args.budget:
        k, _, v = item.partition("=")
        if k not in names or not v:
            bad.append(item)
        else:
            budgets[k] = float(v)
    if bad:
        ap.error(f"unknown section or bad budget: {', '.join(bad)} (sections: {', '.join(names)})")
    return drive(Path(args.outdir).resolve(), args.dry_run, only, budgets, args.total, args.grace)


if __name__ == "__main__":
    sys.exit(main())
