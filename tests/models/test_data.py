"""Packing real text into sequences with document ids."""

import torch

from oarlock.models.data import pack_documents, stdlib_documents


def test_stdlib_documents_are_real_prose_and_deterministic():
    docs = stdlib_documents(("json", "textwrap"))
    assert docs == stdlib_documents(("json", "textwrap"))
    assert len(docs) >= 5 and all(len(d) >= 200 for d in docs)
    assert any("JSON" in d for d in docs) and len(set(docs)) == len(docs)


def test_pack_documents_labels_and_doc_ids():
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]  # + eos(0) each: 1 2 3 0 4 5 0 6 7 8 9 0
    b = pack_documents(docs, seq_len=5, eos_id=0)

    stream = [1, 2, 3, 0, 4, 5, 0, 6, 7, 8, 9, 0]
    owner = [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2]
    assert b.input_ids.tolist() == [stream[0:5], stream[6:11]]
    assert b.labels.tolist() == [[2, 3, 0, -100, 5], [-100, 7, 8, 9, 0]]
    assert b.doc_ids.tolist() == [[0, 0, 0, 0, 1], [0, 1, 1, 1, 1]]
    for r, start in enumerate((0, 6)):
        for j in range(5):
            same = owner[start + j] == owner[start + j + 1]
            assert (b.labels[r, j] != -100) == same
    assert b.input_ids.dtype == torch.int64
