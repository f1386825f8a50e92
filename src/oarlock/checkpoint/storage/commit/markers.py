"""Names the commit protocol writes beside a checkpoint's data, shared by both implementations."""

from __future__ import annotations

from typing import Iterable

INCOMPLETE_MARKER = ".oarlock-incomplete"  # present in a save's temporary directory until it is committed

#: The list of entries a writer put into a directory it published (JSON ``{"written_by": "oarlock", "files":
#: [...]}``). It tells the files oarlock wrote from the ones a user added later: only the former are ever
#: replaced or removed.
WRITTEN_MANIFEST = ".oarlock-files"

FORMAT_ALIASES = {"hf": "huggingface"}  # writer-side names of formats (``convert --to hf``)


def describe(names: Iterable[str], limit: int = 8) -> str:
    """``'a', 'b' and 3 more``: entry names for a message."""
    shown = sorted(names)
    text = ", ".join(repr(n) for n in shown[:limit])
    return text + (f" and {len(shown) - limit} more" if len(shown) > limit else "")
