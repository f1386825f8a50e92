"""Packing tokenised documents into fixed-length training rows with per-token document ids.

Sequence packing (as in Paddle's SFT/pre-training pipelines and FlashMask's causal document mask): documents are
laid end to end and cut into rows of ``seq_len`` tokens; ``document_ids`` let the model build a causal document
mask (:func:`oarlock.attention.causal_document_mask_from_ids`) so no token attends across a document boundary,
and
labels never ask a document's last token to predict the next document's first.
"""

from __future__ import annotations

from typing import Sequence

import torch

from oarlock.models.errors import ModelError


def pack_documents(documents: Sequence[Sequence[int]], seq_len: int, *, pad_id: int = 0,
                   ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack ``documents`` (token id lists) in order into rows of ``seq_len`` tokens.

    A document that does not fit in the space left on a row continues at the start of the next row (a new
    document segment there; its first token has no context from the previous row). The last row is padded with
    ``pad_id``; the padding forms its own document.

    Returns ``(input_ids, labels, document_ids)``, each int64 ``[rows, seq_len]``: ``labels[r, i]`` is the next
    token of the same document segment, ``ignore_index`` at each segment's last token and on padding;
    ``document_ids`` number the segments of each row 0, 1, 2, ... in order. Empty documents are skipped.

    Raises :class:`ModelError` if ``seq_len < 2`` or no document has a token.
    """
    if seq_len < 2:
        raise ModelError(f"pack_documents: seq_len must be at least 2, got {seq_len}")
    rows_ids: list[list[int]] = []
    rows_lab: list[list[int]] = []
    rows_doc: list[list[int]] = []
    ids: list[int] = []
    lab: list[int] = []
    doc: list[int] = []

    def flush() -> None:
        nonlocal ids, lab, doc
        rows_ids.append(ids)
        rows_lab.append(lab)
        rows_doc.append(doc)
        ids, lab, doc = [], [], []

    for tokens in documents:
        tokens = [int(t) for t in tokens]
        while tokens:
            room = seq_len - len(ids)
            piece, tokens = tokens[:room], tokens[room:]
            # A segment's last token gets no label even when the document continues on the next row: its target
            # sits in another row, which the loss of this row cannot see.
            seg = (doc[-1] + 1) if doc else 0
            ids += piece
            lab += piece[1:] + [ignore_index]
            doc += [seg] * len(piece)
            if len(ids) == seq_len:
                flush()
    if ids:
        n = seq_len - len(ids)
        seg = doc[-1] + 1
        ids += [pad_id] * n
        lab += [ignore_index] * n
        doc += [seg] * n
        flush()
    if not rows_ids:
        raise ModelError("pack_documents: no document has a token")
    return (torch.tensor(rows_ids, dtype=torch.int64), torch.tensor(rows_lab, dtype=torch.int64),
            torch.tensor(rows_doc, dtype=torch.int64))


# ----------------------------------------------------------------------------------------------------------------
# Real English text that needs no download: the docstrings of Python's standard library.
import importlib  # noqa: E402
import inspect  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Callable  # noqa: E402

#: Modules whose docstrings are mostly prose, in a fixed order: the corpus is deterministic per Python version.
STDLIB_MODULES = (
    "argparse", "bisect", "calendar", "collections", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "enum", "fractions", "functools", "gettext", "heapq", "http.client", "inspect",
    "ipaddress", "itertools", "json", "logging", "mailbox", "os", "pathlib", "pickle", "pprint", "queue",
    "random", "sched", "shlex", "shutil", "smtplib", "socket", "statistics", "string", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "typing", "unittest", "urllib.parse", "uuid",
    "wave", "zipfile",
)


def stdlib_documents(modules: Sequence[str] = STDLIB_MODULES, min_chars: int = 200) -> list[str]:
    """Docstrings (module, class, function, method) of ``modules`` with at least ``min_chars`` characters,
    cleaned with :func:`inspect.getdoc`, in a deterministic order, without duplicates."""
    docs: list[str] = []
    seen: set[str] = set()

    def add(obj: object) -> None:
        d = inspect.getdoc(obj)
        if d and len(d) >= min_chars and d not in seen:
            seen.add(d)
            docs.append(d)

    with warnings.catch_warnings():  # deprecated aliases (typing.io) warn when their attributes are read
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in modules:
            mod = importlib.import_module(name)
            add(mod)
            for attr in sorted(vars(mod)):
                obj = getattr(mod, attr)
                if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                    continue
                if inspect.isclass(obj):
                    add(obj)
                    for meth in sorted(vars(obj)):
                        if not meth.startswith("_") and callable(getattr(obj, meth, None)):
                            add(getattr(obj, meth))
                elif inspect.isfunction(obj):
                    add(obj)
    return docs


@dataclass
class PackedBatch:
    """Packed rows: ``input_ids``, ``labels`` (``-100`` where no target) and ``doc_ids``, int64 ``[rows, seq_len]``."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    doc_ids: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def stdlib_corpus(tokenize: Callable[[str], list[int]], eos_id: int, seq_len: int, *, heldout_fraction: float = 0.1,
                  max_docs: int | None = None) -> tuple[PackedBatch, PackedBatch]:
    """Train and held-out packed rows from the standard library's docstrings (each document ends with
    ``eos_id``). Documents, not rows, are split: every ``1/heldout_fraction``-th document is held out, so the two
    sets share no text."""
    docs = stdlib_documents()[:max_docs]
    every = max(2, round(1 / heldout_fraction))
    train = [tokenize(d) + [eos_id] for i, d in enumerate(docs) if i % every]
    held = [tokenize(d) + [eos_id] for i, d in enumerate(docs) if i % every == 0]
    return (PackedBatch(*pack_documents(train, seq_len, pad_id=eos_id)),
            PackedBatch(*pack_documents(held, seq_len, pad_id=eos_id)))


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, end-of-sequence 256. Used by ``--tiny``."""

    eos_token_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
