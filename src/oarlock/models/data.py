"""Real English text that needs no download: the docstrings of Python's standard library, packed into
fixed-length training sequences with per-token document ids (for a FlashMask causal document mask, so packed
documents never attend to each other).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

# Modules whose docstrings are mostly prose. Fixed order: the corpus is deterministic for a Python version.
STDLIB_MODULES = (
    "argparse", "bisect", "calendar", "collections", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "enum", "fractions", "functools", "gettext", "heapq", "http.client", "inspect",
    "ipaddress", "itertools", "json", "logging", "mailbox", "os", "pathlib", "pickle", "pprint", "queue",
    "random", "sched", "shlex", "shutil", "smtplib", "socket", "statistics", "string", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "typing", "unittest", "urllib.parse", "uuid",
    "wave", "zipfile",
)


def stdlib_documents(modules: Sequence[str] = STDLIB_MODULES, min_chars: int = 200) -> list[str]:
    """Docstrings (module, class, function, method) of ``modules`` that have at least ``min_chars``
    characters, cleaned with :func:`inspect.cleandoc`, in a deterministic order, without duplicates."""
    docs: list[str] = []
    seen: set[str] = set()

    def add(obj: object) -> None:
        d = inspect.getdoc(obj)
        if d and len(d) >= min_chars and d not in seen:
            seen.add(d)
            docs.append(d)

    for name in modules:
        mod = importlib.import_module(name)
        add(mod)
        for attr in sorted(vars(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr)
            if getattr(obj, "__module__", None) != mod.__name__:
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
    """Packed sequences.

    Attributes:
        input_ids: ``[num_seqs, seq_len]`` int64 token ids.
        labels: ``[num_seqs, seq_len]`` int64 next-token targets; ``-100`` where the target belongs to another
            document (never learn to predict across a packing boundary).
        doc_ids: ``[num_seqs, seq_len]`` int64 document index of each input token (restarts at 0 per row).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    doc_ids: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, stop: int) -> "PackedBatch":
        return PackedBatch(self.input_ids[start:stop], self.labels[start:stop], self.doc_ids[start:stop])


def pack_documents(token_lists: Sequence[Sequence[int]], seq_len: int, eos_id: int) -> PackedBatch:
    """Concatenate tokenised documents (each followed by ``eos_id``) and cut the stream into rows of
    ``seq_len + 1`` tokens (inputs are the first ``seq_len``, labels the last ``seq_len``). The tail that does
    not fill a row is dropped. Raises ``ValueError`` if the documents do not fill a single row."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    stream: list[int] = []
    owner: list[int] = []
    for i, toks in enumerate(token_lists):
        stream.extend(toks)
        stream.append(eos_id)
        owner.extend([i] * (len(toks) + 1))
    rows = len(stream) // (seq_len + 1)
    if rows == 0:
        raise ValueError(f"{len(stream)} tokens do not fill one sequence of {seq_len + 1}")
    n = rows * (seq_len + 1)
    ids = torch.tensor(stream[:n], dtype=torch.int64).view(rows, seq_len + 1)
    own = torch.tensor(owner[:n], dtype=torch.int64).view(rows, seq_len + 1)
    inputs, labels = ids[:, :-1].clone(), ids[:, 1:].clone()
    labels[own[:, 1:] != own[:, :-1]] = -100
    doc = own[:, :-1]
    doc = doc - doc[:, :1]  # 0-based per row
    return PackedBatch(inputs, labels, doc.contiguous())


def stdlib_corpus(tokenize: Callable[[str], list[int]], eos_id: int, seq_len: int, *, heldout_fraction: float = 0.1,
                  max_docs: int | None = None) -> tuple[PackedBatch, PackedBatch]:
    """Train and held-out packed sequences from the standard library's docstrings. Documents (not rows) are
    split, every 1/heldout_fraction-th document goes to held-out, so the two sets share no text."""
    docs = stdlib_documents()
    if max_docs is not None:
        docs = docs[:max_docs]
    every = max(2, round(1 / heldout_fraction))
    train = [tokenize(d) for i, d in enumerate(docs) if i % every]
    held = [tokenize(d) for i, d in enumerate(docs) if i % every == 0]
    return pack_documents(train, seq_len, eos_id), pack_documents(held, seq_len, eos_id)
