"""oarlock.debug: record forward/backward aten ops with module paths, call stacks and checksums; render the
forward and autograd graphs; find where two runs diverge; scope oarlock's logging to a region.

Public surface: :func:`capture` (returns a :class:`Capture`), :func:`load_dump`, :func:`diff`,
:func:`forward_dot`, :func:`backward_dot`, :func:`render_graph_html`, :func:`log_scope`; the checksum
functions :func:`fast_hash`, :func:`md5_hash`, :func:`rounded_hash`; errors :class:`DebugError`,
:class:`DumpFormatError`. Dump format, checksum definitions and diff semantics: ``docs/memory-debug.md``.
Submodules import lazily (torch only when a name that needs it is used); ``dir()`` lists every name.
"""

from oarlock.debug.errors import DebugError, DumpFormatError
from oarlock.lazy import lazy_exports

_LAZY = {
    "Capture": "capture", "capture": "capture",
    "fast_hash": "checksum", "md5_hash": "checksum", "rounded_hash": "checksum",
    "DiffReport": "diff", "diff": "diff",
    "Dump": "dump", "load_dump": "dump",
    "backward_dot": "graph", "forward_dot": "graph", "render_graph_html": "graph",
    "render_html": "graph",  # the former name of render_graph_html, kept for compatibility
    "log_scope": "logs",
}

__all__ = ["Capture", "DebugError", "DiffReport", "Dump", "DumpFormatError", "backward_dot", "capture", "diff",
           "fast_hash", "forward_dot", "load_dump", "log_scope", "md5_hash", "render_graph_html", "rounded_hash"]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
