"""Overhead of oarlock.debug.capture on a small Llama-like training step, next to torch's DebugMode.

Each configuration runs the same training step (forward, cross-entropy, backward, AdamW step); rounds are
interleaved across configurations and the median and the best step time are reported as factors of the
plain step's (the best of several rounds is the steadier figure on a shared, loaded machine). A capture is
opened and written (JSONL into a temporary directory) for every step, as a user would.

    PYTHONPATH=src .venv/bin/python benchmarks/debug_overhead.py [--dim 128 --layers 2 --seq 64 --batch 4]
        [--rounds 7] [--threads 1] [--results benchmarks/RESULTS.md]

``--model oarlock`` (the default) trains the project's demo model, ``oarlock.models.llama.Llama`` (GQA with fused
qkv, rotary, FlashMask attention, SwiGLU); ``--model local`` uses the small transformer defined here (RMSNorm,
causal multi-head attention via scaled_dot_product_attention, SwiGLU MLP, untied LM head).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import oarlock.debug as od


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(torch.nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.o = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, d))


class MLP(torch.nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = torch.nn.Linear(dim, hidden, bias=False)
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Layer(torch.nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim), Attention(dim, heads)
        self.mlp_norm, self.mlp = RMSNorm(dim), MLP(dim, 8 * dim // 3)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(Layer(dim, heads) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", choices=("oarlock", "local"), default="oarlock",
                    help="oarlock.models.llama.Llama (default) or the transformer defined in this file")
    ap.add_argument("--results", help="append a markdown section to this file (e.g. benchmarks/RESULTS.md)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model == "oarlock":
        from oarlock.models.llama import Llama, LlamaConfig

        model = Llama(LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=8 * args.dim // 3,
                                  num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                  num_key_value_heads=max(1, args.heads // 2)))
    else:
        model = TinyLlama(args.vocab, args.dim, args.layers, args.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1))

    def step():
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    from torch.utils._debug_mode import DebugMode

    tmp = tempfile.TemporaryDirectory()
    n = [0]

    def cap(checksum, stacks=True):
        def ctx():
            n[0] += 1
            return od.capture(Path(tmp.name) / f"run{n[0]}.jsonl", checksum=checksum, stacks=stacks)
        return ctx

    @contextlib.contextmanager
    def debugmode_hash():
        with DebugMode(record_stack_trace=True), DebugMode.log_tensor_hashes("hash_tensor"):
            yield

    configs = {
        "plain step": contextlib.nullcontext,
        "capture, no checksum, no stacks": cap(None, stacks=False),
        "capture, no checksum": cap(None),
        "capture, fast hash": cap("fast"),
        "capture, MD5": cap("md5"),
        "capture, rounded:3": cap("rounded:3"),
        "torch DebugMode()": DebugMode,
        "torch DebugMode(record_stack_trace) + hash_tensor": debugmode_hash,
    }
    times: dict[str, list[float]] = {k: [] for k in configs}
    for k, ctx in configs.items():  # warm-up (DebugMode has a one-time start-up cost)
        for _ in range(2):
            with ctx():
                step()
    with od.capture(Path(tmp.name) / "count.jsonl", checksum=None, stacks=False) as rec:
        step()
    load0 = os.getloadavg()[0]
    for _ in range(args.rounds):
        for k, ctx in configs.items():
            t0 = time.perf_counter()
            with ctx():
                step()
            times[k].append(time.perf_counter() - t0)
    tmp.cleanup()
    base = statistics.median(times["plain step"])
    cmd = "PYTHONPATH=src .venv/bin/python benchmarks/debug_overhead.py " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]) if a)
    name = "oarlock.models.llama.Llama" if args.model == "oarlock" else "local Llama-like model"
    lines = [f"### debug capture overhead: {name} training step, dim {args.dim}, {args.layers} layers, seq {args.seq}, "
             f"batch {args.batch}, {args.threads} thread(s)", "",
             f"`{cmd}`", "",
             f"torch {torch.__version__}, CPU; {rec.num_ops} aten ops per step (forward + backward + AdamW); "
             f"median of {args.rounds} interleaved rounds; load average during the run "
             f"{load0:.1f} -> {os.getloadavg()[0]:.1f} (a shared machine: absolute times are noisy).", "",
             "| configuration | median step (ms) | factor vs plain (median) | factor vs plain (best) "
             "| per op (us, best) |", "|---|---:|---:|---:|---:|"]
    best = min(times["plain step"])
    for k, ts in times.items():
        med = statistics.median(ts)
        per_op = (min(ts) - best) / rec.num_ops * 1e6
        lines.append(f"| {k} | {med * 1e3:.1f} | {med / base:.2f}x | {min(ts) / best:.2f}x | {per_op:+.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.results:
        with open(args.results, "a", encoding="utf-8") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
