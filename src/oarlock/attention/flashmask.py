"""``flashmask_attention``: the one public attention entry point, its custom op and autograd.

The Python function validates its inputs (errors name the argument, the expected and the actual
shape/dtype), turns ``window_size`` and the index tensor into the canonical ``[LTS, LTE, UTS, UTE]`` form and
calls the ``oarlock::flashmask_fwd`` custom op. The op has a fake (meta) implementation and a registered
backward (``oarlock::flashmask_bwd``, itself a custom op), so ``torch.compile(fullgraph=True)`` traces through it
without graph breaks. The op picks the back end by device: CUDA with Triton -> :mod:`.triton_kernels`, CPU ->
:mod:`.cpu` (tiled), anything else -> :mod:`.reference`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from oarlock.attention import cpu as _cpu
from oarlock.attention.errors import AttentionInputError
from oarlock.attention.masks import canonicalize, window_to_indices
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


def _reference_backward(grad_out, query, key, value, canon, causal, scale, block_mask):
    with torch.enable_grad():
        q, k, v = (x.detach().requires_grad_(True) for x in (query, key, value))
        out, _ = attention_reference(q, k, v, canon, causal=causal, softmax_scale=scale, block_mask=block_mask)
        return torch.autograd.grad(out, (q, k, v), grad_out)


@torch.library.custom_op("oarlock::flashmask_fwd", mutates_args=())
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


@torch.library.custom_op("oarlock::flashmask_bwd", mutates_args=())
def _flashmask_bwd(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, canon: Optional[torch.Tensor],
                   block_mask: Optional[torch.Tensor], causal: bool, scale: float, dropout: float,
                   seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _triton_usable(query):
        from oarlock.attention import triton_kernels

        return triton_kernels.backward(grad_out, query, key, value, out, lse, canon, causal=causal, scale=scale,
                                       block_mask=block_mask)
    if query.device.type == "cpu":
        return _cpu.backward(grad_out, query, key, value, out, lse, canon, causal=causal, scale=scale,
                             block_mask=block_mask, dropout=dropout, seed=int(seed))
    return _reference_backward(grad_out, query, key, value, canon, causal, scale, block_mask)


@_flashmask_bwd.register_fake
def _(grad_out, query, key, value, out, lse, canon, block_mask, causal, scale, dropout, seed):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output):
    query, key, value, canon, block_mask, causal, scale, dropout, seed = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, canon, block_mask, seed)
    ctx.causal, ctx.scale, ctx.dropout = causal, scale, dropout


def _backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, canon, block_mask, seed = ctx.saved_tensors
    dq, dk, dv = _flashmask_bwd(grad_out.contiguous(), query, key, value, out, lse, canon, block_mask,
                                ctx.causal, ctx.scale, ctx.dropout, seed)
    return dq, dk, dv, None, None, None, None, None, None


torch.library.register_autograd("oarlock::flashmask_fwd", _backward, setup_context=_setup_context)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise AttentionInputError(msg)


def _validate(query, key, value, startend_row_indices, causal, window_size, dropout, block_mask):
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
        _check(t.dim() == 4, f"{name} must be 4-D [batch, seqlen, heads, head_dim], got shape {tuple(t.shape)}")
        _check(t.dtype in _FLOATS, f"{name} dtype must be float32, float16 or bfloat16, got {t.dtype}")
    b, sq, h, d = query.shape
    _check(key.dtype == query.dtype and value.dtype == query.dtype,
           f"query, key, value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    _check(key.device == query.device and value.device == query.device,
           f"query, key, value must be on one device, got {query.device}, {key.device}, {value.device}")
    _check(key.shape[0] == b and key.shape[3] == d,
           f"key must be [batch={b}, seqlen_k, kv_heads, head_dim={d}], got shape {tuple(key.shape)}")
    sk, hk = key.shape[1], key.shape[2]
    _check(value.shape[:3] == key.shape[:3],
           f"value must be [batch={b}, seqlen_k={sk}, kv_heads={hk}, head_dim_v], got shape {tuple(value.shape)}")
    _check(hk > 0 and h % hk == 0, f"query heads ({h}) must be a multiple of key/value heads ({hk})")
    _check(0.0 <= dropout < 1.0, f"dropout must be in [0, 1), got {dropout}")
    if startend_row_indices is not None:
        idx = startend_row_indices
        _check(isinstance(idx, torch.Tensor), f"startend_row_indices must be a torch.Tensor, got {type(idx).__name__}")
        _check(idx.dtype == torch.int32, f"startend_row_indices dtype must be int32, got {idx.dtype}")
        allowed = (1, 2) if causal else (2, 4)
        _check(idx.dim() == 4 and idx.shape[0] == b and idx.shape[1] in (1, hk) and idx.shape[2] == sk
               and idx.shape[3] in allowed,
               f"startend_row_indices must be [batch={b}, mask_heads in (1, {hk}), seqlen_k={sk}, n in {allowed}] "
               f"for causal={causal}, got shape {tuple(idx.shape)}")
        _check(idx.device == query.device,
               f"startend_row_indices must be on {query.device}, got {idx.device}")
        _check(window_size is None, "window_size cannot be combined with startend_row_indices")
    if block_mask is not None:
        _check(startend_row_indices is not None, "block_mask must be given together with startend_row_indices")
        hm = startend_row_indices.shape[1]
        want = (b, hm, -(-sq // 128), -(-sk // 128))
        _check(isinstance(block_mask, torch.Tensor) and tuple(block_mask.shape) == want
               and block_mask.dtype == torch.int32,
               f"block_mask must be int32 of shape {want} (128x128 tiles), got "
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
        startend_row_indices: int32 ``[batch, mask_heads, seqlen_k, n]``, ``mask_heads`` 1 or ``kv_heads``,
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
        return_softmax_lse: also return the log-sum-exp of the scaled, masked scores.
        block_mask: optional int32 ``[batch, mask_heads, ceil(seqlen_q/128), ceil(seqlen_k/128)]``; 0 drops a
            whole 128x128 tile (ANDed with the index mask, as FlashMask V3).

    Returns:
        ``out`` ``[batch, seqlen_q, heads, head_dim_v]`` in the query dtype; with ``return_softmax_lse`` the
        tuple ``(out, lse)``, lse float32 ``[batch, heads, seqlen_q]`` (not differentiable: gradients flow
        through ``out`` only). Query rows that see no key give output 0, gradient 0 and lse ``-inf`` (no NaN).

    Differentiable in ``query``, ``key`` and ``value``. Back end by device: CPU -> tiled kernel that skips fully
    masked tiles (:mod:`oarlock.attention.cpu`); CUDA -> Triton kernel; other devices -> dense reference.

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
    canon = canonicalize(idx, causal=causal, seqlen_q=sq) if idx is not None else None
    if query.numel() == 0 or key.numel() == 0 or value.numel() == 0:
        # Zero-size inputs: nothing to attend; keep the graph so backward gives zero gradients.
        zero = (query.sum() + key.sum() + value.sum()) * 0
        out = query.new_zeros(b, sq, h, value.shape[-1]) + zero.to(query.dtype)
        lse = torch.full((b, h, sq), float("-inf"), device=query.device)
        return (out, lse) if return_softmax_lse else out
    if dropout > 0.0 and query.device.type != "cpu":
        # the Triton kernels have no dropout: dense reference, autograd through it
        out, lse = attention_reference(query, key, value, canon, causal=causal, softmax_scale=scale,
                                       block_mask=block_mask, dropout=dropout)
    else:
        # dropout masks are drawn from this seed (from torch's global RNG) and redrawn in the backward
        seed = (torch.randint(0, 2 ** 62, (1,)) if dropout > 0.0 else torch.zeros(1, dtype=torch.int64))
        out, lse = _flashmask_fwd(query, key, value, canon, block_mask, causal, scale, float(dropout), seed)
    return (out, lse) if return_softmax_lse else out
