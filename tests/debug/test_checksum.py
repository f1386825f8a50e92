"""Checksums against independent references: hashlib for MD5, a pure-Python SplitMix64 sum for "fast"."""

import hashlib

import pytest
import torch

from oarlock.debug import DebugError, fast_hash, md5_hash, rounded_hash
from oarlock.debug.checksum import format_hash, parse_checksum

M64 = (1 << 64) - 1


def splitmix_weight(i: int) -> int:
    """Reference weight of element i: the SplitMix64 finaliser of (i + 1) * golden, forced odd."""
    z = ((i + 1) * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return (z ^ (z >> 31)) | 1


def reference_fast(t: torch.Tensor) -> str:
    int_of = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    bits = t.contiguous().view(int_of[t.element_size()]).reshape(-1).tolist()
    acc = sum(b * splitmix_weight(i) for i, b in enumerate(bits)) + len(bits)
    return f"{acc & M64:016x}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int8,
                                   torch.bool])
def test_fast_hash_matches_pure_python_reference(dtype):
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(7, 13, generator=g) * 100).to(dtype)
    assert format_hash(fast_hash(t)) == reference_fast(t)
    # non-contiguous input hashes its logical order
    assert format_hash(fast_hash(t.t())) == reference_fast(t.t().contiguous())


def test_fast_hash_sees_one_ulp_and_permutations():
    t = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    u = t.clone()
    u[517] = torch.nextafter(u[517], torch.tensor(float("inf")))
    assert fast_hash(t) != fast_hash(u)
    p = t.clone()
    p[[3, 4]] = p[[4, 3]]
    assert fast_hash(t) != fast_hash(p)
    # torch.hash_tensor (XOR reduction, DebugMode's "hash_tensor") cannot see the swap
    assert torch.hash_tensor(t) == torch.hash_tensor(p)


def test_fast_hash_long_tensor_chunks():
    n = (1 << 20) + 5  # crosses the weight-cache chunk
    t = torch.zeros(n)
    base = fast_hash(t)
    for k in (0, 1 << 20, n - 1):
        u = t.clone()
        u[k] = 1.0
        assert fast_hash(u) != base
    a, b = t.clone(), t.clone()
    a[1], b[(1 << 20) + 1] = 1.0, 1.0  # same offset within different chunks
    assert fast_hash(a) != fast_hash(b)


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
    assert rounded_hash(t, 3) == rounded_hash(same, 3)
    assert rounded_hash(t, 3) != rounded_hash(other, 3)
    # equals the fast hash of the integer values round(x * 1000), computed independently
    ref = torch.tensor([123, -2500, 3000, (1 << 63) - 1024, 1 << 62], dtype=torch.int64)
    assert format_hash(rounded_hash(t, 3)) == reference_fast(ref)


def test_parse_checksum():
    assert parse_checksum(None) == (None, None)
    assert parse_checksum("fast") == ("fast", None)
    assert parse_checksum("rounded:4") == ("rounded", 4)
    for bad in ("sha1", "rounded:", "rounded:x", "rounded:-1", "rounded:99"):
        with pytest.raises(DebugError, match="checksum="):
            parse_checksum(bad)
