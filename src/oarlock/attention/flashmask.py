"""``flashmask_attention``: the one public attention entry point, its custom op and autograd.

The Python function validates its inputs (errors name the argument, the expected and the actual
shape/dtype), turns ``window_size`` and the index tensor into the canonical ``[LTS, LTE, UTS, UTE]`` form and
calls the ``oarlock::flashmask_forward`` custom op. The op has a fake (meta) implementation and a registered
backward (``oarlock::flashmask_backward``, itself a custom op), so ``torch.compile(fullgraph=True)`` traces through it
without graph breaks. The op picks the back end by device: CUDA with Triton -> :mod:`.triton_kernels`, CPU ->
:mod:`.cpu` (tiled), anything else -> :mod:`.reference`.
"""

from __future__ import annotations

import math
import weakref
from typing import Optional

import torch

from oarlock.attention import cpu as _cpu
from oarlock.attention.errors import AttentionInputError
from oarlock.attention.masks import canonicalize, dense_keep_rows, window_to_indices
from oarlock.attention.reference import attention_reference

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _triton_usable(t: torch.Tensor) -> bool:
    if not t.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _reference_backward(grad_out, grad_lse, query, key, value, canon, causal, scale, block_mask):
    with torch.enable_grad():
        q, k, v = (x.detach().requires_grad_(True) for x in (query, key, value))
        out, lse = attention_reference(q, k, v, canon, causal=causal, softmax_scale=scale, block_mask=block_mask)
        if grad_lse is None:
            return torch.autograd.grad(out, (q, k, v), grad_out, allow_unused=True)
        lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # fully masked rows: no gradient
        return torch.autograd.grad((out, lse), (q, k, v), (grad_out, grad_lse), allow_unused=True)


@torch.library.custom_op("oarlock::flashmask_forward", mutates_args=())
def _flashmask_fwd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, canon: Optional[torch.Tensor],
                   block_mask: Optional[torch.Tensor], causal: bool, scale: float, dropout: float,
                   seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if _triton_usable(query):
        from oarlock.attention import triton_kernels

        return triton_kernels.forward(query, key, value, canon, causal=causal, scale=scale, block_mask=block_mask)
    if query.device.type == "cpu":
        return _cpu.forward(query, key, value, canon, causal=causal, scale=scale, block_mask=block_mask,
                            dropout=dropout, seed=int(seed))
    with torch.no_grad():
        return attention_reference(query, key, value, canon, causal=causal, softmax_scale=scale,
                                   block_mask=block_mask)


@_flashmask_fwd.register_fake
def _(query, key, value, canon, block_mask, causal, scale, dropout, seed):
    b, sq, h, _ = query.shape
    return (query.new_empty(b, sq, h, value.shape[-1]),
            query.new_empty(b, h, sq, dtype=torch.float32))


@torch.library.custom_op("oarlock::flashmask_backward", mutates_args=())
def _flashmask_bwd(grad_out: torch.Tensor, grad_lse: Optional[torch.Tensor], query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, canon: Optional[torch.Tensor],
                   block_mask: Optional[torch.Tensor], causal: bool, scale: float, dropout: float,
                   seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _triton_usable(query):
        from oarlock.attention import triton_kernels

        return triton_kernels.backward(grad_out, query, key, value, out, lse, canon, causal=causal, scale=scale,
                                       block_mask=block_mask, grad_lse=grad_lse)
    if query.device.type == "cpu":
        return _cpu.backward(grad_out, query, key, value, out, lse, canon, causal=causal, scale=scale,
                             block_mask=block_mask, dropout=dropout, seed=int(seed), grad_lse=grad_lse)
    dq, dk, dv = _reference_backward(grad_out, grad_lse, query, key, value, canon, causal, scale, block_mask)
    return (dq if dq is not None else torch.zeros_like(query), dk if dk is not None else torch.zeros_like(key),
            dv if dv is not None else torch.zeros_like(value))


@_flashmask_bwd.register_fake
def _(grad_out, grad_lse, query, key, value, out, lse, canon, block_mask, causal, scale, dropout, seed):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output):
    query, key, value, canon, block_mask, causal, scale, dropout, seed = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, canon, block_mask, seed)
    ctx.causal, ctx.scale, ctx.dropout = causal, scale, dropout


def _backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, canon, block_mask, seed = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = _flashmask_bwd(grad_out.contiguous(), grad_lse, query, key, value, out, lse, canon, block_mask,
                                ctx.causal, ctx.scale, ctx.dropout, seed)
    return dq, dk, dv, None, None, None, None, None, None


torch.library.register_autograd("oarlock::flashmask_forward", _backward, setup_context=_setup_context)


def kernel_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, canon: torch.Tensor | None, *,
                   causal: bool, scale: float, dropout: float = 0.0,
                   seed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The back-end forward of :func:`flashmask_attention` without autograd or input checks, for callers that
    run their own autograd (context parallelism): CUDA -> Triton, CPU -> tiled kernel, else dense reference.

    ``canon``: int64 ``[B, Hm, Sk, 4]`` canonical indices (:func:`~oarlock.attention.masks.canonicalize`) with
    ``Hm`` 1 or ``kv_heads``; ``seed``: int64 ``[1]`` (dropout masks). Returns ``(out [B, Sq, H, Dv], lse float32
    [B, H, Sq])``."""
    seed = torch.zeros(1, dtype=torch.int64) if seed is None else seed
    with torch.no_grad():
        return _flashmask_fwd(query, key, value, canon, None, causal, scale, float(dropout), seed)


def kernel_backward(grad_out: torch.Tensor, grad_lse: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, canon: torch.Tensor | None, *,
                    causal: bool, scale: float, dropout: float = 0.0,
                    seed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The back-end backward matching :func:`kernel_forward`: ``(dq, dk, dv)`` shaped like ``query, key, value``
    (``grad_lse``: optional float ``[B, H, Sq]``, the gradient of the returned log-sum-exp)."""
    seed = torch.zeros(1, dtype=torch.int64) if seed is None else seed
    with torch.no_grad():
        return _flashmask_bwd(grad_out.contiguous(), grad_lse, query, key, value, out, lse, canon, None, causal,
                              scale, float(dropout), seed)


def _check(cond: bool, msg) -> None:
    """Raise :class:`AttentionInputError` with ``msg`` (a string, or a callable building it: messages are formatted
    only on failure, since every call validates its inputs) unless ``cond``."""
    if not cond:
        raise AttentionInputError(msg() if callable(msg) else msg)


#: More heads than any attention model has: a "heads" dimension this large is a sequence dimension.
_MAX_PLAUSIBLE_HEADS = 1024


def _check_layout(query, key, idx) -> None:
    """Catch SDPA-layout ``[B, H, S, D]`` tensors passed where ``[B, S, H, D]`` is expected: they run without a
    shape error (heads and sequence swap roles) and give a plausible but wrong result."""
    sdpa = ("looks like the SDPA layout [batch, heads, seqlen, head_dim]; flashmask_attention takes "
            "[batch, seqlen, heads, head_dim]: pass query.transpose(1, 2) (and the same for key and value)")
    if isinstance(idx, torch.Tensor) and idx.dim() == 4 and idx.shape[2] != key.shape[1] \
            and idx.shape[2] == key.shape[2]:
        raise AttentionInputError(f"key shape {tuple(key.shape)} with startend_row_indices over "
                                  f"{idx.shape[2]} keys {sdpa}")
    if query.shape[2] > _MAX_PLAUSIBLE_HEADS and query.shape[1] < query.shape[2]:
        raise AttentionInputError(f"query shape {tuple(query.shape)} has {query.shape[2]} 'heads' and "
                                  f"{query.shape[1]} 'positions': it {sdpa}")


def _validate(query, key, value, startend_row_indices, causal, window_size, dropout, block_mask):
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check(isinstance(t, torch.Tensor), lambda: f"{name} must be a torch.Tensor, got {type(t).__name__}")
        _check(t.dim() == 4, lambda: f"{name} must be 4-D [batch, seqlen, heads, head_dim], got shape {tuple(t.shape)}")
        _check(t.dtype in _FLOATS, lambda: f"{name} dtype must be float32, float16 or bfloat16, got {t.dtype}")
    b, sq, h, d = query.shape
    _check_layout(query, key, startend_row_indices)
    _check(key.dtype == query.dtype and value.dtype == query.dtype,
           lambda: f"query, key, value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    _check(key.device == query.device and value.device == query.device,
           lambda: f"query, key, value must be on one device, got {query.device}, {key.device}, {value.device}")
    _check(key.shape[0] == b and key.shape[3] == d,
           lambda: f"key must be [batch={b}, seqlen_k, kv_heads, head_dim={d}], got shape {tuple(key.shape)}")
    sk, hk = key.shape[1], key.shape[2]
    _check(value.shape[:3] == key.shape[:3],
           lambda: f"value must be [batch={b}, seqlen_k={sk}, kv_heads={hk}, head_dim_v], got shape "
           f"{tuple(value.shape)}")
    _check(hk > 0 and h % hk == 0, lambda: f"query heads ({h}) must be a multiple of key/value heads ({hk})")
    _check(0.0 <= dropout < 1.0, lambda: f"dropout must be in [0, 1), got {dropout}")
    if startend_row_indices is not None:
        idx = startend_row_indices
        _check(isinstance(idx, torch.Tensor),
               lambda: f"startend_row_indices must be a torch.Tensor, got {type(idx).__name__}")
        _check(idx.dtype == torch.int32, lambda: f"startend_row_indices dtype must be int32, got {idx.dtype}")
        allowed = (1, 2) if causal else (2, 4)
        heads = tuple(sorted({1, hk, h}))
        _check(idx.dim() == 4 and idx.shape[0] == b and idx.shape[1] in heads and idx.shape[2] == sk
               and idx.shape[3] in allowed,
               lambda: f"startend_row_indices must be [batch={b}, mask_heads in {heads}, seqlen_k={sk}, "
               f"n in {allowed}] for causal={causal}, got shape {tuple(idx.shape)}")
        _check(idx.device == query.device,
               lambda: f"startend_row_indices must be on {query.device}, got {idx.device}")
        _check(window_size is None, "window_size cannot be combined with startend_row_indices")
    if block_mask is not None:
        _check(startend_row_indices is not None, "block_mask must be given together with startend_row_indices")
        hm = startend_row_indices.shape[1]
        _check(hm in (1, hk),
               lambda: f"block_mask needs startend_row_indices with 1 or kv_heads={hk} mask heads, got {hm}")
        want = (b, hm, -(-sq // 128), -(-sk // 128))
        _check(isinstance(block_mask, torch.Tensor) and tuple(block_mask.shape) == want
               and block_mask.dtype == torch.int32,
               lambda: f"block_mask must be int32 of shape {want} (128x128 tiles), got "
               f"{getattr(block_mask, 'dtype', type(block_mask))} {tuple(getattr(block_mask, 'shape', ()))}")


def flashmask_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        startend_row_indices: torch.Tensor | None = None, *, causal: bool = False,
                        window_size: int | tuple[int, int] | None = None, softmax_scale: float | None = None,
                        dropout: float = 0.0, return_softmax_lse: bool = False,
                        block_mask: torch.Tensor | None = None):
    """FlashMask attention (PaddlePaddle ``flashmask_attention``; FlashMask paper arXiv 2410.01359).

    Args:
        query: ``[batch, seqlen_q, heads, head_dim]``, float32/float16/bfloat16.
        key: ``[batch, seqlen_k, kv_heads, head_dim]``; ``heads % kv_heads == 0`` (GQA/MQA).
        value: ``[batch, seqlen_k, kv_heads, head_dim_v]``.
        startend_row_indices: int32 ``[batch, mask_heads, seqlen_k, n]``, ``mask_heads`` 1, ``kv_heads`` or ``heads``,
            ``n`` 1 or 2 when ``causal`` else 2 or 4: for each key the query rows that may not see it (see
            :mod:`oarlock.attention.masks` for the exact semantics and one constructor per mask type). None = no
            mask besides ``causal``/``window_size``.
        causal: also mask keys ``j > i + seqlen_k - seqlen_q`` (bottom-right aligned, as FlashAttention >= 2.1).
        window_size: ``int`` or ``(left, right)``: query ``i`` sees keys ``[i - left, i + right]`` (``right``
            ignored when causal); converted into indices, so not combinable with ``startend_row_indices``.
        softmax_scale: scale of ``Q K^T``, default ``1 / sqrt(head_dim)``.
        dropout: probability of dropping a normalised attention weight (training; inverted dropout, masks drawn
            from torch's global RNG). On CPU the tiled kernel redraws the masks in the backward from a saved seed;
            on other devices non-zero dropout runs the dense reference back end.
        return_softmax_lse: also return the log-sum-exp of the scaled, masked scores (differentiable: attention
            sinks and context parallelism combine partial results through it).
        block_mask: optional int32 ``[batch, mask_heads, ceil(seqlen_q/128), ceil(seqlen_k/128)]``; 0 drops a
            whole 128x128 tile (ANDed with the index mask, as FlashMask V3).

    Returns:
        ``out`` ``[batch, seqlen_q, heads, head_dim_v]`` in the query dtype; with ``return_softmax_lse`` the
        tuple ``(out, lse)``, lse float32 ``[batch, heads, seqlen_q]`` (natural log; differentiable: a loss on
        ``lse`` sends gradients into ``query`` and ``key``). Query rows that see no key give output 0, gradient 0
        and lse ``-inf`` (no NaN).

    Differentiable in ``query``, ``key`` and ``value``. Back end by device: CPU -> tiled kernel that skips fully
    masked tiles (:mod:`oarlock.attention.cpu`), or SDPA with the dense mask when ``Sq * Sk`` is at most
    :data:`DENSE_DISPATCH_MAX_SCORES` (too few tiles for skipping to pay); CUDA -> Triton kernel; other devices ->
    dense reference. Mask semantics, recipes and tile skipping: ``docs/flashmask.md``.

    Raises:
        AttentionInputError: a bad shape, dtype, device or argument, naming the argument, expected and actual.
    """
    _validate(query, key, value, startend_row_indices, causal, window_size, dropout, block_mask)
    b, sq, h, d = query.shape
    sk = key.shape[1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    idx = startend_row_indices
    if window_size is not None:
        idx = window_to_indices(window_size, causal=causal, batch_size=b, seqlen_q=sq, seqlen_k=sk,
                                device=query.device)
    if query.numel() == 0 or key.numel() == 0 or value.numel() == 0:
        # Zero-size inputs: nothing to attend; keep the graph so backward gives zero gradients.
        zero = (query.sum() + key.sum() + value.sum()) * 0
        out = query.new_zeros(b, sq, h, value.shape[-1]) + zero.to(query.dtype)
        lse = torch.full((b, h, sq), float("-inf"), device=query.device)
        return (out, lse) if return_softmax_lse else out
    key, value = expand_kv_for_mask_heads(key, value, idx, h)  # needs only the mask-head count
    if _use_dense(query, key, value, return_softmax_lse, dropout):
        # a cached mask skips canonicalising the indices too: at small S every step of this path shows
        mask = _DENSE_MASKS.lookup(startend_row_indices, block_mask, (causal, sq, sk, h, query.device))
        canon = None
        if mask is None:
            canon = canonicalize(idx, causal=causal, seqlen_q=sq) if idx is not None else None
            mask = _DENSE_MASKS.store(startend_row_indices, block_mask, (causal, sq, sk, h, query.device),
                                      dense_sdpa_mask(canon, sq, sk, h, causal=causal, block_mask=block_mask,
                                                      device=query.device))
        return dense_attention(query, key, value, canon, causal=causal, scale=scale, block_mask=block_mask,
                               mask=mask)
    canon = canonicalize(idx, causal=causal, seqlen_q=sq) if idx is not None else None
    if dropout > 0.0 and query.device.type != "cpu":
        # the Triton kernels have no dropout: dense reference, autograd through it
        out, lse = attention_reference(query, key, value, canon, causal=causal, softmax_scale=scale,
                                       block_mask=block_mask, dropout=dropout)
    else:
        # dropout masks are drawn from this seed (from torch's global RNG) and redrawn in the backward
        seed = (torch.randint(0, 2 ** 62, (1,)) if dropout > 0.0 else torch.zeros(1, dtype=torch.int64))
        out, lse = _flashmask_fwd(query, key, value, canon, block_mask, causal, scale, float(dropout), seed)
    return (out, lse) if return_softmax_lse else out


def expand_kv_for_mask_heads(key: torch.Tensor, value: torch.Tensor, canon: torch.Tensor | None,
                             heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``canon``: the mask indices (canonical or not: only the mask-head count, dimension 1, is read). A mask
    with one head per *query* head (``Hm == H > Hk``, Paddle issue 77469) gives each query head of a
    GQA group its own mask; the kernels share one mask per KV head, so K/V are repeated to ``H`` heads (autograd
    sums the gradients back over each group). Returns ``key, value`` unchanged otherwise."""
    hk = key.shape[2]
    if canon is None or canon.shape[1] == hk or canon.shape[1] == 1 or canon.shape[1] != heads:
        return key, value
    g = heads // hk
    return key.repeat_interleave(g, dim=2), value.repeat_interleave(g, dim=2)


#: Score-matrix size ``Sq * Sk`` up to which CPU attention runs SDPA with a dense mask instead of the tiled
#: kernel: at these sizes there are too few tiles for skipping to pay for the per-block work. Measured with
#: ``benchmarks/flashmask_cpu.py`` (its "tiled kernel alone" column): on 4 heads of 64 the tiled kernel wins from
#: S = 1024 on, SDPA with the dense mask below.
DENSE_DISPATCH_MAX_SCORES = 768 * 768


#: Largest dense mask (bytes as float32) kept in SDPA's additive form; larger ones stay bool (4x smaller).
ADDITIVE_MASK_MAX_BYTES = 64 * 1024 * 1024


def _use_dense(query, key, value, return_softmax_lse: bool, dropout: float) -> bool:
    if (query.device.type != "cpu" or return_softmax_lse or dropout > 0.0
            or query.shape[1] * key.shape[1] > DENSE_DISPATCH_MAX_SCORES or torch.compiler.is_compiling()):
        return False
    # Non-finite K/V must stay isolated by the mask, which SDPA's dense mask does not do (0 * inf = NaN in the
    # backward). A sum is one read pass; NaN/inf propagate through it. A finite tensor whose sum overflows only
    # sends the call to the tiled kernel, which is also correct.
    with torch.no_grad():
        return math.isfinite(float(key.sum(dtype=torch.float32) + value.sum(dtype=torch.float32)))


class _DenseMaskCache:
    """The last few dense masks built from index tensors, so that the layers of a model, which share one
    ``startend_row_indices`` tensor per batch, build the ``O(Sq * Sk)`` mask once (as a caller of SDPA with a
    dense mask would). An entry holds a weak reference to its index tensor and that tensor's version counter:
    it dies with the tensor and is never used after an in-place change. Inference tensors (no version counter)
    and calls without index tensors are not cached."""

    def __init__(self, size: int = 4):
        self.size = size
        self.entries: list[tuple] = []

    @staticmethod
    def _stamp(t: torch.Tensor | None):
        if t is None:
            return None
        if t.is_inference():
            raise LookupError
        return weakref.ref(t), t._version

    def lookup(self, idx, block_mask, params) -> "tuple | None":
        if idx is None:
            return None
        for ref, ver, bm, p, mask in self.entries:
            if ref() is idx and ver == idx._version and p == params and not idx.is_inference() and \
                    (bm is None if block_mask is None else (bm[0]() is block_mask and bm[1] == block_mask._version)):
                return mask
        return None

    def store(self, idx, block_mask, params, mask: tuple) -> tuple:
        if idx is None:
            return mask
        try:
            ref, ver = self._stamp(idx)
            bm = self._stamp(block_mask)
        except LookupError:
            return mask
        self.entries = [(ref, ver, bm, params, mask)] + [e for e in self.entries if e[0]() is not None]
        del self.entries[self.size:]
        return mask


_DENSE_MASKS = _DenseMaskCache()


def dense_sdpa_mask(canon: torch.Tensor | None, sq: int, sk: int, heads: int, *, causal: bool,
                    block_mask: torch.Tensor | None, device: torch.device) -> tuple:
    """``(keep, seen)`` for SDPA: ``keep`` ``[B or 1, heads or 1, Sq, Sk]``, float32 additive (0 = attend,
    ``-inf`` = masked) when it takes at most :data:`ADDITIVE_MASK_MAX_BYTES`, else bool (True = attend); rows that
    see no key may attend everything, as SDPA would give NaN there. ``seen`` bool ``[B, H, Sq, 1]`` (rows that
    see a key) or None when every row sees one. Used with float32 queries (the dense path computes in fp32)."""
    from oarlock.attention.reference import expand_block_mask

    rows = torch.arange(sq, device=device)
    if canon is not None:
        keep = dense_keep_rows(canon, rows, None, causal=causal, seqlen_q=sq)
    else:
        keep = torch.ones(1, 1, sq, sk, dtype=torch.bool, device=device)
        if causal:
            keep = keep & (torch.arange(sk, device=device) <= rows.view(-1, 1) + (sk - sq))
    if block_mask is not None:
        keep = keep & expand_block_mask(block_mask, sq, sk, rows)
    if keep.shape[1] > 1:
        keep = keep.repeat_interleave(heads // keep.shape[1], dim=1)
    seen = keep.any(-1, keepdim=True)  # rows that see at least one key
    if not bool(seen.all()):
        keep = keep | ~seen
    else:
        seen = None
    if keep.numel() * 4 <= ADDITIVE_MASK_MAX_BYTES:
        # SDPA turns a bool mask into this additive one on every call (two `where` passes over S^2): a mask built
        # once and cached is cheaper to hand over ready
        keep = torch.zeros(keep.shape, dtype=torch.float32, device=device).masked_fill_(~keep, float("-inf"))
    return keep, seen


def _sdpa_with_mask(query, key, value, mask: tuple, scale: float) -> torch.Tensor:
    keep, seen = mask
    h, hk = query.shape[2], key.shape[2]
    q, k, v = (x.transpose(1, 2).float() for x in (query, key, value))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale,
                                                           enable_gqa=hk != h)
    if seen is not None:  # rows that see no key: exactly 0, and zero gradient
        out = torch.where(seen, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out.transpose(1, 2).to(query.dtype)


def dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, canon: torch.Tensor | None, *,
                    causal: bool, scale: float, block_mask: torch.Tensor | None = None,
                    mask: tuple | None = None) -> torch.Tensor:
    """FlashMask attention through ``torch.nn.functional.scaled_dot_product_attention`` with the dense boolean
    mask (the fast path for small sequences). Same shapes and results as :func:`flashmask_attention` without
    dropout: fp32 math, output in the query dtype, rows that see no key give exactly 0 with zero gradient.
    Memory ``O(B * Hm * Sq * Sk)`` bytes for the mask; ``mask``: a prebuilt :func:`dense_sdpa_mask` result."""
    if mask is not None:
        return _sdpa_with_mask(query, key, value, mask, scale)
    b, sq, h, _ = query.shape
    mask = dense_sdpa_mask(canon, sq, key.shape[1], h, causal=causal, block_mask=block_mask, device=query.device)
    return _sdpa_with_mask(query, key, value, mask, scale)
