"""Checksums against independent references: hashlib for MD5, a pure-Python SplitMix64 sum for "fast"."""

import hashlib

import pytest
import torch

from oarlock.debug import DebugError, md5_hash
from oarlock.debug.checksum import hash_hex, parse_checksum

M64, M32 = (1 << 64) - 1, (1 << 32) - 1


def splitmix(i: int) -> int:
    """SplitMix64 finaliser of (i + 1) * golden ratio (Steele et al. 2014)."""
    z = ((i + 1) * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def reference_fast(t: torch.Tensor) -> str:
    """The documented fingerprint computed with Python integers from the tensor's raw little-endian bytes."""
    raw = t.contiguous().view(torch.uint8).reshape(-1).tolist()
    size = t.element_size()
    if size in (1, 2):  # widened to int32: zero-extended bytes, sign-extended 16-bit words
        words = [int.from_bytes(bytes(raw[k:k + size]), "little", signed=size == 2) for k in range(0, len(raw), size)]
    else:  # 4- and 8-byte types: their 32-bit little-endian words
        words = [int.from_bytes(bytes(raw[k:k + 4]), "little") for k in range(0, len(raw), 4)]
    lo = sum(wd * ((splitmix(i) & M32) | 1) for i, wd in enumerate(words))
    hi = sum(wd * (((splitmix(i) >> 32) & M32) | 1) for i, wd in enumerate(words))
    return f"{(lo + len(words)) & M32:08x}{hi & M32:08x}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int8,
                                   torch.bool])
def test_fast_hash_matches_pure_python_reference(dtype):
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(7, 13, generator=g) * 100).to(dtype)
    assert hash_hex("fast", t) == reference_fast(t)
    # non-contiguous input hashes its logical order
    assert hash_hex("fast", t.t()) == reference_fast(t.t().contiguous())


def test_fast_hash_long_path_matches_reference():
    t = torch.randn(40_000, generator=torch.Generator().manual_seed(4))  # above the torch.mv size limit
    assert hash_hex("fast", t) == reference_fast(t)


def test_fast_hash_sees_one_ulp_and_permutations():
    t = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    u = t.clone()
    u[517] = torch.nextafter(u[517], torch.tensor(float("inf")))
    assert hash_hex("fast", t) != hash_hex("fast", u)
    p = t.clone()
    p[[3, 4]] = p[[4, 3]]
    assert hash_hex("fast", t) != hash_hex("fast", p)
    # torch.hash_tensor (XOR reduction, DebugMode's "hash_tensor") cannot see the swap
    assert torch.hash_tensor(t) == torch.hash_tensor(p)


def test_fast_hash_long_tensor_chunks():
    n = (1 << 20) + 5  # crosses the weight-cache chunk
    t = torch.zeros(n)
    base = hash_hex("fast", t)
    for k in (0, 1 << 20, n - 1):
        u = t.clone()
        u[k] = 1.0
        assert hash_hex("fast", u) != base
    a, b = t.clone(), t.clone()
    a[1], b[(1 << 20) + 1] = 1.0, 1.0  # same offset within different chunks
    assert hash_hex("fast", a) != hash_hex("fast", b)


def test_md5_is_md5_of_raw_bytes():
    t = torch.randn(5, 6, generator=torch.Generator().manual_seed(3))
    assert md5_hash(t) == hashlib.md5(t.numpy().tobytes()).hexdigest()
    assert md5_hash(t.t()) == hashlib.md5(t.t().contiguous().numpy().tobytes()).hexdigest()
    b = t.to(torch.bfloat16)
    assert md5_hash(b) == hashlib.md5(b.view(torch.int16).numpy().tobytes()).hexdigest()


def test_rounded_hash_tolerance():
    t = torch.tensor([0.12341, -2.5, 3.0, float("nan"), float("inf")], dtype=torch.float64)
    same = t + torch.tensor([1e-9, -1e-9, 0.0, 0.0, 0.0], dtype=torch.float64)
    other = t + torch.tensor([2e-3, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    assert hash_hex("rounded:3", t) == hash_hex("rounded:3", same)
    assert hash_hex("rounded:3", t) != hash_hex("rounded:3", other)
    # equals the fast hash of the integer values round(x * 1000), computed independently
    ref = torch.tensor([123, -2500, 3000, (1 << 63) - 1024, 1 << 62], dtype=torch.int64)
    assert hash_hex("rounded:3", t) == reference_fast(ref)


def test_parse_checksum():
    assert parse_checksum(None) == (None, None)
    assert parse_checksum("fast") == ("fast", None)
    assert parse_checksum("rounded:4") == ("rounded", 4)
    for bad in ("sha1", "rounded:", "rounded:x", "rounded:-1", "rounded:99"):
        with pytest.raises(DebugError, match="checksum="):
            parse_checksum(bad)
