"""Parse AOA statement strings into :class:`Expr` objects (docs/aoa.md, "Grammar").

Grammar (names may still hold macro syntax at this stage: ``$LAYER_ID``, ``*``, ``^T``, ``name[a:b]``)::

    program    := { NEWLINE } { statement { NEWLINE } }
    statement  := var_list "->" var_list [ "," attr_list ]
    var_list   := var { "," var }        # on the right, IDENT "=" starts the attributes;
                                         # fused_qkv / fused_qkv_old / fused_ffn are keywords there
    var        := IDENT [ "[" NUMBER ":" NUMBER "]" ] | STRING
    attr_list  := attr { "," attr }
    attr       := IDENT "=" ( NUMBER | STRING | "[" [ NUMBER { "," NUMBER } ] "]" )   # unquoted list: extension

A NEWLINE between statements is optional after an attribute value (Paddle's greedy parser accepts
``"a -> b, axis=1" "c -> d"`` concatenated by accident in real configs); such a join is accepted with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

from oarlock.checkpoint.aoa.errors import AOASyntaxError
from oarlock.checkpoint.aoa.lexer import Token, tokenize
from oarlock.utils import logger

KEYWORDS = ("fused_qkv", "fused_qkv_old", "fused_ffn")
VOID = "_"


@dataclass(eq=False)
class Source:
    """Where an expression comes from: ``index`` in ``aoa_statements``, the statement ``text``, and the
    1-based column of each name in that text."""

    index: int
    text: str
    columns: dict[str, int] = field(default_factory=dict)


class Expr:
    """One statement, before or after macro expansion.

    ``lhs``/``rhs``: names left and right of ``->``; ``attrs``: ``[(name, value), ...]`` in written order
    (int or str values); ``keyword``: a fused macro keyword or None; ``source``: the original statement;
    ``parent``/``stage``: the expression this one was expanded from and the macro that did it.
    """

    __slots__ = ("lhs", "rhs", "attrs", "keyword", "source", "parent", "stage")

    def __init__(self, lhs: Sequence[str], rhs: Sequence[str], attrs: Sequence[tuple[str, object]],
                 keyword: str | None, source: Source, parent: "Expr | None" = None, stage: str = "statement"):
        # tuples of strings: immutable, and untracked by the cyclic GC (a config can expand to 100,000 of these)
        self.lhs, self.rhs, self.attrs, self.keyword = tuple(lhs), tuple(rhs), tuple(attrs), keyword
        self.source, self.parent, self.stage = source, parent, stage

    def derive(self, stage: str, lhs: Sequence[str], rhs: Sequence[str],
               attrs: Sequence[tuple[str, object]] | None = None,
               keyword: str | None = None) -> "Expr":
        """A new expression expanded from this one by macro ``stage``."""
        return Expr(lhs, rhs, self.attrs if attrs is None else attrs, keyword, self.source, self, stage)

    def attr(self, name: str, default: object = None) -> object:
        for k, v in self.attrs:
            if k == name:
                return v
        return default

    def render(self) -> str:
        """Canonical text: ``a, b -> c, fused_ffn, axis=1, dtype='float32'``."""
        right = list(self.rhs)
        if self.keyword:
            right.append(self.keyword)
        right += [f"{k}={v!r}" for k, v in self.attrs]
        return f"{', '.join(self.lhs)} -> {', '.join(right)}"

    def chain(self) -> list[tuple[str, str]]:
        """``[(stage, text), ...]`` from the original statement through every expansion down to this one."""
        out = []
        e: Expr | None = self
        while e is not None:
            out.append((e.stage, e.source.text if e.parent is None else e.render()))
            e = e.parent
        return out[::-1]

    def locate(self, name: str | None) -> tuple[str, int | None]:
        """(text, 1-based column of ``name`` in it): the original text when unexpanded, else the expansion."""
        if self.parent is None:
            return self.source.text, self.source.columns.get(name) if name is not None else None
        text = self.render()
        if name is None:
            return text, None
        i = text.find(name)
        return text, (i + 1 if i >= 0 else None)

    def names(self) -> Iterator[str]:
        yield from self.lhs
        yield from self.rhs

    def __repr__(self) -> str:
        return f"Expr({self.render()!r})"


class _Parser:
    def __init__(self, text: str, index: int):
        self.text, self.index = text, index
        self.toks = tokenize(text, index)
        self.i = 0

    def peek(self, k: int = 0) -> Token | None:
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else None

    def error(self, msg: str, tok: Token | None) -> AOASyntaxError:
        pos = tok.pos if tok is not None else len(self.text)
        line_start = self.text.rfind("\n", 0, pos) + 1
        line_end = self.text.find("\n", pos)
        return AOASyntaxError(msg, statement_index=self.index, column=pos - line_start + 1,
                              statement=self.text[line_start:line_end if line_end >= 0 else len(self.text)])

    def expect(self, kind: str, what: str) -> Token:
        tok = self.peek()
        if tok is None or tok.kind != kind:
            got = "end of statement" if tok is None else f"{tok.kind} {self.text[tok.pos:tok.end]!r}"
            raise self.error(f"expected {what}, got {got}", tok)
        self.i += 1
        return tok

    def var(self, cols: dict[str, int], start: int) -> str:
        tok = self.peek()
        if tok is not None and tok.kind == "STRING":
            self.i += 1
            name = str(tok.value)
        else:
            tok = self.expect("IDENT", "a tensor name")
            name = str(tok.value)
            nxt = self.peek()
            if nxt is not None and nxt.kind == "LBRACKET":  # array macro name[a:b]
                self.i += 1
                a = self.expect("NUMBER", "a number in name[a:b]").value
                self.expect("COLON", "':' in name[a:b]")
                b = self.expect("NUMBER", "a number in name[a:b]").value
                self.expect("RBRACKET", "']' closing name[a:b]")
                name = f"{name}[{a}:{b}]"
        cols.setdefault(name, tok.pos - start + 1)
        return name

    def int_list(self) -> str:
        """``[ NUMBER { , NUMBER } ]`` (or ``[]``) as the text ``'[a, b]'``, the form of a quoted list value."""
        self.expect("LBRACKET", "'['")
        nums: list[str] = []
        while (t := self.peek()) is not None and t.kind != "RBRACKET":
            if nums:
                self.expect("COMMA", "',' or ']' in a list")
            nums.append(str(self.expect("NUMBER", "a number in a list").value))
        self.expect("RBRACKET", "']' closing the list")
        return "[" + ", ".join(nums) + "]"

    def statements(self) -> Iterator[Expr]:
        while True:
            while (t := self.peek()) is not None and t.kind == "NEWLINE":
                self.i += 1
            if self.peek() is None:
                return
            yield self.statement()

    def statement(self) -> Expr:
        first = self.peek()
        assert first is not None
        start = first.pos
        cols: dict[str, int] = {}
        lhs = [self.var(cols, start)]
        while (t := self.peek()) is not None and t.kind == "COMMA":
            self.i += 1
            lhs.append(self.var(cols, start))
        self.expect("RARROW", "'->'")
        rhs: list[str] = []
        keyword: str | None = None
        attrs: list[tuple[str, object]] = []
        while True:
            t, t2 = self.peek(), self.peek(1)
            if t is not None and t.kind == "IDENT" and t2 is not None and t2.kind == "EQUAL" and rhs:
                break  # attributes start
            if t is not None and t.kind == "IDENT" and t.value in KEYWORDS:
                if keyword is not None:
                    raise self.error(f"two fused keywords in one statement ({keyword}, {t.value})", t)
                keyword = str(t.value)
                cols.setdefault(keyword, t.pos - start + 1)
                self.i += 1
            else:
                rhs.append(self.var(cols, start))
            t = self.peek()
            if t is None or t.kind != "COMMA":
                break
            self.i += 1
        if not rhs:
            raise self.error("expected a tensor name right of '->'", self.peek())
        t, t2 = self.peek(), self.peek(1)
        if t is not None and t.kind == "IDENT" and t2 is not None and t2.kind == "EQUAL":
            while True:
                name_tok = self.expect("IDENT", "an attribute name")
                self.expect("EQUAL", "'='")
                val = self.peek()
                cols.setdefault(str(name_tok.value), name_tok.pos - start + 1)
                if val is not None and val.kind == "LBRACKET":  # an unquoted list: reshape=[2, -1], permute=[1, 0]
                    attrs.append((str(name_tok.value), self.int_list()))
                else:
                    if val is None or val.kind not in ("NUMBER", "STRING"):
                        raise self.error(f"unexpected value for attribute {name_tok.value!r}: expected a number, a "
                                         "quoted string or a list of numbers", val)
                    self.i += 1
                    attrs.append((str(name_tok.value), val.value))
                t = self.peek()
                if t is None or t.kind != "COMMA":
                    break
                self.i += 1
        end_tok = self.toks[self.i - 1]
        t = self.peek()
        if t is not None and t.kind != "NEWLINE":
            if attrs and t.kind in ("IDENT", "STRING"):
                logger.warning("AOA aoa_statements[%d]: statement %r is followed by another one without a newline "
                               "(two string literals joined?); parsed as two statements", self.index,
                               self.text[start:end_tok.end])
            else:
                raise self.error(f"unexpected {t.kind} {self.text[t.pos:t.end]!r} after the statement", t)
        return Expr(lhs, rhs, attrs, keyword, Source(self.index, self.text[start:end_tok.end], cols))


def parse_statements(statements: list[str]) -> list[Expr]:
    """Parse every string of ``aoa_statements`` (each may hold several statements separated by newlines).

    Raises:
        AOASyntaxError: naming the string's index, the column and what was expected.
    """
    out: list[Expr] = []
    for index, text in enumerate(statements):
        if not isinstance(text, str):
            raise AOASyntaxError(f"statement must be a string, got {type(text).__name__}: {text!r}",
                                 statement_index=index)
        out.extend(_Parser(text, index).statements())
    return out
