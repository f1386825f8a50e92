"""Mask semantics, constructors and conversions, checked against brute-force Python definitions."""

from __future__ import annotations

import pytest
import torch

from attention_cases import MASK_TYPES, make_mask
from oarlock.attention import masks as M
from oarlock.attention.errors import AttentionInputError, MaskNotRepresentableError


def brute_keep(idx: torch.Tensor, causal: bool, sq: int) -> torch.Tensor:
    """The semantics table of spec section 1.3, element by element in plain Python."""
    b, hm, sk, n = idx.shape
    out = torch.zeros(b, hm, sq, sk, dtype=torch.bool)
    lst = idx.tolist()
    for bi in range(b):
        for h in range(hm):
            for j in range(sk):
                v = lst[bi][h][j]
                for i in range(sq):
                    if causal and n == 1:
                        masked = i >= v[0]
                    elif causal:
                        masked = v[0] <= i < v[1]
                    elif n == 2:
                        masked = i >= v[0] or i < v[1]
                    else:
                        masked = v[0] <= i < v[1] or v[2] <= i < v[3]
                    if causal and j > i + (sk - sq):
                        masked = True
                    out[bi, h, i, j] = not masked
    return out


def rows(*lines: str) -> torch.Tensor:
    return torch.tensor([[c == "#" for c in ln] for ln in lines])


def test_semantics_table_all_forms_and_seqlens():
    g = torch.Generator().manual_seed(0)
    for causal, n in [(True, 1), (True, 2), (False, 2), (False, 4)]:
        for sq, sk in [(10, 10), (7, 12), (12, 7)]:
            idx = torch.randint(0, sq + 3, (2, 2, sk, n), generator=g, dtype=torch.int32)
            assert torch.equal(M.to_dense_mask(idx, causal=causal, seqlen_q=sq), brute_keep(idx, causal, sq))


def test_paddle_docstring_examples():
    # 10-token examples of Paddle's flashmask_attention docstring (spec section 2), as dense pictures.
    cdoc = M.causal_document_mask([4, 3, 3])
    assert cdoc[0, 0, :, 0].tolist() == [4, 4, 4, 4, 7, 7, 7, 10, 10, 10]
    sq = M.shared_question_mask([(4, [3, 3])])
    assert sq[0, 0, :, 0].tolist() == [10, 10, 10, 10, 7, 7, 7, 10, 10, 10]
    gsw = M.global_sliding_window_mask(10, 2, 1, 1)
    assert gsw[0, 0, :, 0].tolist() == [10, 10, 4, 5, 6, 7, 8, 9, 10, 10]
    assert gsw[0, 0, :, 3].tolist() == [0, 0, 0, 0, 3, 4, 5, 6, 7, 8]
    cbw = M.causal_blockwise_mask([4, 3, 3])
    assert cbw[0, 0].T.tolist() == [[4, 4, 4, 4, 7, 7, 7, 10, 10, 10], [7, 7, 7, 7, 7, 7, 7, 10, 10, 10]]
    assert M.prefix_lm_causal_mask(10, 5)[0, 0, :, 1].tolist() == [0, 0, 0, 0, 0, 5, 6, 7, 8, 9]
    pld = M.prefix_lm_document_mask([(2, 3), (2, 2), (2, 5)])
    assert pld[0, 0].T.tolist() == [[3, 3, 3, 5, 5, 10, 10, 10, 10, 10], [0, 0, 2, 3, 3, 5, 5, 7, 8, 9]]
    assert M.sliding_window_mask(10, 2)[0, 0, :, 0].tolist() == [3, 4, 5, 6, 7, 8, 9, 10, 10, 10]
    doc = M.document_mask([4, 3, 3])
    assert doc[0, 0, :, 1].tolist() == [0, 0, 0, 0, 4, 4, 4, 7, 7, 7]
    want = rows("#.........", "##........", "###.......", "####......", "....#.....", "....##....",
                "....###...", ".......#..", ".......##.", ".......###")
    assert torch.equal(M.to_dense_mask(cdoc, causal=True)[0, 0], want)


def _intended(kind: str, s: int) -> torch.Tensor:
    """What each mask type means, written from its definition (not from the index recipes)."""
    i = torch.arange(s).view(-1, 1)
    j = torch.arange(s).view(1, -1)
    if kind == "causal_document":
        doc = torch.repeat_interleave(torch.arange(3), torch.tensor([3, 5, 4]))
        return (doc.view(-1, 1) == doc.view(1, -1)) & (j <= i)
    if kind == "document":
        doc = torch.repeat_interleave(torch.arange(3), torch.tensor([3, 5, 4]))
        return doc.view(-1, 1) == doc.view(1, -1)
    if kind == "sliding_window":
        return (j <= i) & (j >= i - 3)
    if kind == "bidirectional_window":
        return (j >= i - 3) & (j <= i + 2)
    if kind == "global_sliding_window":
        return (i < 2) | (j < 2) | ((j >= i - 3) & (j <= i + 2))
    if kind == "prefix_lm_causal":
        return (j <= i) | (j < 5)
    if kind == "shared_question":  # question 3, answers 4, 5
        seg = torch.tensor([0] * 3 + [1] * 4 + [2] * 5)
        si, sj = seg.view(-1, 1), seg.view(1, -1)
        return (j <= i) & ((sj == 0) | (si == sj))
    if kind == "prefix_lm_document":  # docs (prefix 2, len 5), (prefix 3, len 7)
        doc = torch.tensor([0] * 5 + [1] * 7)
        pos = torch.tensor(list(range(5)) + list(range(7)))
        pre = torch.tensor([2] * 5 + [3] * 7)
        same = doc.view(-1, 1) == doc.view(1, -1)
        return same & ((j <= i) | (pos.view(1, -1) < pre.view(1, -1)))
    if kind == "causal_blockwise":
        doc = torch.repeat_interleave(torch.arange(3), torch.tensor([3, 5, 4]))
        return (j <= i) & ((doc.view(-1, 1) == doc.view(1, -1)) | (doc.view(-1, 1) == 2))
    if kind == "qk_sparse":  # block [3, 7): queries inside see only keys before the block
        inside = (i >= 3) & (i < 7)
        return (j <= i) & ~(inside & (j >= 3) & (j < 7))
    raise KeyError(kind)


@pytest.mark.parametrize("kind,idx,causal", [
    ("causal_document", M.causal_document_mask([3, 5, 4]), True),
    ("document", M.document_mask([3, 5, 4]), False),
    ("sliding_window", M.sliding_window_mask(12, 3), True),
    ("bidirectional_window", M.bidirectional_sliding_window_mask(12, 3, 2), False),
    ("global_sliding_window", M.global_sliding_window_mask(12, 2, 3, 2), False),
    ("prefix_lm_causal", M.prefix_lm_causal_mask(12, 5), False),
    ("shared_question", M.shared_question_mask([(3, [4, 5])]), True),
    ("prefix_lm_document", M.prefix_lm_document_mask([(2, 5), (3, 7)]), False),
    ("causal_blockwise", M.causal_blockwise_mask([3, 5, 4]), True),
    ("qk_sparse", M.qk_sparse_mask(12, [(3, 4)]), True),
])
def test_constructors_mean_what_their_names_say(kind, idx, causal):
    assert idx.dtype == torch.int32 and idx.shape[:3] == (1, 1, 12)
    assert torch.equal(M.to_dense_mask(idx, causal=causal)[0, 0], _intended(kind, 12)), M.mask_picture(
        idx, causal=causal)


def test_random_eviction_evicts_one_key_per_row_for_good():
    idx = M.random_eviction_mask(64, batch_size=2, num_heads=3, generator=torch.Generator().manual_seed(1))
    assert idx.shape == (2, 3, 64, 1)
    keep = M.to_dense_mask(idx, causal=True)
    for b in range(2):
        for h in range(3):
            visible = keep[b, h].sum(1)
            # rows up to the start see i + 1 keys; afterwards each row has one key fewer than plain causal
            assert visible[:32].tolist() == list(range(1, 33))
            assert visible[32:].tolist() == [i + 1 - (i - 31) for i in range(32, 64)]
            # evicted keys stay evicted: once masked in a column, masked for every later row
            m = ~keep[b, h]
            assert torch.all(m[1:] >= (m[:-1] & torch.tril(torch.ones(64, 64, dtype=torch.bool))[:-1]))
    assert not torch.equal(idx[0, 0], idx[0, 1])


def test_padding_tail_becomes_its_own_document():
    idx = M.causal_document_mask([3, 2], seqlen=8)
    assert idx[0, 0, :, 0].tolist() == [3, 3, 3, 5, 5, 8, 8, 8]
    with pytest.raises(AttentionInputError, match="sum to 9 > seqlen 8"):
        M.causal_document_mask([4, 5], seqlen=8)


@pytest.mark.parametrize("kind", [k for k in MASK_TYPES if k not in ("full", "causal_none", "window_size")])
@pytest.mark.parametrize("sq,sk", [(37, 37), (20, 37), (37, 20)])
def test_from_dense_mask_round_trip(kind, sq, sk):
    idx, causal, _ = make_mask(kind, sk, batch=2, mask_heads=2)
    dense = M.to_dense_mask(idx, causal=causal, seqlen_q=sq)
    back = M.from_dense_mask(dense, causal=causal)
    assert back.dtype == torch.int32 and back.shape[:3] == idx.shape[:3]
    assert torch.equal(M.to_dense_mask(back, causal=causal, seqlen_q=sq), dense)
    # every causal mask is also representable without the causal flag (as long as it has <= 2 runs)
    if causal and idx.shape[-1] == 1:
        back2 = M.from_dense_mask(dense, causal=False)
        assert torch.equal(M.to_dense_mask(back2, causal=False, seqlen_q=sq), dense)


def test_from_dense_mask_rejects_unrepresentable_masks():
    keep = torch.ones(6, 6, dtype=torch.bool)
    keep[1, 2] = keep[3, 2] = keep[5, 2] = False  # three masked runs in column 2
    with pytest.raises(MaskNotRepresentableError, match="key column 2 .* 3 masked row runs, at most 2"):
        M.from_dense_mask(keep, causal=False)
    with pytest.raises(MaskNotRepresentableError, match="above the .*diagonal"):
        M.from_dense_mask(torch.ones(6, 6, dtype=torch.bool), causal=True)
    tri = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    tri[2, 1] = tri[4, 1] = False  # two runs below the diagonal: fine without causal? no: 3 runs with the top
    with pytest.raises(MaskNotRepresentableError, match="at most 1 allowed"):
        M.from_dense_mask(tri, causal=True)


def test_block_bounds_equal_python_loop():
    g = torch.Generator().manual_seed(0)
    for s in (31, 32, 61, 64, 96, 132):
        for bn in (16, 64):
            canon = M.canonicalize(torch.randint(0, s + 1, (2, 2, s, 4), generator=g, dtype=torch.int32),
                                   causal=False, seqlen_q=s)
            mins, maxs = M.block_bounds(canon, bn)
            for t in range(-(-s // bn)):
                blk = canon[:, :, t * bn:(t + 1) * bn]
                assert torch.equal(mins[:, :, t], blk.amin(2)) and torch.equal(maxs[:, :, t], blk.amax(2))


@pytest.mark.parametrize("kind", MASK_TYPES)
def test_tile_classification_is_sound_and_tight(kind):
    sq = sk = 300
    idx, causal, window = make_mask(kind, sk, batch=2, mask_heads=2)
    if window is not None:
        idx = M.window_to_indices(window, causal=causal, batch_size=2, seqlen_q=sq, seqlen_k=sk)
    if idx is None:
        idx = (torch.full((2, 1, sk, 1), sq) if causal else torch.tensor([sq, 0]).expand(2, 1, sk, 2)).int()
    canon = M.canonicalize(idx, causal=causal, seqlen_q=sq)
    keep = M.to_dense_mask(idx, causal=causal, seqlen_q=sq)
    bm, bn = 32, 16
    cls = M.classify_tiles(canon, causal=causal, seqlen_q=sq, block_m=bm, block_n=bn)
    for i in range(cls.shape[2]):
        for j in range(cls.shape[3]):
            tile = keep[:, :, i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            c = cls[:, :, i, j]
            assert torch.all(~tile.any((2, 3))[c == M.TILE_SKIP]), "a skipped tile has a visible element"
            assert torch.all(tile.all((2, 3))[c == M.TILE_FULL]), "a full tile has a masked element"
            if kind in ("causal_none", "sliding_window", "full"):
                # one reason per dead tile: min/max bounds find every dead tile (mixed reasons may be missed)
                assert torch.all(c[~tile.any((2, 3))] == M.TILE_SKIP)


@pytest.mark.parametrize("kind", ["causal_document", "global_sliding_window", "document", "random_eviction"])
def test_flex_block_mask_matches_create_block_mask(kind):
    from torch.nn.attention.flex_attention import create_block_mask

    sq, sk, h = 300, 300, 2
    hm = 2 if kind == "random_eviction" else 1
    idx, causal, _ = make_mask(kind, sk, batch=1, mask_heads=hm)
    ours = M.to_flex_block_mask(idx, causal=causal, num_heads=h, block_size=128)
    mod = M.to_mask_mod(idx, causal=causal, num_heads=h)
    theirs = create_block_mask(mod, 1, h if hm > 1 else None, sq, sk, device="cpu", BLOCK_SIZE=128)
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    for a, b in [(ours.kv_num_blocks, theirs.kv_num_blocks), (ours.full_kv_num_blocks, theirs.full_kv_num_blocks)]:
        assert torch.equal(a.expand_as(b) if a.shape != b.shape else a, b)
    # and the mask_mod itself is the FlashMask mask
    from torch.nn.attention.flex_attention import create_mask

    dense = create_mask(mod, 1, h, sq, sk, device="cpu")
    want = M.to_dense_mask(idx, causal=causal).repeat_interleave(h // hm, 1)
    assert torch.equal(dense, want)


@pytest.mark.parametrize("make, flat, rows", [
    (M.causal_document_mask, [2, 3], [[2, 3], [1, 4]]),
    (M.document_mask, [2, 3], [[2, 3], [1, 4]]),
    (M.causal_blockwise_mask, [2, 3], [[2, 3], [1, 4]]),
    (M.shared_question_mask, [(2, [1, 2])], [[(2, [1, 2])], [(1, [2, 2])]]),
    (M.prefix_lm_document_mask, [(2, 3)], [[(2, 3)], [(1, 4)]]),
])
def test_batch_size_against_per_row_descriptions(make, flat, rows):
    """A flat description repeats over ``batch_size`` rows; per-row lists set the batch, and an explicit
    batch_size that disagrees with them (1 included) is an error naming both counts, never silently ignored."""
    one = make(flat, seqlen=5)
    assert one.shape[0] == 1
    three = make(flat, seqlen=5, batch_size=3)
    assert three.shape[0] == 3 and all(torch.equal(three[i], one[0]) for i in range(3))
    per = make(rows, seqlen=5)
    assert per.shape[0] == 2
    assert torch.equal(per[0], one[0])  # row 0 is the flat description
    assert torch.equal(make(rows, seqlen=5, batch_size=2), per)
    for wrong in (1, 3):
        with pytest.raises(AttentionInputError, match=rf"2 batch rows .*batch_size is {wrong}"):
            make(rows, seqlen=5, batch_size=wrong)
