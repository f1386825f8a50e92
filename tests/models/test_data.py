"""pack_documents against hand-worked examples."""

import pytest
import torch

from oarlock.errors import OarlockError
from oarlock.models.data import pack_documents

I = -100


def test_packing_hand_example():
    ids, labels, doc = pack_documents([[1, 2, 3], [4, 5], [], [6, 7, 8, 9, 10]], 4, pad_id=0)
    assert ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0]]
    assert labels.tolist() == [[2, 3, I, I], [I, 7, 8, I], [10, I, I, I]]
    assert doc.tolist() == [[0, 0, 0, 1], [0, 1, 1, 1], [0, 0, 1, 1]]
    assert ids.dtype == labels.dtype == doc.dtype == torch.int64


def test_exact_fit_has_no_padding_row_and_bad_input_errors():
    ids, labels, doc = pack_documents([[1, 2], [3, 4]], 2)
    assert ids.tolist() == [[1, 2], [3, 4]] and labels.tolist() == [[2, I], [4, I]] and doc.tolist() == [[0, 0]] * 2
    with pytest.raises(OarlockError, match="seq_len must be at least 2"):
        pack_documents([[1]], 1)
    with pytest.raises(OarlockError, match="no document has a token"):
        pack_documents([[], []], 4)


def test_stdlib_documents_are_real_prose_and_deterministic():
    from oarlock.models.data import stdlib_corpus, stdlib_documents

    docs = stdlib_documents(("json", "textwrap"))
    assert docs == stdlib_documents(("json", "textwrap"))
    assert len(docs) >= 5 and all(len(d) >= 200 for d in docs) and len(set(docs)) == len(docs)
    assert any("JSON" in d for d in docs)
    train, held = stdlib_corpus(lambda s: list(s.encode()), 256, 64, max_docs=20)
    assert train.input_ids.shape[1] == 64 and len(train) > len(held) > 0
    # held-out text is not in the training rows: the first held-out document's opening bytes never appear there
    probe = bytes(held.input_ids[0, :32].tolist())
    assert all(probe not in bytes([t for t in row if t < 256]) for row in train.input_ids.tolist())
