"""Scoped logging: turn on oarlock's loggers for one region of code (Paddle's ``vlog_guard`` analogue)."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
from typing import IO, Iterator, Sequence

from oarlock.debug.errors import DebugError

_active: contextvars.ContextVar[frozenset] = contextvars.ContextVar("oarlock_log_scopes", default=frozenset())
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _ScopeFilter(logging.Filter):
    """Passes a record only when the code that emitted it runs inside this scope (same thread or task):
    other threads logging through the same loggers at the same time are not shown."""

    def __init__(self, token: object):
        super().__init__()
        self.token = token

    def filter(self, record: logging.LogRecord) -> bool:
        return self.token in _active.get()


def _level(level: int | str) -> int:
    if isinstance(level, bool):
        raise DebugError(f"level={level!r}: expected a logging level such as 'DEBUG' or 10")
    if isinstance(level, int):
        return level
    value = logging.getLevelName(str(level).upper())
    if not isinstance(value, int):
        raise DebugError(f"level={level!r}: unknown logging level (use DEBUG, INFO, WARNING, ERROR or a number)")
    return value


@contextlib.contextmanager
def log_scope(level: int | str = "DEBUG", modules: Sequence[str] | None = None, *,
              stream: IO[str] | None = None) -> Iterator[None]:
    """Show oarlock's log records at ``level`` and above, only while the ``with`` block runs.

    Args:
        level: a :mod:`logging` level (``"DEBUG"``, ``logging.INFO``, 10, ...).
        modules: the oarlock packages to enable, e.g. ``["debug", "checkpoint"]`` or full logger names
            (``"oarlock.memory"``); default all of ``oarlock``.
        stream: where records go (default ``sys.stderr``).

    Logger levels are restored on exit. Records from other threads or tasks running outside the block are
    filtered out (a context variable marks the scope).

    Raises:
        DebugError: an unknown level or a module name outside ``oarlock``.
    """
    lvl = _level(level)
    names = []
    for m in (modules if modules is not None else ["oarlock"]):
        if not isinstance(m, str) or not m:
            raise DebugError(f"modules: {m!r} is not a package name such as 'debug' or 'oarlock.checkpoint'")
        name = m if m == "oarlock" or m.startswith("oarlock.") else f"oarlock.{m}"
        names.append(name)
    token = object()
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setLevel(lvl)
    handler.setFormatter(logging.Formatter(_FORMAT))
    handler.addFilter(_ScopeFilter(token))
    saved = []
    for name in names:
        lg = logging.getLogger(name)
        saved.append((lg, lg.level))
        lg.setLevel(lvl)
        lg.addHandler(handler)
    reset = _active.set(_active.get() | {token})
    try:
        yield
    finally:
        _active.reset(reset)
        for lg, old in saved:
            lg.removeHandler(handler)
            lg.setLevel(old)
        handler.flush()
