"""Errors of the AOA language. Every message points at the statement (its index in ``aoa_statements`` and its
text), the column, and the chain of macro expansions that produced the failing expression."""

from __future__ import annotations

from typing import TYPE_CHECKING

from oarlock.checkpoint.errors import CheckpointError

if TYPE_CHECKING:  # pragma: no cover
    from oarlock.checkpoint.aoa.parser import Expr


class AOAError(CheckpointError):
    """A statement cannot be applied to the given source/destination keys (unknown name, shape or dtype
    mismatch, indivisible split, zero-match pattern, ...).

    Attributes:
        reason: the message without location information.
        statement_index: index of the statement string in ``aoa_statements`` (None when not tied to one).
        column: 1-based column of the culprit in the text shown as ``statement`` (None if unknown).
        statement: the text the column refers to (the original string or a macro expansion of it).
        chain: ``[(stage, text), ...]`` from the original statement through each macro expansion.
    """

    def __init__(self, reason: str, expr: "Expr | None" = None, *, name: str | None = None,
                 column: int | None = None, statement_index: int | None = None, statement: str | None = None):
        self.reason = reason
        self.chain: list[tuple[str, str]] = []
        self.statement_index = statement_index
        self.statement = statement
        self.column = column
        if expr is not None:
            self.statement_index = expr.source.index
            self.chain = expr.chain()
            self.statement, self.column = expr.locate(name) if column is None else (self.chain[-1][1], column)
        super().__init__(self._format())

    def _format(self) -> str:
        where = []
        if self.statement_index is not None:
            where.append(f"aoa_statements[{self.statement_index}]")
        if self.column is not None:
            where.append(f"column {self.column}")
        head = f"{', '.join(where)}: {self.reason}" if where else self.reason
        lines = [head]
        if self.statement is not None:
            lines.append(f"    {self.statement}")
            if self.column is not None:
                lines.append("    " + " " * (self.column - 1) + "^")
        if len(self.chain) > 1:
            lines.append("  macro expansion chain (original first):")
            for stage, text in self.chain:
                lines.append(f"    [{stage}] {text}")
        return "\n".join(lines)


class AOASyntaxError(AOAError):
    """A statement cannot be lexed, parsed or macro-expanded: illegal character, missing ``->``, bad
    attribute value, wrong arity or missing parameter of a fused macro, ``^T`` on the right, ..."""
