"""oarlock against Megatron-Core ``dist_checkpointing`` (and Megatron-Bridge, Meta's torch_checkpointing where they
install): save, same-layout load and reshard load of a Llama-shaped GPT model's sharded training state, and the
HF -> TP=2 conversion.

1. Megatron-Core 0.16.1 (``.foreign-venv``, made by scripts/foreign_env.sh) against oarlock. A ``GPTModel`` (local
   layer spec: RMSNorm, SwiGLU, GQA, RoPE, untied output layer) at TP=2 x DP=2 on 4 gloo ranks; its
   ``sharded_state_dict()`` plus Adam's two moments sharded like their parameters (Megatron's own
   ``optim_state_to_sharding_state``): about 1 GiB of fp32 (``--config small``: about 7 MiB). Every value is a
   function of its key and global index (:func:`expected_values`), so every load is checked against the saved
   values without either library, and the two libraries' loaded bytes are compared through their digests.
   - Saves: Megatron-LM's ``save_checkpoint`` set-up for torch_dist with ``--ckpt-fully-parallel-save`` (its
     default): ``FullyParallelSaveStrategyWrapper(torch_dist)`` over the DP group, made on the first save and kept
     (Megatron-LM keeps it in ``checkpointing_context``). Three rows: *Megatron-LM defaults* (strategy kept,
     ``validate_access_integrity=True`` at every save); *--ckpt-assume-constant-structure* (the strategy's
     ``use_cached_ckpt_structure`` and the wrapper's ``do_cache_distribution``, and, as Megatron-LM does after the
     first save, ``validate_access_integrity=False``); *nothing cached* (a new strategy per save, validated;
     oarlock's ``plan_cache.clear()`` before each save). oarlock saves the same ShardedTensors as
     ``ShardedWeight`` s (same keys, global shapes, offsets), its plan cache kept in the first two rows.
   - Both libraries' state descriptions are built before the clock starts, fresh for every call: Megatron's
     sharded state dict (``model.sharded_state_dict()`` + the optimizer's, as Megatron-LM builds per save; its
     build time is printed) and oarlock's ShardedWeights over the same tensors. Neither timed call rebuilds one.
   - Loads, the same layout, then resharded into a TP=4 model (DP=1): Megatron-LM's default load
     (``TorchDistLoadShardedStrategy`` alone; ``--ckpt-fully-parallel-load`` is off by default), its fully
     parallel load (``FullyParallelLoadStrategyWrapper`` over the DP group), and oarlock's default load (every
     block it reads verified). Cold loads first drop the page cache of the checkpoint's files (``fsync`` +
     ``posix_fadvise(DONTNEED)`` per file); hot loads follow at once.
   - What is timed: the library call between barriers (slowest rank), ``--reps`` repetitions (default 5), the
     order of the rows and of the libraries rotated per repetition; each table gives the median and min-max per
     library and the ratio of medians with the min-max of the per-repetition ratios. Megatron's load returns new
     tensors for part of the state (the fully parallel exchange, the merged gate/up halves); copying them into
     the model afterwards is not timed (it favours Megatron); oarlock writes into the model's tensors.
   - Both libraries run in the same 4 processes with ``.foreign-venv``'s interpreter (its torch is ``.venv``'s own
     build, through a .pth file) and oarlock's source on ``sys.path``: one set of processes, so both meet the same
     machine state. Megatron runs on CPU through targeted stand-ins set only in these processes
     (:func:`megatron_cpu_stand_ins`: ``torch.cuda.synchronize``/``current_device``, ``Tensor.cuda``, the
     exchange module's ``device="cuda"`` buffers); no torch function mode is active in any timed call (one was,
     around Megatron's loads only; issue 48 measured it costing a plain DCP load about 12%).
   - Megatron's per-layer ``_extra_state`` objects (empty for the local layer spec) are left out of both states.
2. HF -> TP=2: ``oarlock convert HF OUT --preset llama --tp 2`` (the training layout of oarlock's Llama: fused QKV
   per KV group, TP-blocked gate/up) on a Llama-shaped HF directory of the same model, process wall time, against
   Megatron-Bridge's ``AutoBridge`` where ``.megatron-bridge-venv`` (scripts/megatron_bridge_env.sh) imports; else
   the row says why, from that script's report.
3. torch_checkpointing (``.torch-checkpointing-venv``, scripts/torch_checkpointing_env.sh) against oarlock on
   DTensors of the same global shapes: mesh (dp=2, tp=2) ``[Replicate(), Shard(tp axis)]`` saved, loaded the same
   way and as ``[Shard(tp axis)]`` on a 4-rank mesh, synchronous saves; skipped with a note when it is missing.

Usage: python benchmarks/megatron.py [--config full|small] [--reps N] [--dir DIR] [--parts megatron,convert,tc]
       [--smoke]  (= --config small --reps 1)
Exits 1 when a byte check fails.
Prints a markdown table per part, with ratios and ``uptime``'s load average. It never writes benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# run as a file, this script's folder is sys.path[0] and this module would shadow the `megatron` package
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    del sys.path[0]
FOREIGN_PY = ROOT / ".foreign-venv" / "bin" / "python"
BRIDGE_PY = ROOT / ".megatron-bridge-venv" / "bin" / "python"
TC_PY = ROOT / ".torch-checkpointing-venv" / "bin" / "python"
WORLD = 4
CHECKS: list[tuple[str, bool]] = []  # (part, its byte check passed): any False makes the run exit 1

# Llama-shaped: head_dim 64, 4 KV groups, SwiGLU ffn ~2.75 x hidden; "full" holds 89.9M parameters, x3 with Adam's
# moments = 1.005 GiB of fp32. The vocabulary is a multiple of 128 x TP for TP=2 and 4 (no padding differences).
CONFIGS = {
    "full": dict(hidden=1024, heads=16, groups=4, ffn=2816, layers=5, vocab=16384),
    "small": dict(hidden=128, heads=8, groups=4, ffn=352, layers=2, vocab=1024),
}


# ---------------------------------------------------------------- values and checks (no library involved)

def expected_values(key: str, global_shape, offset, local_shape):
    """The value every saved element holds: an integer hash of (key, global row-major index) scaled into [-1, 1),
    exact in float32 (24-bit integers), so a box of any layout can be recomputed without reading a checkpoint."""
    import torch

    idx = torch.zeros(tuple(local_shape), dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(global_shape))):
        view = [1] * len(local_shape)
        view[d] = -1
        idx += (torch.arange(offset[d], offset[d] + local_shape[d], dtype=torch.int64) * stride).view(view)
        stride *= int(global_shape[d])
    seed = zlib.crc32(key.encode()) & 0xFFFFFF
    return (((idx * 2654435761 + seed) % 16777213).to(torch.float32) - 8388606.0) / 8388608.0


def digest(tensors) -> str:
    """blake2b of the tensors' bytes in order: equal digests = equal bytes."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(memoryview(t.detach().contiguous().view(-1).numpy()).cast("B"))
    return h.hexdigest()


def drop_file_cache(root: Path) -> None:
    """Evict a checkpoint's files from the page cache: fsync (DONTNEED drops clean pages only), then
    ``posix_fadvise(POSIX_FADV_DONTNEED)`` over each whole file."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(fn) -> float:
    """Seconds of ``fn()`` from a common start (a barrier) to the last rank's end: the slowest rank's duration,
    all-reduced, so every rank returns the same figure."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def rotated(items: list, r: int) -> list:
    """``items`` rotated by ``r``: repetition r starts with a different library."""
    k = r % len(items)
    return items[k:] + items[:k]


def fresh_dir(path: Path, rank: int, create: bool) -> None:
    """Rank 0 removes ``path`` (and recreates it when ``create``); every rank waits for it."""
    import torch.distributed as dist

    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        if create:
            path.mkdir(parents=True)
    dist.barrier()


def evict(path: Path, rank: int) -> None:
    """Rank 0 drops ``path``'s files from the page cache before a cold load; every rank waits for it."""
    import torch.distributed as dist

    if rank == 0:
        drop_file_cache(path)
    dist.barrier()


# ---------------------------------------------------------------- part 1: Megatron-Core, in each rank

class _CudaToCpu:
    """A torch function mode in which ``device="cuda"`` allocations and ``.cuda()`` moves give CPU tensors: a CPU
    stand-in, entered only around torch_checkpointing's calls (its metadata all-gather hard-codes CUDA). It
    intercepts every torch call inside, a cost per call (issue 48: about 12% of a plain DCP load): part 1
    (Megatron) uses :func:`megatron_cpu_stand_ins` instead."""

    def __init__(self):
        from torch.overrides import TorchFunctionMode

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                import torch

                kwargs = kwargs or {}
                if func is torch.Tensor.cuda:
                    return args[0]
                dev = kwargs.get("device")
                if dev is not None and str(dev).startswith("cuda"):
                    kwargs = {**kwargs, "device": "cpu"}
                return func(*args, **kwargs)

        self.mode = Mode()


class MegatronState:
    """A ``GPTModel`` at the current parallel state, Adam's moments beside its parameters, and the views of both
    as Megatron ShardedTensors (factories applied: gate and up halves of ``linear_fc1`` apart)."""

    def __init__(self, c: dict):
        import torch
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        cfg = TransformerConfig(num_layers=c["layers"], hidden_size=c["hidden"], num_attention_heads=c["heads"],
                                num_query_groups=c["groups"], ffn_hidden_size=c["ffn"], use_cpu_initialization=True,
                                perform_initialization=False, gated_linear_unit=True,
                                activation_func=torch.nn.functional.silu, normalization="RMSNorm",
                                add_bias_linear=False, params_dtype=torch.float32)
        self.model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                              vocab_size=c["vocab"], max_sequence_length=256, position_embedding_type="rope",
                              share_embeddings_and_output_weights=False)
        self.params = [p for _, p in self.model.named_parameters()]
        self.moments = [{"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)} for p in self.params]
        sd = self.sharded()
        apply_factories(sd)
        self.views = [t for t in nested_values(sd) if isinstance(t, ShardedTensor)]

    def sharded(self) -> dict:
        """A fresh sharded state dict (model + optimizer + iteration), as Megatron-LM builds one per save/load."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject
        from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                                optim_state_to_sharding_state)

        msd = {k: v for k, v in self.model.sharded_state_dict().items() if not isinstance(v, ShardedObject)}
        osd = {"state": {i: dict(m) for i, m in enumerate(self.moments)},
               "param_groups": [{"params": list(range(len(self.params))), "lr": 3e-4, "betas": [0.9, 0.95]}]}
        optim_state_to_sharding_state(osd, get_param_id_to_sharded_param_map(msd, self.params))
        return {**msd, "optimizer": osd, "iteration": 7}

    def oarlock(self) -> dict:
        """The same shards for oarlock: ShardedWeights over the same storage (the stacked layer axis added)."""
        from oarlock.checkpoint import ShardedWeight

        out = []
        for st in self.views:
            shape = (1,) * st.prepend_axis_num + tuple(st.data.shape)
            out.append(ShardedWeight(st.key, st.data.detach().view(shape), shape, st.global_shape, st.global_offset))
        return {"state": out, "iteration": 7}

    def fill(self) -> None:
        import torch

        for st in self.views:
            shape = (1,) * st.prepend_axis_num + tuple(st.data.shape)
            with torch.no_grad():
                st.data.copy_(expected_values(st.key, st.global_shape, st.global_offset, shape).view(st.data.shape))

    def zero(self) -> None:
        for t in self.tensors():
            t.zero_()

    def tensors(self) -> list:
        return [st.data.detach() for st in self.views]


def _copy_back(template, loaded) -> None:
    """Megatron's load returns new tensors for part of the state: copy them into the tensors of the sharded state
    dict they were loaded for (untimed), walking both dicts together."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(template, dict):
        for k, v in template.items():
            _copy_back(v, loaded[k])
    elif isinstance(template, (ShardedTensor, ShardedTensorFactory)):
        if isinstance(loaded, torch.Tensor) and loaded.data_ptr() != template.data.data_ptr():
            template.data.detach().copy_(loaded)


def megatron_cpu_stand_ins() -> None:
    """Let Megatron-Core's checkpoint code run on CPU tensors without a function mode: targeted replacements of the
    few calls that hard-code CUDA, so every other torch call (Megatron's, DCP's, oarlock's) runs untouched and
    costs what it costs. ``torch.cuda.synchronize``/``current_device`` (its file writer; see
    tests/checkpoint/_foreign_writers.py); ``Tensor.cuda`` returns the tensor itself (the fully parallel load's
    exchange moves loaded shards with ``.cuda()``); the exchange module's ``torch.empty``/``empty_like`` and
    ``ShardedTensor.init_data`` turn ``device="cuda"`` into the CPU (its exchange buffers). A torch function mode
    did this before, around Megatron's loads only; it intercepted every torch call of the load (issue 48: about
    12% of a plain DCP load's time)."""
    import types

    import torch
    from megatron.core.dist_checkpointing import exchange_utils
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def cpu(device):
        return "cpu" if device is not None and str(device).startswith("cuda") else device

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    shim = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    shim.empty = lambda *a, device=None, **k: torch.empty(*a, device=cpu(device), **k)
    shim.empty_like = lambda t, *a, device=None, **k: torch.empty_like(t, *a, device=cpu(device), **k)
    exchange_utils.torch = shim
    init_data = ShardedTensor.init_data
    ShardedTensor.init_data = lambda self, device, *a, **k: init_data(self, cpu(device), *a, **k)


def megatron_rank(rank: int, port: int, root: str, c: dict, reps: int) -> None:
    """One rank of part 1: saves (Megatron-LM's defaults, its constant-structure caching, nothing cached), loads
    in the same layout and resharded (Megatron's default load, its fully parallel load, oarlock's); rank 0 writes
    ``result.json``."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    from megatron.core import dist_checkpointing as mdc
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (FullyParallelLoadStrategyWrapper,
                                                                            FullyParallelSaveStrategyWrapper)
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    from oarlock.checkpoint import load_state_dict, save_state_dict
    from oarlock.checkpoint.runtime.save import plan_cache

    megatron_cpu_stand_ins()
    base = Path(root)
    rows: dict[str, list[float]] = {}
    checks: dict[str, list[str]] = {}
    build: list[float] = []

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    dp = ps.get_data_parallel_group()
    st = MegatronState(c)
    st.fill()
    saved_digest = digest(st.tensors())
    nbytes = torch.tensor([sum(t.numel() * 4 for t in st.tensors()) if ps.get_data_parallel_rank() == 0 else 0])
    dist.all_reduce(nbytes)  # the state's size: the DP=0 replicas hold every shard once

    def megatron_sd() -> dict:
        # a fresh sharded state dict per call, as Megatron-LM builds one per save; built before the clock starts
        # (oarlock's ShardedWeights are built before the clock too): neither library's timed call rebuilds it
        t0 = time.perf_counter()
        sd = st.sharded()
        build.append(time.perf_counter() - t0)
        return sd

    def fully_parallel_save(cached: bool):
        # Megatron-LM's save_checkpoint (torch_dist, --ckpt-fully-parallel-save, its default): the strategy is made
        # on the first save and kept in checkpointing_context; --ckpt-assume-constant-structure also sets
        # use_cached_ckpt_structure and the wrapper's do_cache_distribution
        s = get_default_save_sharded_strategy("torch_dist")
        if cached:
            s.use_cached_ckpt_structure = True
        return FullyParallelSaveStrategyWrapper(s, dp, do_cache_distribution=cached)

    # save rows: (name, Megatron strategy factory per save or kept object, Megatron's validate_access_integrity,
    # oarlock's plan cache kept)
    kept = {"default": fully_parallel_save(False), "constant": fully_parallel_save(True)}
    save_rows = [
        # Megatron-LM's defaults in a training loop: strategy kept, sharding integrity validated at every save
        ("save, Megatron-LM defaults (strategy kept, access validated)", lambda: kept["default"], True, True),
        # --ckpt-assume-constant-structure: cached structure and distribution, validation skipped after the first
        # save (Megatron-LM: validate_sharding_integrity = not args.ckpt_assume_constant_structure)
        ("save, --ckpt-assume-constant-structure (cached, not validated)", lambda: kept["constant"], False, True),
        # nothing reused: a new Megatron strategy (validated) per save, oarlock's plan cache cleared
        ("save, nothing cached", lambda: fully_parallel_save(False), True, False),
    ]
    ck = {"megatron": base / "megatron", "oarlock": base / "oarlock"}
    # one untimed save each first (lazy imports, Megatron's writer processes, gloo's first connections over the DP
    # group); it is also the first save of each kept Megatron strategy (validated, as Megatron-LM's first save is)
    for strategy in kept.values():
        fresh_dir(ck["megatron"], rank, create=True)
        mdc.save(megatron_sd(), str(ck["megatron"]), strategy, validate_access_integrity=True)
    fresh_dir(ck["oarlock"], rank, create=False)
    save_state_dict(st.oarlock(), ck["oarlock"])
    for r in range(reps):
        for name, strategy_of, validate, keep_plans in rotated(save_rows, r):
            for lib in rotated(["megatron", "oarlock"], r):
                fresh_dir(ck[lib], rank, create=lib == "megatron")
                if lib == "megatron":
                    sd, strategy = megatron_sd(), strategy_of()
                    t = timed(lambda: mdc.save(sd, str(ck[lib]), strategy, validate_access_integrity=validate))
                else:
                    if not keep_plans:
                        plan_cache.clear()
                    osd = st.oarlock()
                    t = timed(lambda: save_state_dict(osd, ck[lib]))
                rows.setdefault(f"{name}|{lib}", []).append(t)

    loaders = {
        # Megatron-LM's default load (no --ckpt-fully-parallel-load): the torch_dist strategy alone
        "megatron": lambda group: TorchDistLoadShardedStrategy(),
        # --ckpt-fully-parallel-load: each shard read by one DP rank and exchanged
        "megatron-fpl": lambda group: FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), group),
    }

    def load_rows(layout: str, state: MegatronState, dp_group) -> None:
        for r in range(reps):
            for lib in rotated(["megatron", "megatron-fpl", "oarlock"], r):
                for temp in ("cold", "hot"):
                    state.zero()
                    path = ck["oarlock" if lib == "oarlock" else "megatron"]
                    if temp == "cold":
                        evict(path, rank)
                    if lib == "oarlock":
                        osd = state.oarlock()
                        t = timed(lambda: load_state_dict(osd, path))
                    else:
                        sd, strategy, out = state.sharded(), loaders[lib](dp_group), {}
                        t = timed(lambda: out.setdefault("sd", mdc.load(sd, str(path), strategy)))
                        _copy_back(sd, out.pop("sd"))
                    rows.setdefault(f"{layout}, {temp}|{lib}", []).append(t)
                    checks.setdefault(f"{layout}|{lib}", []).append(digest(state.tensors()))

    load_rows("same-layout load (TP2 x DP2)", st, dp)
    st = None  # frees the TP=2 state before the TP=4 model is built
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=4, pipeline_model_parallel_size=1)
    st4 = MegatronState(c)
    st4.fill()
    resharded_digest = digest(st4.tensors())
    load_rows("reshard load (TP4)", st4, ps.get_data_parallel_group())
    bad = [f"{k}: repetition {i} differs" for k, v in checks.items() for i, d in enumerate(v)
           if d != (saved_digest if k.startswith("same") else resharded_digest)]
    flags = [None] * WORLD
    dist.all_gather_object(flags, bad)
    builds = [None] * WORLD
    dist.all_gather_object(builds, statistics.median(build))
    if rank == 0:
        sizes = {lib: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for lib, p in ck.items()}
        (base / "result.json").write_text(json.dumps({
            "rows": rows, "ok": [not b for b in flags], "bad": [f"rank {r}: {m}" for r, b in enumerate(flags)
                                                                  for m in b],
            "state_bytes": int(nbytes), "files_bytes": sizes, "build_s": max(builds)}))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- part 3: torch_checkpointing, in each rank

def dtensor_specs(c: dict) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(key, global shape, tensor-parallel axis or None) of part 1's state: the GPT model's tensors as Megatron
    stores them (layers stacked on axis 0, fused QKV and gate/up) and Adam's two moments beside each."""
    h, f, n_layers, v = c["hidden"], c["ffn"], c["layers"], c["vocab"]
    qkv = h + 2 * c["groups"] * (h // c["heads"])
    lay = "decoder.layers."
    model = [("embedding.word_embeddings.weight", (v, h), 0), ("output_layer.weight", (v, h), 0),
             ("decoder.final_layernorm.weight", (h,), None),
             (lay + "self_attention.linear_qkv.layer_norm_weight", (n_layers, h), None),
             (lay + "self_attention.linear_qkv.weight", (n_layers, qkv, h), 1),
             (lay + "self_attention.linear_proj.weight", (n_layers, h, h), 2),
             (lay + "mlp.linear_fc1.layer_norm_weight", (n_layers, h), None),
             (lay + "mlp.linear_fc1.weight", (n_layers, 2 * f, h), 1),
             (lay + "mlp.linear_fc2.weight", (n_layers, h, f), 2)]
    return [(pre + k, shape, axis) for pre in ("", "optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq.")
            for k, shape, axis in model]


def dtensor_state(c: dict, mesh, tp_dim: int, filled: bool) -> dict:
    """Part 1's state as DTensors on ``mesh`` (sharded on the TP axis over mesh dim ``tp_dim``, replicated over
    the others), filled with :func:`expected_values` or zeros."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for key, shape, axis in dtensor_specs(c):
        pl = [Replicate()] * mesh.ndim
        if axis is not None:
            pl[tp_dim] = Shard(axis)
        local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, pl)
        local = expected_values(key, shape, offset, local_shape) if filled else torch.zeros(local_shape)
        out[key] = DTensor.from_local(local, mesh, pl, shape=torch.Size(shape),
                                      stride=torch.empty(shape, device="meta").stride())
    return out


def tc_rank(rank: int, port: int, root: str, c: dict, reps: int) -> None:
    """One rank of part 3: torch_checkpointing's synchronous save and resharding load against oarlock's."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    from oarlock.checkpoint import load_state_dict, save_state_dict
    from oarlock.checkpoint.runtime.save import plan_cache

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    # its metadata all-gather allocates on "cuda" (metadata_manager._all_gather_pickled_data): CPU stand-in
    cuda_to_cpu = _CudaToCpu().mode
    base = Path(root)
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh4 = init_device_mesh("cpu", (4,))
    def new_manager():
        # its default O_DIRECT writes fail here at close (EINVAL: the last block is not aligned): buffered writes
        return CheckpointManager(CheckpointManager.Config(
            items={"state": ItemSpec(resharder=DefaultResharder())}, save=SyncCheckpointSaverConfig(),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))

    manager = new_manager()
    src = dtensor_state(c, mesh2, 1, True)
    ck = {"torch_checkpointing": base / "tc", "oarlock": base / "oarlock"}

    def save(lib):
        fresh_dir(ck[lib], rank, create=False)
        if lib == "oarlock":
            plan_cache.clear()  # both uncached: torch_checkpointing gets a new manager per save (below)
            return timed(lambda: save_state_dict(src, ck[lib]))
        # a new manager per save: a synchronous saver that reuses its cached metadata writes no metadata.pkl on
        # its later saves (0.1.1's SyncCheckpointSaver._prepare_checkpoint_write_info), and those cannot reshard
        saver = new_manager()
        with cuda_to_cpu:
            return timed(lambda: saver.save(str(ck[lib]), {"state": src}))

    rows: dict[str, list[float]] = {}
    checks: dict[str, list[bool]] = {}
    for lib in ck:  # untimed warm-up saves, as in part 1
        save(lib)
    for r in range(reps):
        for lib in rotated(list(ck), r):
            rows.setdefault(f"save|{lib}", []).append(save(lib))
    for layout, mesh, tp_dim in (("same-layout load (dp2 x tp2)", mesh2, 1), ("reshard load (tp4)", mesh4, 0)):
        want = digest(v.to_local() for v in dtensor_state(c, mesh, tp_dim, True).values())
        for r in range(reps):
            for lib in rotated(list(ck), r):
                for temp in ("cold", "hot"):
                    tgt = dtensor_state(c, mesh, tp_dim, False)
                    if temp == "cold":
                        evict(ck[lib], rank)
                    if lib == "oarlock":
                        t = timed(lambda: load_state_dict(tgt, ck[lib]))
                    else:
                        with cuda_to_cpu:
                            t = timed(lambda: manager.load(str(ck[lib]), into={"state": tgt}))
                    rows.setdefault(f"{layout}, {temp}|{lib}", []).append(t)
                    checks.setdefault(lib, []).append(digest(v.to_local() for v in tgt.values()) == want)
    flags = [None] * WORLD
    dist.all_gather_object(flags, all(all(v) for v in checks.values()))
    if rank == 0:
        sizes = {lib: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for lib, p in ck.items()}
        (base / "result.json").write_text(json.dumps({"rows": rows, "ok": flags, "files_bytes": sizes}))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver

def run_ranks(python: Path, part: str, scratch: Path, args: argparse.Namespace, timeout: float) -> dict:
    """Start this script's ``--rank`` entry for ``part`` on WORLD ranks with ``python`` (oarlock's source on the
    path) and return rank 0's ``result.json``; a failing rank's stderr tail is raised."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "DS_ACCELERATOR": "cpu"}
    procs = []
    logs = []
    for r in range(WORLD):
        log = open(scratch / f"{part}-rank{r}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen([str(python), __file__, "--rank", str(r), "--port", str(port), "--part", part,
                                       "--dir", str(scratch), "--config", args.config, "--reps", str(args.reps)],
                                      stdout=log, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            codes.append("timeout")
    bad = [r for r, c in enumerate(codes) if c != 0]
    if bad or not (scratch / "result.json").exists():
        logs[bad[0] if bad else 0].seek(0)
        tail = logs[bad[0] if bad else 0].read()[-3000:]
        raise RuntimeError(f"{part}: rank {bad[0] if bad else 0} exited {codes[bad[0]] if bad else 0}:\n{tail}")
    for log in logs:
        log.close()
    return json.loads((scratch / "result.json").read_text())


def ratio_table(rows: dict, peers: list[tuple[str, str]], ours: str = "oarlock") -> list[str]:
    """Markdown rows: per operation, each library's median over repetitions with its min-max, and each peer's
    ratio of medians to oarlock's (peer / oarlock) with the min-max of the per-repetition ratios (repetition i of
    both libraries ran back to back). Operations a peer has no row for leave its cells empty."""
    ops = []
    for k in rows:
        op = k.split("|")[0]
        if op not in ops:
            ops.append(op)
    present = [(lib, name) for lib, name in peers if any(k.endswith(f"|{lib}") for k in rows)]
    head = "| operation | " + " | ".join(f"{name} median s (min-max)" for _, name in present)
    head += " | oarlock median s (min-max) | " + " | ".join(f"{name} / oarlock (per-rep min-max)"
                                                          for _, name in present) + " |"
    out = [head, "|---|" + "---:|" * (2 * len(present) + 1)]

    def cell(xs):
        return f"{statistics.median(xs):.3f} ({min(xs):.2f}-{max(xs):.2f})"

    for op in ops:
        b = rows[f"{op}|{ours}"]
        mb = statistics.median(b)
        cells = [cell(rows[f"{op}|{lib}"]) if f"{op}|{lib}" in rows else "" for lib, _ in present]
        ratios = []
        for lib, _ in present:
            a = rows.get(f"{op}|{lib}")
            if a is None:
                ratios.append("")
                continue
            each = [x / y for x, y in zip(a, b)]
            ratios.append(f"{statistics.median(a) / mb:.2f} ({min(each):.2f}-{max(each):.2f})")
        out.append(f"| {op} | " + " | ".join(cells) + f" | {cell(b)} | " + " | ".join(ratios) + " |")
    return out


def load_average() -> str:
    """``uptime``'s load average (1/5/15 min) and the core count."""
    return f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores"


def part_megatron(scratch: Path, args) -> list[str]:
    if not FOREIGN_PY.exists():
        return ["Megatron-Core: skipped, .foreign-venv is missing (bash scripts/foreign_env.sh makes it)."]
    d = scratch / "megatron"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    res = run_ranks(FOREIGN_PY, "megatron", d, args, timeout=3600)
    CHECKS.append(("megatron", all(res["ok"])))
    for line in res.get("bad", []):
        print(f"MISMATCH: megatron part: {line}", file=sys.stderr)
    gib = res["state_bytes"] / 2**30
    files = ", ".join(f"{lib} {b / 2**30:.3f} GiB" for lib, b in res["files_bytes"].items())
    saves = {k: v for k, v in res["rows"].items() if k.startswith("save")}
    loads = {k: v for k, v in res["rows"].items() if not k.startswith("save")}
    lines = [f"Megatron-Core {_version(FOREIGN_PY, 'megatron-core')} `dist_checkpointing` (torch_dist) vs oarlock: "
             f"GPTModel {args.config} ({_shape(args.config)}), model + Adam moments, {gib:.3f} GiB of fp32 on 4 gloo "
             f"ranks (TP2 x DP2; reshard: TP4); checkpoint files: {files}. {args.reps} repetitions, the order of the "
             f"rows and of the libraries rotated per repetition; the slowest rank's time of the library call. Both "
             f"libraries' state descriptions are built before the clock starts (Megatron's sharded state dict, "
             f"{res['build_s']:.3f} s a build here; oarlock's ShardedWeights over the same tensors). Megatron runs on "
             f"CPU through targeted stand-ins for its CUDA calls (no function mode: nothing in the timed calls is "
             f"intercepted).", "",
             "Saves, Megatron-LM's fully parallel save (its default) in a training loop, against oarlock's default "
             "save (its plan cache kept, except the last row):", ""]
    lines += ratio_table(saves, [("megatron", "Megatron-Core")])
    lines += ["", "Loads: Megatron-LM's default load (the torch_dist strategy alone) and its "
              "`--ckpt-fully-parallel-load` (FullyParallelLoadStrategyWrapper over the DP group), against oarlock's "
              "default load (every block it reads verified against the checksums written at save; Megatron checks "
              "none):", ""]
    lines += ratio_table(loads, [("megatron", "Megatron-Core default"),
                                 ("megatron-fpl", "Megatron-Core fully parallel")])
    return lines + [
        "", f"Every load equal to the saved values (a function of key and global index, computed without either "
            f"library), both libraries, every rank: {all(res['ok'])}"]


def hf_llama(path: Path, c: dict) -> dict:
    """Write a Llama-shaped HF directory of part 1's model (``config.json`` + ``model.safetensors``, values from
    :func:`expected_values`) and return its tensors."""
    from safetensors.torch import save_file

    h, f, v = c["hidden"], c["ffn"], c["vocab"]
    kv = c["groups"] * (h // c["heads"])
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f)})
    tensors = {k: expected_values(k, s, (0,) * len(s), s) for k, s in shapes.items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": f,
        "num_hidden_layers": c["layers"], "num_attention_heads": c["heads"], "num_key_value_heads": c["groups"],
        "vocab_size": v, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32"}))
    with open(path / "model.safetensors", "rb") as fh:
        os.fsync(fh.fileno())
    return tensors


def tp2_reference(key: str, r: int, hf: dict, c: dict):
    """TP rank ``r``'s tensor ``key`` of oarlock's Llama training layout at TP=2, computed from the HF tensors:
    row halves of the embedding and LM head, column halves of o_proj and down_proj, norms whole, the rank's KV
    groups of the fused QKV (each group as [its q heads; k; v]) and [gate half; up half] for gate/up."""
    import torch

    hp = "model." + key if key != "lm_head.weight" else key
    if key.endswith(("embed_tokens.weight", "lm_head.weight")):
        return hf[hp].chunk(2, 0)[r]
    if key.endswith(("o_proj.weight", "down_proj.weight")):
        return hf[hp].chunk(2, 1)[r]
    if key.endswith("qkv_proj.weight"):
        pre = hp[: -len("qkv_proj.weight")]
        d, g = c["hidden"] // c["heads"], c["groups"]
        q, k, v = (hf[pre + f"{x}_proj.weight"] for x in "qkv")
        per = c["heads"] // g
        groups = [torch.cat([q[i * per * d:(i + 1) * per * d], k[i * d:(i + 1) * d], v[i * d:(i + 1) * d]])
                  for i in range(g)]
        return torch.cat(groups[r * g // 2:(r + 1) * g // 2])
    if key.endswith("gate_up_proj.weight"):
        pre = hp[: -len("gate_up_proj.weight")]
        return torch.cat([hf[pre + "gate_proj.weight"].chunk(2, 0)[r], hf[pre + "up_proj.weight"].chunk(2, 0)[r]])
    return hf[hp]


def check_tp2(out: Path, hf: dict, c: dict) -> bool:
    """Every tensor of the two rank files ``oarlock convert --tp 2`` wrote (read with safetensors, not oarlock)
    equals :func:`tp2_reference`, and every HF tensor reached the output."""
    import torch
    from safetensors import safe_open

    seen = set()
    for r in range(2):
        with safe_open(str(out / f"rank-{r:05d}.safetensors"), "pt") as f:
            for key in f.keys():
                seen.add(key)
                if not torch.equal(f.get_tensor(key), tp2_reference(key, r, hf, c)):
                    return False
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj"}
    want = set()
    for k in hf:
        k = k.removeprefix("model.")
        for a, b in fused.items():
            k = k.replace(f".{a}.", f".{b}.")
        want.add(k)
    return seen == want


def part_convert(scratch: Path, args) -> list[str]:
    """Part 2: ``oarlock convert HF OUT --preset llama --tp 2`` (process wall time, source evicted from the page
    cache first, output removed between runs), and Megatron-Bridge's row from its install report."""
    c = CONFIGS[args.config]
    hf_dir, out = scratch / "hf", scratch / "hf-tp2"
    hf = hf_llama(hf_dir, c)
    cli = Path(sys.executable).with_name("oarlock")
    times = []
    for _ in range(args.reps):
        shutil.rmtree(out, ignore_errors=True)
        drop_file_cache(hf_dir)
        t0 = time.perf_counter()
        subprocess.run([str(cli), "convert", str(hf_dir), str(out), "--preset", "llama", "--tp", "2"], check=True,
                       stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    ok = check_tp2(out, hf, c)
    CHECKS.append(("convert", ok))
    mib = sum(t.numel() * 4 for t in hf.values()) / 2**20
    lines = [f"HF -> TP=2 ({mib:.0f} MiB of fp32 weights, {_shape(args.config)}), process wall time including "
             f"imports, source evicted from the page cache before each run, median of {args.reps}:", "",
             "| converter | median s | every run, s |", "|---|---:|---|",
             f"| `oarlock convert HF OUT --preset llama --tp 2` | {statistics.median(times):.3f} | "
             f"{' '.join(f'{t:.2f}' for t in times)} |", "",
             f"oarlock's TP=2 files equal the reference computed here from the HF tensors: {ok}", "",
             f"Megatron-Bridge: {bridge_status()}"]
    return lines


def bridge_status() -> str:
    """Why Megatron-Bridge has no row: scripts/megatron_bridge_env.sh's report, its "==" steps and the last error
    line of each failed step (or that the script was not run)."""
    report = ROOT / ".megatron-bridge-venv" / "install-report.txt"
    if not report.exists():
        return "not measured: run `bash scripts/megatron_bridge_env.sh` (it records whether it installs on CPU)."
    steps, last_error, package = [], "", ""
    for line in report.read_text(errors="replace").splitlines():
        if line.startswith("== "):
            if last_error and steps:
                steps[-1] += f" ({last_error})"
            steps.append(line[3:])
            last_error, package = "", ""
        elif line.startswith("Collecting "):
            package = line.split()[1]
        elif "Error" in line or "nvcc was not found" in line:
            text = "nvcc was not found" if "nvcc was not found" in line else line.strip()
            # indented: a package build's output inside pip's report, named by pip's last "Collecting" line
            last_error = f"{package}: {text}" if package and line[:1].isspace() else text
    if last_error and steps:
        steps[-1] += f" ({last_error})"
    if not BRIDGE_PY.exists() or subprocess.run([str(BRIDGE_PY), "-c", "from megatron.bridge import AutoBridge"],
                                                capture_output=True, timeout=300).returncode != 0:
        return "not measured: it does not install or import on this CPU-only machine. " + "; ".join(steps)
    return ("it imports here, but this benchmark has no Bridge runner yet (never tested on a machine where it "
            "imports). " + "; ".join(steps))


def part_tc(scratch: Path, args) -> list[str]:
    if not TC_PY.exists():
        return ["torch_checkpointing: skipped, .torch-checkpointing-venv is missing (bash "
                "scripts/torch_checkpointing_env.sh makes it)."]
    d = scratch / "tc"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    res = run_ranks(TC_PY, "tc", d, args, timeout=3600)
    CHECKS.append(("tc", all(res["ok"])))
    files = ", ".join(f"{lib} {b / 2**30:.3f} GiB" for lib, b in res["files_bytes"].items())
    return [f"torch_checkpointing {_version(TC_PY, 'torch-checkpointing')} (synchronous saver, DefaultResharder) "
            f"vs oarlock: the same state as DTensors (mesh dp2 x tp2, [Replicate(), Shard(tp axis)]; reshard: "
            f"[Shard(tp axis)] on 4 ranks); checkpoint files: {files} (torch_checkpointing writes every rank's "
            f"local tensors, replicas included, and never fsyncs them: its saves are not durable when they return, "
            f"oarlock's are). Neither reuses a save plan here. Median of {args.reps}, libraries rotated.", ""] + ratio_table(
        res["rows"], [("torch_checkpointing", "torch_checkpointing")]) + [
        "", f"Every load equal to the saved values, both libraries, every rank: {all(res['ok'])}"]


def _shape(config: str) -> str:
    c = CONFIGS[config]
    return (f"hidden {c['hidden']}, {c['layers']} layers, {c['heads']} heads / {c['groups']} KV groups, "
            f"ffn {c['ffn']}, vocab {c['vocab']}")


def _version(python: Path, dist_name: str) -> str:
    try:
        return subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version('{dist_name}'))"],
                              capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="full",
                    help="full: about 1 GiB of model + optimizer state; small: about 7 MiB (checks the script)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of every row (the median is reported, with the "
                    "min-max)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one, removed)")
    ap.add_argument("--smoke", action="store_true", help="--config small --reps 1: checks that every part runs")
    ap.add_argument("--parts", default="megatron,convert,tc",
                    help="comma-separated parts to run: megatron (1), convert (2), tc (3); default all")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # the per-rank entry (internal)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--part", default="megatron", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.config, args.reps = "small", 1
    if args.rank is not None:
        entry = {"megatron": megatron_rank, "tc": tc_rank}[args.part]
        entry(args.rank, args.port, args.dir, CONFIGS[args.config], args.reps)
        return 0
    scratch = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="oarlock-megatron-"))
    scratch.mkdir(parents=True, exist_ok=True)
    out = [f"Load average (1/5/15 min) at the start: {load_average()}", ""]
    try:
        for name in args.parts.split(","):
            out += ["", *{"megatron": part_megatron, "convert": part_convert, "tc": part_tc}[name](scratch, args)]
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)
    out += ["", f"Load average (1/5/15 min) at the end: {load_average()}"]
    print("\n".join(out))
    failed = [part for part, ok in CHECKS if not ok]
    if failed:
        print(f"byte check FAILED in part(s): {', '.join(failed)} (loaded or converted values differ from the "
              "saved ones)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
