"""Tensor checksums for run-to-run comparison (definitions: ``docs/memory-debug.md`` section 7).

Every checksum equals that of ``t.contiguous()`` with conjugate/negative bits resolved, whatever the
strides (expanded, overlapping, zero-size); complex tensors are hashed as (real, imag) pairs.

Three kinds, chosen by a spec string (``parse_checksum``):

- ``"fast"``: a position-sensitive 64-bit fingerprint computed **on the tensor's device** with torch ops.
  The tensor's bit patterns (bit-cast to int32 words; 1- and 2-byte types widened to int32, 8-byte types
  split into two words) are multiplied by two fixed vectors of odd pseudo-random weights and each product
  vector is summed with 32-bit wrap-around: ``lane_j = sum_i(word_i * w_j[i]) mod 2**32`` (beyond 2**20
  words, the sum of chunk ``k`` of 2**20 words is multiplied by ``w_0[k]`` before adding). The fingerprint
  is ``(lane_0 + n) mod 2**32`` in the high half and ``lane_1`` in the low half. No data is copied to the host;
  only the two lanes are read back, and the recorder reads those in batches. Any single-word change alters
  lane 0 (an odd weight is invertible mod 2**32), unlike ``torch.hash_tensor``'s XOR reduction, which cannot
  see a permutation. 32-bit lanes keep every pass vectorised (64-bit multiply and widening sums are several
  times slower on CPUs). The weights come from integer arithmetic (the SplitMix64 finaliser, Steele et al.,
  "Fast splittable pseudorandom number generators", OOPSLA 2014: low word -> w_0, high word -> w_1), so the
  value is the same on every device, machine and torch version.
- ``"md5"``: MD5 (RFC 1321, via :mod:`hashlib`) of the raw bytes in logical (C-contiguous) order. Exact
  and portable but slow (about 350 MB/s per core) and, on GPU, it copies every output to the host.
- ``"rounded:N"``: the fast fingerprint of ``round(x * 10**N)`` in float64, i.e. of the values rounded to N
  decimals. Tolerates last-bit noise, like Paddle's ``FLAGS_tensor_md5_checksum_precision`` (which hashes the
  printed text); a change that moves a value across a rounding boundary is still reported.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Iterator

import torch

from oarlock.debug.errors import DebugError

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_CHUNK = 1 << 20  # weights are cached for this many words; longer tensors are hashed chunk by chunk
_MV_MAX = 1 << 15  # below this many words torch.mv beats multiply + sum on CPU
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_weights: dict[torch.device, torch.Tensor] = {}


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _M1, _M2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _position_weights(device: torch.device) -> torch.Tensor:
    """int32 [2, _CHUNK] odd weights on ``device``: the low and high words of SplitMix64(index + 1)."""
    w = _weights.get(device)
    if w is None:
        x = torch.arange(1, _CHUNK + 1, dtype=torch.int64) * _GOLDEN  # wrap-around int64 arithmetic
        # torch's >> is arithmetic on int64; mask to emulate the logical shift of the reference mixer.
        x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * _M1
        x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * _M2
        x = x ^ ((x >> 31) & ((1 << 33) - 1))
        lo = (x & _MASK32) | 1
        hi = ((x >> 32) & _MASK32) | 1
        both = torch.stack([lo, hi])
        both = torch.where(both >= 1 << 31, both - (1 << 32), both).to(torch.int32)
        w = _weights[device] = both.to(device)
    return w


def _bits(flat: torch.Tensor) -> torch.Tensor:
    """int32 words of a flat, contiguous, real tensor's bit patterns (see the module docstring)."""
    size = flat.element_size()
    if size == 4:
        return flat.view(torch.int32)
    if size == 8:
        return flat.view(torch.int64).view(torch.int32)
    return flat.view(_INT_OF_SIZE[size]).to(torch.int32)


def _flat_real(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a flat, contiguous, real tensor in logical (C) order: conjugate and negative bits resolved,
    complex split into (real, imag) pairs. Copies only when ``t`` is not already laid out that way."""
    if t.numel() == 0:  # a zero-size view may carry any strides; start from a fresh empty one
        t = torch.empty(0, dtype=t.dtype, device=t.device)
    t = t.reshape(-1)
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.numel() and t.stride(0) != 1:  # reshape may keep a stride-0 view of an expanded tensor (even a
        # one-element one, which torch calls contiguous): bit-casting needs unit stride
        t = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
    if t.is_complex():
        t = torch.view_as_real(t).reshape(-1)
    return t


def _element_pieces(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """Sub-tensors of ``t`` whose elements, concatenated, are ``t``'s in logical order. Each piece has at most
    ``limit`` elements unless it is contiguous (then flattening it is free), so hashing a non-contiguous or
    expanded tensor never materialises more than about ``limit`` elements at a time."""
    if t.numel() <= limit or t.is_contiguous() or t.dim() == 0:
        yield t
        return
    rows = t.shape[0]
    row = t.numel() // rows
    if row > limit:
        for i in range(rows):
            yield from _element_pieces(t[i], limit)
    else:
        step = max(1, limit // row)
        for i in range(0, rows, step):
            yield t[i:i + step]


def _chunks(t: torch.Tensor, per_chunk: int) -> Iterator[torch.Tensor]:
    """``t``'s elements in logical order as flat tensors of exactly ``per_chunk`` elements (the last may be
    shorter); slices of a contiguous tensor are views, small pieces are concatenated."""
    buf: list[torch.Tensor] = []
    have = 0
    for piece in _element_pieces(t, per_chunk):
        flat = piece.reshape(-1) if piece.is_contiguous() else piece.contiguous().reshape(-1)
        start = 0
        n = flat.numel()
        while start < n:
            take = min(per_chunk - have, n - start)
            buf.append(flat[start:start + take])
            have += take
            start += take
            if have == per_chunk:
                yield buf[0] if len(buf) == 1 else torch.cat(buf)
                buf, have = [], 0
    if have:
        yield buf[0] if len(buf) == 1 else torch.cat(buf)


def _words_per_element(t: torch.Tensor) -> int:
    real_size = t.element_size() // (2 if t.is_complex() else 1)
    return (2 if t.is_complex() else 1) * (2 if real_size == 8 else 1)


def _lanes(words: torch.Tensor) -> torch.Tensor:
    """int32 [2] on words' device: both weighted sums (mod 2**32) of at most ``_CHUNK`` words."""
    w = _position_weights(words.device)
    n = words.numel()
    if n <= _MV_MAX and words.device.type == "cpu":
        # One call instead of two for the many small outputs; CPU integer gemv accumulates in int32 with the
        # same wrap-around (checked against the pure-Python reference in the tests).
        return torch.mv(w.narrow(1, 0, n), words)
    return (words * w[:, :n]).sum(dim=1, dtype=torch.int32)


def _hash_words(t: torch.Tensor, to_words: Callable[[torch.Tensor], torch.Tensor], words_per_element: int
                ) -> torch.Tensor:
    """The two lanes of the words ``to_words`` makes of ``t``'s elements (any strides, conj/neg bits).

    Up to ``_CHUNK`` words: ``lane_j = sum_i word_i * w_j[i]``. Longer: the same sum per chunk ``k`` of
    ``_CHUNK`` words, multiplied by ``w_0[k]`` and added (so moving a value between chunks changes it)."""
    t = t.detach()
    per_chunk = _CHUNK // words_per_element
    if t.numel() <= per_chunk:
        return _lanes(to_words(_flat_real(t)))
    acc = torch.zeros(2, dtype=torch.int32, device=t.device)
    w0 = _position_weights(t.device)[0]
    for k, chunk in enumerate(_chunks(t, per_chunk)):
        acc = acc + _lanes(to_words(_flat_real(chunk))) * w0[k]  # odd multiplier: chunk order matters
    return acc


def fast_hash(t: torch.Tensor) -> torch.Tensor:
    """Device-side 64-bit fingerprint of a strided tensor (any dtype, any device, any strides).

    Returns the two 32-bit lanes as an int32 tensor of shape [2] on ``t``'s device, not yet combined, so
    that reading it (:func:`format_hash`) is the only host transfer and can be batched. The value equals that
    of ``t.contiguous()`` (with conjugate/negative bits resolved). Cost for 4-byte dtypes: one multiply and
    one reduction pass over ``t``; a non-contiguous or expanded tensor is copied chunk by chunk (at most
    about 2**20 words at a time), never whole.
    """
    return _hash_words(t, _bits, _words_per_element(t))


def _rounded_words(decimals: int) -> Callable[[torch.Tensor], torch.Tensor]:
    big = float(1 << 62)
    scale = 10.0 ** decimals

    def words(flat: torch.Tensor) -> torch.Tensor:
        x = torch.round(flat.to(torch.float64) * scale).clamp_(-big, big)  # clamp keeps NaN
        x = torch.nan_to_num(x, nan=float((1 << 63) - 1024))  # a float64-exact int64 above the clamp range
        return x.to(torch.int64).view(torch.int32)
    return words


def rounded_hash(t: torch.Tensor, decimals: int) -> torch.Tensor:
    """Fingerprint (as :func:`fast_hash`) of ``t``'s values rounded to ``decimals`` decimal places.

    Floating values are scaled by ``10**decimals`` in float64, rounded half-to-even, and converted to int64
    (magnitudes are clamped to 2**62, so +-inf hash like huge values; NaN maps to 2**63 - 1024); integer
    tensors are hashed as they are. Returns the int32 [2] lanes on ``t``'s device.
    """
    if not (t.is_floating_point() or t.is_complex()):
        return fast_hash(t)
    return _hash_words(t, _rounded_words(decimals), 2 * (2 if t.is_complex() else 1))


def _words_count(t: torch.Tensor) -> int:
    return t.numel() * _words_per_element(t)


def md5_hash(t: torch.Tensor) -> str:
    """Hex MD5 (RFC 1321) of ``t``'s raw bytes in C-contiguous order (conjugate/negative bits resolved,
    complex as (real, imag) pairs), i.e. of ``t.contiguous()``'s bytes. Copies the data to the host chunk by
    chunk (about 8 MiB at a time for non-contiguous tensors)."""
    t = t.detach()
    h = hashlib.md5()
    per_chunk = max(1, (8 << 20) // max(1, t.element_size()))
    for chunk in _chunks(t, per_chunk) if t.numel() > per_chunk else [t]:
        raw = _flat_real(chunk).view(torch.uint8).cpu()
        h.update(raw.numpy().tobytes())
    return h.hexdigest()


def format_hash(lanes, n_words: int) -> str:
    """16 hex digits of a fast/rounded fingerprint from its two lanes (an int32 [2] tensor or two ints) and
    the number of 32-bit words hashed."""
    if isinstance(lanes, torch.Tensor):
        lanes = lanes.tolist()
    hi, lo = (lanes[0] + n_words) & _MASK32, lanes[1] & _MASK32
    return f"{hi:08x}{lo:08x}"


def hash_hex(spec: str | None, t: torch.Tensor) -> str | None:
    """The checksum of ``t`` under ``spec`` as a hex string (None when ``spec`` is None): a convenience
    for tests and one-off use; the recorder batches the device reads instead."""
    kind, n = parse_checksum(spec)
    if kind is None:
        return None
    if kind == "md5":
        return md5_hash(t)
    if kind == "fast":
        return format_hash(fast_hash(t), _words_count(t))
    return format_hash(rounded_hash(t, n), 2 * t.numel() * (2 if t.is_complex() else 1))


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


def hasher(spec: str | None) -> tuple[str | None, Callable[[torch.Tensor], tuple[torch.Tensor, int] | str] | None]:
    """(normalised spec, function) for a checksum spec. The function maps a tensor to its MD5 hex string, or
    for fast/rounded to ``(lanes, n_words)`` still on the device (combine with :func:`format_hash`)."""
    kind, n = parse_checksum(spec)
    if kind is None:
        return None, None
    if kind == "fast":
        return "fast", lambda t: (fast_hash(t), _words_count(t))
    if kind == "md5":
        return "md5", md5_hash
    return f"rounded:{n}", lambda t: (rounded_hash(t, n), 2 * t.numel() * (2 if t.is_complex() else 1))


def hashable(t: torch.Tensor) -> bool:
    """Whether checksums apply: a strided tensor with real storage (not meta/fake, not sparse/quantized)."""
    return (t.layout == torch.strided and t.device.type != "meta" and not t.is_quantized
            and type(t) in (torch.Tensor, torch.nn.Parameter))
