"""Checksums of arbitrary strided views (expanded, zero-size, transposed, overlapping, conjugate and negative
bits) of every dtype equal those of ``t.contiguous()``, computed by independent references: a pure-Python
SplitMix64 weighted sum for "fast", hashlib for "md5"."""

import hashlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oarlock.debug.checksum import _CHUNK, hash_hex

M64, M32 = (1 << 64) - 1, (1 << 32) - 1

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
          torch.uint64, torch.bool, torch.complex64, torch.complex128]
COMPLEX_OF = {torch.float32: torch.complex64, torch.float64: torch.complex128}


def splitmix_np(idx: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser of (i + 1) * golden ratio (Steele et al. 2014), uint64 wrap-around in numpy."""
    with np.errstate(over="ignore"):
        z = (idx.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def words_of(t: torch.Tensor) -> np.ndarray:
    """The documented 32-bit words of t.contiguous(): complex as (real, imag) pairs, 1-byte types zero-extended,
    2-byte types sign-extended, 8-byte types as two little-endian words. From raw bytes with numpy."""
    c = torch.empty(t.shape, dtype=t.dtype).copy_(t.resolve_conj().resolve_neg())  # fresh, unit strides
    if c.numel() == 0:
        return np.zeros(0, dtype=np.uint64)
    if c.is_complex():
        c = torch.view_as_real(c).contiguous()
    raw = c.reshape(-1).view(torch.uint8).numpy()
    size = c.element_size()
    if size == 1:
        return raw.astype(np.uint64)
    if size == 2:
        return raw.view("<i2").astype(np.int64).astype(np.uint64) & np.uint64(M32)
    return raw.view("<u4").astype(np.uint64)


def reference_fast(t: torch.Tensor) -> str:
    """lane_j = sum_i word_i * w_j[i] (mod 2**32) for up to 2**20 words; chunk k of 2**20 words weighted by
    w_0[k] beyond that; hex = (lane_0 + n) mod 2**32, lane_1."""
    w = words_of(t)
    n = len(w)
    with np.errstate(over="ignore"):
        mix = splitmix_np(np.arange(min(n, _CHUNK)))
        w0 = (mix & np.uint64(M32)) | np.uint64(1)
        w1 = ((mix >> np.uint64(32)) & np.uint64(M32)) | np.uint64(1)
        if n <= _CHUNK:
            lanes = [int((w * w0[:n]).sum()) & M32, int((w * w1[:n]).sum()) & M32]
        else:
            lanes = [0, 0]
            for k, s in enumerate(range(0, n, _CHUNK)):
                seg = w[s:s + _CHUNK]
                for j, wj in enumerate((w0, w1)):
                    lanes[j] += (int((seg * wj[:len(seg)]).sum()) & M32) * int(w0[k])
    return f"{(lanes[0] + n) & M32:08x}{lanes[1] & M32:08x}"


def reference_md5(t: torch.Tensor) -> str:
    c = torch.empty(t.shape, dtype=t.dtype).copy_(t.resolve_conj().resolve_neg())  # fresh, unit strides
    if c.numel() == 0:
        return hashlib.md5(b"").hexdigest()
    return hashlib.md5(c.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@st.composite
def strided_tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.integers(0, 4))
    shape = [draw(st.integers(0, 5)) for _ in range(ndim)]
    strides = [draw(st.integers(0, 7)) for _ in range(ndim)]  # 0 = expanded; small values overlap
    offset = draw(st.integers(0, 3))
    need = offset + sum((s - 1) * d for s, d in zip(shape, strides) if s > 0) + 1
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (need * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8,
                        generator=g)
    if dtype == torch.bool:
        raw = raw & 1
    base = raw.view(dtype)
    t = base.as_strided(shape, strides, offset)
    view = draw(st.sampled_from(["plain", "transpose", "conj", "neg"]))
    if view == "transpose" and t.dim() >= 2:
        t = t.transpose(0, -1)
    elif view == "conj" and t.is_complex():
        t = t.conj()
    elif view == "neg" and dtype in COMPLEX_OF:
        # the imaginary part of a conjugated view carries the negative bit
        z = torch.complex(base.as_strided(shape, strides, offset), base.as_strided(shape, strides, offset))
        t = z.conj().imag
    return t


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strided_tensors())
def test_fast_and_md5_of_any_strided_tensor_match_contiguous_reference(t):
    assert hash_hex("fast", t) == reference_fast(t)
    assert hash_hex("md5", t) == reference_md5(t)
    assert hash_hex("rounded:2", t) == hash_hex("rounded:2", t.resolve_conj().resolve_neg().contiguous())


def test_issue_repro_zero_stride_int64_output():
    # transformers' find_packed_sequence_indices builds such a tensor; the old code failed to view it as int32
    t = torch.arange(4).unsqueeze(0).expand(3, 4)[:, :1] - 1
    x = torch.arange(6).view(1, 6).expand(4, 6)[:, 1:2]
    for u in (t, x, x.t()):
        assert hash_hex("fast", u) == reference_fast(u)
        assert hash_hex("md5", u) == reference_md5(u)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16, torch.complex64])
def test_large_expanded_and_transposed_tensors_chunk_like_contiguous(dtype):
    g = torch.Generator().manual_seed(5)
    row = (torch.randn(1, 700, generator=g) * 50).to(dtype)
    big = row.expand(3100, 700)  # 2.17M elements from 700 stored ones: crosses several 2**20-word chunks
    assert hash_hex("fast", big) == reference_fast(big)
    assert hash_hex("md5", big) == reference_md5(big)
    m = (torch.randn(1500, 1400, generator=g) * 50).to(dtype).t()
    assert hash_hex("fast", m) == reference_fast(m)
    assert hash_hex("rounded:1", m) == hash_hex("rounded:1", m.contiguous())
