"""Tensor checksums for run-to-run comparison.

Three kinds, chosen by a spec string (``parse_checksum``):

- ``"fast"``: a position-sensitive 64-bit fingerprint computed **on the tensor's device** with torch ops.
  The tensor's bit patterns (bit-cast to a same-width integer, widened to int64) are multiplied by fixed
  odd pseudo-random weights and summed modulo 2**64. No data is copied to the host; only the final 8-byte
  value is read back, and the recorder reads those in batches. Any single-element change of the bits changes
  the sum (the weight is odd, so ``delta * w != 0 mod 2**64`` for ``0 < |delta| < 2**64``), unlike
  ``torch.hash_tensor``'s XOR reduction, which cannot see a permutation. The weights come from integer
  arithmetic (a SplitMix64-style mixer, Steele et al., "Fast splittable pseudorandom number generators",
  OOPSLA 2014), so the value is the same on every device, machine and torch version.
- ``"md5"``: MD5 (RFC 1321, via :mod:`hashlib`) of the raw bytes in logical (C-contiguous) order. Exact
  and portable but slow (about 350 MB/s per core) and, on GPU, it copies every output to the host.
- ``"rounded:N"``: the fast fingerprint of ``round(x * 10**N)`` in float64, i.e. of the values rounded to N
  decimals. Tolerates last-bit noise, like Paddle's ``FLAGS_tensor_md5_checksum_precision`` (which hashes the
  printed text); a change that moves a value across a rounding boundary is still reported.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch

from oarlock.debug.errors import DebugError

_MASK64 = (1 << 64) - 1
_CHUNK = 1 << 20  # weights are cached for this many elements; larger tensors are hashed chunk by chunk
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_weights: dict[torch.device, torch.Tensor] = {}


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _M1, _M2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _position_weights(device: torch.device) -> torch.Tensor:
    """int64 [_CHUNK] odd weights on ``device`` (SplitMix64 finaliser of the index; wrap-around arithmetic)."""
    w = _weights.get(device)
    if w is None:
        x = (torch.arange(1, _CHUNK + 1, dtype=torch.int64, device=device) * _GOLDEN)
        # torch's >> is arithmetic on int64; mask to emulate the logical shift of the reference mixer.
        x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * _M1
        x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * _M2
        x = x ^ ((x >> 31) & ((1 << 33) - 1))
        w = _weights[device] = x | 1
    return w


def _as_int64_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements bit-cast to a same-width integer and widened to int64, flattened."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype != torch.int64:
        t = t.view(_INT_OF_SIZE[t.element_size()])
    return t.reshape(-1).to(torch.int64)


def _fingerprint_int64(flat: torch.Tensor) -> torch.Tensor:
    """0-dim int64 tensor on flat's device: sum(flat[i] * w[i]) mod 2**64, chunked for long inputs."""
    w = _position_weights(flat.device)
    n = flat.numel()
    if n <= _CHUNK:
        return (flat * w[:n]).sum() + n
    acc = torch.zeros((), dtype=torch.int64, device=flat.device)
    for k, start in enumerate(range(0, n, _CHUNK)):
        seg = flat[start:start + _CHUNK]
        acc = acc + (seg * w[:seg.numel()]).sum() * w[k]  # w[k] is odd: chunk order matters
    return acc + n


def fast_hash(t: torch.Tensor) -> torch.Tensor:
    """Device-side 64-bit fingerprint of a strided tensor (any dtype, any device).

    Returns a 0-dim ``torch.int64`` tensor on ``t``'s device (read it with :func:`format_hash`); reading it
    is the only host transfer. Cost: three elementwise passes and one reduction over ``t``.
    """
    return _fingerprint_int64(_as_int64_bits(t))


def rounded_hash(t: torch.Tensor, decimals: int) -> torch.Tensor:
    """Fingerprint (as :func:`fast_hash`) of ``t``'s values rounded to ``decimals`` decimal places.

    Floating values are scaled by ``10**decimals`` in float64, rounded half-to-even, and converted to int64
    (magnitudes are clamped to 2**62, so +-inf hash like huge values; NaN maps to 2**63 - 1024); integer
    tensors are hashed as they are. Returns a 0-dim int64 tensor on ``t``'s device.
    """
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_floating_point():
        return fast_hash(t)
    big = float(1 << 62)
    x = torch.round(t.to(torch.float64) * (10.0 ** decimals)).clamp_(-big, big)  # clamp keeps NaN
    x = torch.nan_to_num(x, nan=float((1 << 63) - 1024))  # a float64-exact int64 above the clamp range
    return _fingerprint_int64(x.reshape(-1).to(torch.int64))


def md5_hash(t: torch.Tensor) -> str:
    """Hex MD5 (RFC 1321) of ``t``'s raw bytes in C-contiguous order; copies the data to the host."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.md5(raw.numpy().tobytes()).hexdigest()


def format_hash(value: int | torch.Tensor) -> str:
    """16 hex digits of a 64-bit fingerprint (a Python int or a 0-dim int64 tensor)."""
    if isinstance(value, torch.Tensor):
        value = int(value.item())
    return f"{value & _MASK64:016x}"


def parse_checksum(spec: str | None) -> tuple[str | None, int | None]:
    """Validate a checksum spec: ``None``, ``"fast"``, ``"md5"`` or ``"rounded:N"`` (0 <= N <= 15).

    Returns ``(kind, decimals)``. Raises :class:`DebugError` naming the bad spec.
    """
    if spec is None or spec in ("none", "None"):
        return None, None
    if spec in ("fast", "md5"):
        return spec, None
    if isinstance(spec, str) and spec.startswith("rounded:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            n = -1
        if 0 <= n <= 15:
            return "rounded", n
    raise DebugError(f"checksum={spec!r}: expected None, 'fast', 'md5' or 'rounded:N' with 0 <= N <= 15")


def hasher(spec: str | None) -> tuple[str | None, Callable[[torch.Tensor], torch.Tensor | str] | None]:
    """(normalised spec, function tensor -> 0-dim int64 tensor or hex str) for a checksum spec."""
    kind, n = parse_checksum(spec)
    if kind is None:
        return None, None
    if kind == "fast":
        return "fast", fast_hash
    if kind == "md5":
        return "md5", md5_hash
    return f"rounded:{n}", lambda t: rounded_hash(t, n)


def hashable(t: torch.Tensor) -> bool:
    """Whether checksums apply: a strided tensor with real storage (not meta/fake, not sparse/quantized)."""
    return (t.layout == torch.strided and t.device.type != "meta" and not t.is_quantized
            and type(t) in (torch.Tensor, torch.nn.Parameter))
