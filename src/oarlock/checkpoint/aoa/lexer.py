"""Tokens of the AOA language (docs/aoa.md, "Grammar"), tried in this order at each position.

Extensions over PaddlePaddle 3.3: ``NUMBER`` may carry a leading ``-`` (negative axes), a quoted ``STRING`` may
stand for a key in a variable list (keys that start with a digit or contain ``-``, ``/``, ``:``), and an ``IDENT``
may start with ``*`` (``model.** -> **``). The language reference is docs/aoa.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from oarlock.checkpoint.aoa.errors import AOASyntaxError

TOKEN_KINDS = ("RARROW", "EQUAL", "COLON", "LBRACKET", "RBRACKET", "COMMA", "NUMBER", "STRING", "IDENT", "SKIP",
               "NEWLINE")
_PATTERN = re.compile("|".join(f"(?P<{k}>{p})" for k, p in [
    ("RARROW", r"->"),
    ("EQUAL", r"="),
    ("COLON", r":"),
    ("LBRACKET", r"\["),
    ("RBRACKET", r"\]"),
    ("COMMA", r","),
    ("NUMBER", r"-?\d+"),
    ("STRING", r"\"[^\"\n]*\"|'[^'\n]*'"),
    ("IDENT", r"[A-Za-z_*][A-Za-z0-9_.$*^]*"),
    ("SKIP", r"[ \t]+"),
    ("NEWLINE", r"[\r\n]+"),
]))


@dataclass(frozen=True)
class Token:
    """One token: ``kind`` (see :data:`TOKEN_KINDS`), ``value`` (int for NUMBER, unquoted text for STRING),
    ``pos`` (0-based offset in the statement string) and ``end``."""

    kind: str
    value: object
    pos: int
    end: int


def tokenize(text: str, index: int | None = None) -> list[Token]:
    """Split one ``aoa_statements`` string into tokens (SKIP dropped).

    Raises:
        AOASyntaxError: an illegal character, naming its column (and ``index``, the string's list position).
    """
    out: list[Token] = []
    pos, n = 0, len(text)
    while pos < n:
        m = _PATTERN.match(text, pos)
        if m is None:
            line_start = text.rfind("\n", 0, pos) + 1
            line_end = text.find("\n", pos)
            raise AOASyntaxError(f"unexpected character {text[pos]!r}", statement_index=index,
                                 column=pos - line_start + 1,
                                 statement=text[line_start:line_end if line_end >= 0 else n])
        kind = m.lastgroup
        assert kind is not None
        if kind != "SKIP":
            raw = m.group()
            value: object = int(raw) if kind == "NUMBER" else raw[1:-1] if kind == "STRING" else raw
            out.append(Token(kind, value, pos, m.end()))
        pos = m.end()
    return out
