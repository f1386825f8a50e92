"""A plain, readable single-device Llama / GQA decoder (dense or mixture-of-experts) for oarlock.

The model follows the Llama architecture (Touvron et al. 2023, arXiv 2302.13971): pre-norm decoder layers with
RMSNorm (Zhang & Sennrich 2019), rotary position embeddings (RoPE, Su et al. 2021, arXiv 2104.09864), grouped-query
attention (Ainslie et al. 2023, arXiv 2305.13245) and a SwiGLU MLP (Shazeer 2020, arXiv 2002.05202). The MoE variant
replaces the MLP with a softmax top-k router over N experts plus an optional sigmoid-gated shared expert (the
Mixtral / Qwen2-MoE formulation).

Two projections are fused, in AOA's layouts (docs/aoa.md, "Fused layouts"):

* ``self_attn.qkv_proj.weight`` ``[(H + 2G) * D, hidden]``: rows grouped per KV head ``g``:
  ``[Q_{gR} .. Q_{gR+R-1}, K_g, V_g]`` with ``R = H / G``, each piece ``D`` rows (AOA's ``fused_qkv`` with
  ``num_heads=H, num_key_value_groups=G, axis=0``). A contiguous row split over ``T`` ranks with ``T | G`` gives
  every rank whole KV groups, so column-parallel attention needs no re-layout.
* ``mlp.gate_up_proj.weight`` ``[2 * I, hidden]``: AOA's ``fused_ffn`` layout (``axis=0``). On a single device
  (tensor-parallel degree 1) this is ``[gate | up]``; a model made tensor parallel with degree ``T`` by
  :func:`oarlock.models.parallel.parallelize_llama` holds the degree-``T`` layout ``[gate_0, up_0, gate_1, up_1,
  ...]`` (``I / T`` rows per piece) so each rank's contiguous shard is its own ``[gate_r | up_r]``. Checkpoints
  written at one degree and loaded at another convert with ``X -> X, fused_ffn, axis=0``
  (:func:`tp_relayout_aoa_config`).

State-dict keys are the single-device names (``embed_tokens.weight``, ``layers.17.mlp.down_proj.weight``,
``layers.3.mlp.experts.5.gate_up_proj.weight``, ``norm.weight``, ``lm_head.weight``); layers and experts live in
``nn.ModuleDict`` s keyed by their global index, so pipeline stages and expert-parallel ranks that hold a subset
keep the same names. With tied embeddings there is no ``lm_head.weight`` key (as in HF checkpoints).

Attention goes through ``flashmask_attention`` with a causal document mask (FlashMask, arXiv 2410.01359) built
from per-token document ids, so packed documents never attend to each other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from oarlock.models.errors import ModelError

# --------------------------------------------------------------------------------------------------------------
# Attention: FlashMask (CPU tiled kernel, Triton on CUDA) with a column-wise start-row mask.
from oarlock.attention import (DEFAULT_CP_METHOD, ContextParallelPlan, causal_document_mask_from_ids,  # noqa: E402
                               context_parallel_flashmask_attention, flashmask_attention, shard_sequence)


def causal_document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Deprecated: use :func:`oarlock.attention.causal_document_mask_from_ids` (``causal_document_mask`` is the
    lengths-based constructor of :mod:`oarlock.attention`). Same result: int32 ``[B, 1, S, 1]``."""
    import warnings

    warnings.warn("oarlock.models.causal_document_mask(document_ids) is deprecated: use "
                  "oarlock.attention.causal_document_mask_from_ids", DeprecationWarning, stacklevel=2)
    if document_ids.dim() != 2:
        raise ModelError(f"document_ids must be [batch, seqlen], got shape {tuple(document_ids.shape)}")
    return causal_document_mask_from_ids(document_ids)


def document_position_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 at each document start: int64 ``[B, S]`` from ``document_ids`` ``[B, S]``."""
    b, s = document_ids.shape
    pos = torch.arange(s, device=document_ids.device).expand(b, s)
    first = torch.ones_like(document_ids, dtype=torch.bool)
    first[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start = torch.cummax(torch.where(first, pos, torch.zeros_like(pos)), dim=1).values
    return pos - start


# --------------------------------------------------------------------------------------------------------------
# Configuration.
@dataclass
class LlamaConfig:
    """Hyper-parameters of :class:`Llama` (field names follow HF's ``LlamaConfig`` / ``Qwen2MoeConfig``).

    ``num_experts == 0`` builds the dense model; ``num_experts > 0`` replaces every MLP with a top-k MoE block of
    ``num_experts`` experts of width ``moe_intermediate_size`` (default ``intermediate_size``) and, when
    ``shared_expert_intermediate_size > 0``, a sigmoid-gated shared expert. ``attention_bias`` puts biases on the
    q/k/v and output projections (HF Llama), ``qkv_bias`` on q/k/v only (Qwen2).
    """

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qkv_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelError(f"LlamaConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelError(f"LlamaConfig.num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ModelError(f"LlamaConfig.head_dim={self.head_dim} must be even for rotary embeddings")
        if self.num_experts < 0 or (self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts):
            raise ModelError(f"LlamaConfig: num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"[1, num_experts={self.num_experts}]")
        if self.num_experts and self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf(cls, hf: Any) -> "LlamaConfig":
        """From a transformers config (``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``, ``MixtralConfig``,
        ``Qwen2MoeConfig``) or its dict; Qwen2's q/k/v biases are set from its ``model_type``."""
        get = (lambda k, default=None: hf.get(k, default)) if isinstance(hf, Mapping) else \
            (lambda k, default=None: getattr(hf, k, default))
        rope = get("rope_parameters") or {}
        theta = rope.get("rope_theta", get("rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default":
            raise ModelError(f"HF config: rope_type {rope.get('rope_type')!r} is not supported (only 'default')")
        num_experts = get("num_local_experts") or get("num_experts") or 0
        return cls(
            vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"), num_hidden_layers=get("num_hidden_layers"),
            num_attention_heads=get("num_attention_heads"),
            num_key_value_heads=get("num_key_value_heads") or get("num_attention_heads"),
            head_dim=get("head_dim"), rms_norm_eps=float(get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            # Qwen2's config has no flag for the q/k/v biases every Qwen2 checkpoint carries
            attention_bias=bool(get("attention_bias", False)),
            qkv_bias=bool(get("qkv_bias", get("model_type") in ("qwen2", "qwen2_moe"))),
            num_experts=int(num_experts), num_experts_per_tok=int(get("num_experts_per_tok", 2) or 2),
            moe_intermediate_size=get("moe_intermediate_size") if num_experts else None,
            shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 0) or 0) if num_experts else 0,
            # Mixtral always renormalises the top-k weights; Qwen2-MoE has a flag.
            norm_topk_prob=bool(get("norm_topk_prob", True)),
        )

    @classmethod
    def smollm2_135m(cls) -> "LlamaConfig":
        """SmolLM2-135M: 30 layers, hidden 576, 9 heads, 3 KV heads, MLP 1536, vocab 49152, tied embeddings."""
        return cls(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                   tie_word_embeddings=True)


# --------------------------------------------------------------------------------------------------------------
# Fused-layout helpers (used by the converter, parallelize_llama and tests).
def qkv_fused_order(num_heads: int, num_kv_heads: int) -> list[tuple[str, int]]:
    """The ``fused_qkv`` piece order: ``[("q", 0), .., ("q", R-1), ("k", 0), ("v", 0), ("q", R), ..]``."""
    r = num_heads // num_kv_heads
    order: list[tuple[str, int]] = []
    for g in range(num_kv_heads):
        order += [("q", g * r + i) for i in range(r)] + [("k", g), ("v", g)]
    return order


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Interleave per-head row blocks of ``q`` ``[H*D, ...]``, ``k``/``v`` ``[G*D, ...]`` into ``fused_qkv``."""
    parts = {"q": q.chunk(num_heads, 0), "k": k.chunk(num_kv_heads, 0), "v": v.chunk(num_kv_heads, 0)}
    return torch.cat([parts[n][i] for n, i in qkv_fused_order(num_heads, num_kv_heads)], 0)


def split_qkv(fused: torch.Tensor, num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: ``(q [H*D, ...], k [G*D, ...], v [G*D, ...])``."""
    pieces = fused.chunk(num_heads + 2 * num_kv_heads, 0)
    out: dict[str, dict[int, torch.Tensor]] = {"q": {}, "k": {}, "v": {}}
    for piece, (n, i) in zip(pieces, qkv_fused_order(num_heads, num_kv_heads)):
        out[n][i] = piece
    return tuple(torch.cat([out[n][i] for i in sorted(out[n])], 0) for n in "qkv")  # type: ignore[return-value]


def ffn_fused_permutation(intermediate_size: int, tp: int) -> torch.Tensor:
    """Row indices mapping the degree-1 ``[gate | up]`` layout to the ``fused_ffn`` layout of degree ``tp``.

    ``fused_tp = fused_1[perm]``; rank ``r`` of ``tp`` then owns the contiguous rows ``[gate_r | up_r]``.
    """
    if intermediate_size % tp:
        raise ModelError(f"fused_ffn: intermediate size {intermediate_size} is not divisible by tp={tp}")
    w = intermediate_size // tp
    rows = [torch.arange(r * w, (r + 1) * w) + off for r in range(tp) for off in (0, intermediate_size)]
    return torch.cat(rows)


# --------------------------------------------------------------------------------------------------------------
# Modules.
class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * weight``, computed in fp32.

    Input ``[..., hidden]`` any float dtype; output same shape and dtype; ``weight`` ``[hidden]``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding tables (RoPE, arXiv 2104.09864) with the half-split ("rotate_half") pairing.

    ``forward(position_ids [B, S])`` returns ``(cos, sin)``, each fp32 ``[B, S, head_dim]``.
    """

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].to(torch.float32) * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, S, heads, D]`` by ``cos``/``sin`` ``[B, S, D]``; same shape and dtype."""
    cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Grouped-query self-attention with a fused ``qkv_proj`` (``fused_qkv`` layout) and ``o_proj``.

    The number of heads is read from the projection's output width, so the same code runs on a tensor-parallel
    rank that holds only some KV groups (``qkv_proj`` split by rows, ``o_proj`` by columns).
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.group_size = config.num_attention_heads // config.num_key_value_heads  # R query heads per KV head
        out = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, out, bias=config.attention_bias or config.qkv_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, config.hidden_size,
                                bias=config.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                startend_row_indices: torch.Tensor | None, cp: tuple[Any, Any] | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        r, d = self.group_size, self.head_dim
        qkv = self.qkv_proj(x).view(b, s, -1, r + 2, d)  # [B, S, local KV groups, R + 2, D]
        q = qkv[:, :, :, :r].reshape(b, s, -1, d)
        k, v = qkv[:, :, :, r], qkv[:, :, :, r + 1]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cp is not None:  # (plan, group, method): this rank's rows of a context-parallel sequence
            out = context_parallel_flashmask_attention(q, k, v, startend_row_indices, plan=cp[0], group=cp[1],
                                                       causal=True, method=cp[2])
        else:
            out = flashmask_attention(q, k, v, startend_row_indices, causal=True)
        return self.o_proj(out.reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward ``down(silu(gate(x)) * up(x))`` with fused ``gate_up_proj`` (``fused_ffn`` layout).

    The local ``gate_up_proj`` output is split in halves, which is right both for the degree-1 ``[gate | up]`` and
    for a tensor-parallel rank's ``[gate_r | up_r]``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class _EnterExpertParallel(torch.autograd.Function):
    """Identity forward on (tokens, routing weights); backward sums both gradients over the expert-parallel
    group (each rank's local experts contribute part of the gradient of these replicated inputs). One fused
    ``all_reduce``: two separate ones could run in a different order on ranks whose graphs differ."""

    @staticmethod
    def forward(ctx, tokens, weights, group):  # type: ignore[override]
        ctx.group = group
        ctx.shapes = (tokens.shape, weights.shape)
        ctx.kinds = ((tokens.dtype, tokens.device), (weights.dtype, weights.device))
        return tokens.view_as(tokens), weights.view_as(weights)

    @staticmethod
    def backward(ctx, g_tokens, g_weights):  # type: ignore[override]
        (ts, ws), ((tdt, tdev), (wdt, wdev)) = ctx.shapes, ctx.kinds
        g_tokens = torch.zeros(ts, dtype=tdt, device=tdev) if g_tokens is None else g_tokens
        g_weights = torch.zeros(ws, dtype=wdt, device=wdev) if g_weights is None else g_weights
        flat = torch.cat([g_tokens.reshape(-1), g_weights.reshape(-1).to(g_tokens.dtype)])
        torch.distributed.all_reduce(flat, group=ctx.group)
        n = g_tokens.numel()
        return flat[:n].view(ts), flat[n:].view(ws).to(g_weights.dtype), None


class _ExitExpertParallel(torch.autograd.Function):
    """Forward sums the partial expert outputs over the expert-parallel group; backward is the identity (the
    loss downstream is computed identically on every rank of the group)."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


class MoE(nn.Module):
    """Top-k mixture of experts (Mixtral / Qwen2-MoE formulation) with an optional sigmoid-gated shared expert.

    Router: ``p = softmax(x @ gate.weight.T)`` in fp32 over ``num_experts``; the ``k`` largest are kept
    (renormalised to sum 1 when ``norm_topk_prob``); output ``sum_k p_k * expert_k(x)``, plus
    ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` when a shared expert exists.

    Experts live in ``experts`` (``nn.ModuleDict`` keyed by the global expert index). Under expert parallelism
    (``ep_group`` set by :func:`oarlock.models.parallel.parallelize_llama`) a rank keeps only its experts, every
    rank of the group sees the same tokens, and the partial outputs are summed over the group; no token
    all-to-all is needed at these sizes, and the parameter layout is that of expert parallelism.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.num_experts = config.num_experts
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): MLP(config.hidden_size, config.moe_intermediate_size)
                                      for e in range(config.num_experts)})
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(config.hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = None
            self.shared_expert_gate = None
        self.ep_group: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.gate(flat).to(torch.float32), dim=-1)
        top_w, top_i = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(x.dtype)
        tokens = flat
        if self.ep_group is not None:
            tokens, top_w = _EnterExpertParallel.apply(flat, top_w, self.ep_group)
        out = torch.zeros_like(flat)
        for key, expert in self.experts.items():
            tok, slot = torch.where(top_i == int(key))
            if tok.numel():
                out = out.index_add(0, tok, expert(tokens[tok]) * top_w[tok, slot, None])
            else:  # keep the expert in the graph so every rank runs the same collectives (TP experts)
                out = out + 0.0 * expert(tokens[:0]).sum()
        if self.ep_group is not None:
            out = _ExitExpertParallel.apply(out, self.ep_group)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(shape)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``. Input/output ``[B, S, hidden]``."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config) if config.is_moe else MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, cos, sin, startend_row_indices, cp=None):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, startend_row_indices, cp)
        return h + self.mlp(self.post_attention_layernorm(h))


class Llama(nn.Module):
    """Llama / GQA causal language model (dense or MoE), single-device code.

    ``forward(x, *, position_ids=None, document_ids=None, startend_row_indices=None)``:

    * ``x``: int64 token ids ``[B, S]`` on the first pipeline stage (``embed_tokens`` present), otherwise the
      previous stage's hidden states ``[B, S, hidden]``.
    * ``document_ids`` ``[B, S]``: document of each token of a packed sequence; builds the causal document mask
      (:func:`oarlock.attention.causal_document_mask_from_ids`) and, unless ``position_ids`` is given, positions
      restarting per document.
    * ``startend_row_indices``: an explicit FlashMask mask (int32 ``[B, Hm, S, n]``); default plain causal.
    * ``cp_plan`` / ``cp_group``: context parallelism. ``x`` then holds only this rank's tokens (``plan.shard``),
      while ``document_ids``, ``startend_row_indices`` and ``position_ids`` stay **global** ``[B, S]`` (the mask
      and the RoPE positions of the local tokens are derived from them); the output covers the local tokens.
      ``cp_method``: ``"ring"`` or ``"allgather"`` (:func:`oarlock.attention.context_parallel_flashmask_attention`);
      None takes ``parallel_state.cp_method`` (set by ``parallelize_llama``), else the attention's default.
    * Returns logits ``[B, S, vocab]`` (dtype of the weights) on the last stage (``lm_head``/``norm`` present),
      else hidden states ``[B, S, hidden]``.

    Pipeline stages are built by :func:`oarlock.models.parallel.parallelize_llama`, which sets the modules a stage
    does not hold to ``None``.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config) for i in range(config.num_hidden_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_state_dict_post_hook(_drop_tied_head)
        self.register_load_state_dict_post_hook(_ignore_missing_tied_head)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Normal(0, std) for matrices and embeddings, ones for norms (the HF Llama initialisation)."""
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32) * std)

    def forward(self, x: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None,
                startend_row_indices: torch.Tensor | None = None, cp_plan: ContextParallelPlan | None = None,
                cp_group: Any = None, cp_method: str | None = None) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        b, s = h.shape[:2]
        if cp_plan is not None:
            s = cp_plan.seqlen
        if document_ids is not None:
            if startend_row_indices is None:
                startend_row_indices = causal_document_mask_from_ids(document_ids)
            if position_ids is None:
                position_ids = document_position_ids(document_ids)
        if position_ids is None:
            position_ids = torch.arange(s, device=h.device).expand(b, s)
        cp = None
        if cp_plan is not None:
            rank = torch.distributed.get_rank(cp_group) if torch.distributed.is_initialized() else 0
            position_ids = shard_sequence(cp_plan, position_ids, rank)
            if cp_method is None:
                cp_method = getattr(getattr(self, "parallel_state", None), "cp_method", DEFAULT_CP_METHOD)
            cp = (cp_plan, cp_group, cp_method)
        cos, sin = self.rotary(position_ids)
        for layer in self.layers.values():
            h = layer(h, cos, sin, startend_row_indices, cp)
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        return h


def _drop_tied_head(module: Llama, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    if module.config.tie_word_embeddings:
        state_dict.pop(prefix + "lm_head.weight", None)


def _ignore_missing_tied_head(module: Llama, incompatible: Any) -> None:
    if module.config.tie_word_embeddings and "lm_head.weight" in incompatible.missing_keys:
        incompatible.missing_keys.remove("lm_head.weight")


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross entropy: ``logits`` ``[B, S, V]`` predict ``labels`` ``[B, S]`` (already shifted,
    ``ignore_index`` where no target). Returns an fp32 scalar."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                           ignore_index=ignore_index)


# --------------------------------------------------------------------------------------------------------------
# HF <-> oarlock key mapping: AOA statements (for FlexCheckpoint) and a plain torch converter (the reference).
def _hf_table(config: LlamaConfig, prefix: str):
    """The preset table (``oarlock.checkpoint.aoa.presets``) and parameters describing ``config``'s HF checkpoints:
    Llama rows, plus Qwen2-MoE-style expert rows for an MoE config."""
    from dataclasses import replace

    from oarlock.checkpoint.aoa import presets as P

    arch = P.ARCHITECTURES["qwen2_moe" if config.is_moe else "llama"]
    features = set()
    if config.attention_bias or config.qkv_bias:
        features.add("qkv_bias")
    if config.attention_bias:
        features.add("o_bias")
    if not config.tie_word_embeddings:  # tied: HF files have no lm_head.weight and neither does Llama
        features.add("untied")
    if config.shared_expert_intermediate_size:
        features.add("shared_expert")
    params = P.Params(config.num_attention_heads, config.num_key_value_heads, frozenset(features))
    return replace(arch, prefix=prefix), params


def hf_aoa_config(config: LlamaConfig, *, prefix: str = "model.") -> list[str]:
    """AOA statements loading an HF Llama / Qwen2-MoE-style checkpoint (per-expert keys) into :class:`Llama`.

    Left of ``->`` are HF keys (``prefix`` = ``"model."`` for ``*ForCausalLM`` checkpoints), right the oarlock keys.
    HF and oarlock weights are both torch ``[out, in]``, so the fused macros run on ``axis=0`` and no ``^T`` is
    needed. The statements come from the declarative preset tables of :mod:`oarlock.checkpoint.aoa.presets` (the
    language: docs/aoa.md). Use with ``aoa_config_reverse=True`` or :func:`hf_export_aoa_config` for the other
    direction.
    """
    from oarlock.checkpoint.aoa.presets import statements

    return statements(*_hf_table(config, prefix))


def hf_export_aoa_config(config: LlamaConfig, *, prefix: str = "model.") -> list[str]:
    """AOA statements exporting :class:`Llama` keys to HF keys: the explicit inverse of :func:`hf_aoa_config`,
    generated from the same preset table rows."""
    from oarlock.checkpoint.aoa.presets import export_statements

    return export_statements(*_hf_table(config, prefix))


def tp_relayout_aoa_config(config: LlamaConfig) -> list[str]:
    """AOA statements for loading an oarlock checkpoint saved at one tensor-parallel degree into another: the
    ``fused_ffn`` gate/up layout depends on the degree (the ``fused_qkv`` layout does not)."""
    out = []
    if config.is_moe:
        out.append("layers.$LAYER_ID.mlp.experts.$EXPERT_ID.gate_up_proj.weight -> "
                   "layers.$LAYER_ID.mlp.experts.$EXPERT_ID.gate_up_proj.weight, fused_ffn, axis=0")
        if config.shared_expert_intermediate_size:
            out.append("layers.$LAYER_ID.mlp.shared_expert.gate_up_proj.weight -> "
                       "layers.$LAYER_ID.mlp.shared_expert.gate_up_proj.weight, fused_ffn, axis=0")
    else:
        out.append("layers.$LAYER_ID.mlp.gate_up_proj.weight -> layers.$LAYER_ID.mlp.gate_up_proj.weight, "
                   "fused_ffn, axis=0")
    return out


def _strip(hf_sd: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in hf_sd.items()}


def convert_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Plain-torch HF -> oarlock conversion (single-device layout): the reference for the AOA statements.

    Accepts HF Llama, Mixtral and Qwen2-MoE keys, with or without the ``model.`` prefix; MoE experts either as
    transformers-5 stacked tensors (``mlp.experts.gate_up_proj`` ``[E, 2I, hidden]``, ``mlp.experts.down_proj``
    ``[E, hidden, I]``) or per expert (``mlp.experts.<e>.gate_proj.weight``...). Rotary ``inv_freq`` buffers are
    ignored. Raises :class:`ModelError` naming missing or unused HF keys.
    """
    src = _strip(hf_sd, "model.")
    used: set[str] = set()

    def take(k: str) -> torch.Tensor:
        if k not in src:
            raise ModelError(f"convert_hf_state_dict: HF key {k!r} (or 'model.{k}') is missing")
        used.add(k)
        return src[k]

    h, g = config.num_attention_heads, config.num_key_value_heads
    out: dict[str, torch.Tensor] = {"embed_tokens.weight": take("embed_tokens.weight"),
                                    "norm.weight": take("norm.weight")}
    for i in range(config.num_hidden_layers):
        a, o = f"layers.{i}.self_attn", f"layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[f"{o}{n}.weight"] = take(f"{o}{n}.weight")
        out[f"{a}.qkv_proj.weight"] = fuse_qkv(take(f"{a}.q_proj.weight"), take(f"{a}.k_proj.weight"),
                                              take(f"{a}.v_proj.weight"), h, g)
        if config.attention_bias or config.qkv_bias:
            out[f"{a}.qkv_proj.bias"] = fuse_qkv(take(f"{a}.q_proj.bias"), take(f"{a}.k_proj.bias"),
                                                take(f"{a}.v_proj.bias"), h, g)
        out[f"{a}.o_proj.weight"] = take(f"{a}.o_proj.weight")
        if config.attention_bias:
            out[f"{a}.o_proj.bias"] = take(f"{a}.o_proj.bias")
        m = f"layers.{i}.mlp"
        if not config.is_moe:
            out[f"{m}.gate_up_proj.weight"] = torch.cat([take(f"{m}.gate_proj.weight"), take(f"{m}.up_proj.weight")])
            out[f"{m}.down_proj.weight"] = take(f"{m}.down_proj.weight")
            continue
        out[f"{m}.gate.weight"] = take(f"{m}.gate.weight")
        if f"{m}.experts.gate_up_proj" in src:  # transformers 5 stacked experts; gate then up along dim 1
            gu, dn = take(f"{m}.experts.gate_up_proj"), take(f"{m}.experts.down_proj")
            for e in range(config.num_experts):
                out[f"{m}.experts.{e}.gate_up_proj.weight"] = gu[e]
                out[f"{m}.experts.{e}.down_proj.weight"] = dn[e]
        else:
            for e in range(config.num_experts):
                x = f"{m}.experts.{e}"
                out[f"{x}.gate_up_proj.weight"] = torch.cat([take(f"{x}.gate_proj.weight"),
                                                             take(f"{x}.up_proj.weight")])
                out[f"{x}.down_proj.weight"] = take(f"{x}.down_proj.weight")
        if config.shared_expert_intermediate_size:
            x = f"{m}.shared_expert"
            out[f"{x}.gate_up_proj.weight"] = torch.cat([take(f"{x}.gate_proj.weight"), take(f"{x}.up_proj.weight")])
            out[f"{x}.down_proj.weight"] = take(f"{x}.down_proj.weight")
            out[f"{m}.shared_expert_gate.weight"] = take(f"{m}.shared_expert_gate.weight")
    if "lm_head.weight" in src:
        used.add("lm_head.weight")
        if not config.tie_word_embeddings:
            out["lm_head.weight"] = src["lm_head.weight"]
    elif not config.tie_word_embeddings:
        take("lm_head.weight")
    unused = sorted(k for k in set(src) - used if not k.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ModelError(f"convert_hf_state_dict: HF keys not used by the config: {unused[:8]}"
                         f"{' ...' if len(unused) > 8 else ''}")
    return out


def to_hf_state_dict(sd: Mapping[str, torch.Tensor], config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Plain-torch oarlock (single-device layout) -> HF ``*ForCausalLM`` keys; MoE experts per expert
    (``model.layers.<i>.mlp.experts.<e>.gate_proj.weight``...). Inverse of :func:`convert_hf_state_dict`."""
    h, g, p = config.num_attention_heads, config.num_key_value_heads, "model."
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k.endswith("self_attn.qkv_proj.weight") or k.endswith("self_attn.qkv_proj.bias"):
            base, kind = k.rsplit(".qkv_proj.", 1)
            for name, t in zip(("q_proj", "k_proj", "v_proj"), split_qkv(v, h, g)):
                out[f"{p}{base}.{name}.{kind}"] = t
        elif k.endswith("gate_up_proj.weight"):
            base = k[: -len("gate_up_proj.weight")]
            gate, up = v.chunk(2, 0)
            out[f"{p}{base}gate_proj.weight"], out[f"{p}{base}up_proj.weight"] = gate, up
        elif k == "lm_head.weight":
            out[k] = v
        else:
            out[p + k] = v
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out
