"""oarlock.debug: record forward/backward aten ops with module paths, call stacks and checksums; render the
forward and autograd graphs; find where two runs diverge; scope oarlock's logging to a region.

Public surface: :func:`capture` (returns a :class:`Capture`), :func:`load_dump`, :func:`diff`,
:func:`forward_dot`, :func:`backward_dot`, :func:`render_html`, :func:`log_scope`; the checksum functions
:func:`fast_hash`, :func:`md5_hash`, :func:`rounded_hash`; errors :class:`DebugError`,
:class:`DumpFormatError`. Design: memory_debug.md sections 3.2-3.3 and 5.
"""

from oarlock.debug.capture import Capture, capture
from oarlock.debug.checksum import fast_hash, md5_hash, rounded_hash
from oarlock.debug.diff import DiffReport, diff
from oarlock.debug.dump import Dump, load_dump
from oarlock.debug.errors import DebugError, DumpFormatError
from oarlock.debug.graph import backward_dot, forward_dot, render_html
from oarlock.debug.logs import log_scope

__all__ = ["Capture", "DebugError", "DiffReport", "Dump", "DumpFormatError", "backward_dot", "capture", "diff",
           "fast_hash", "forward_dot", "load_dump", "log_scope", "md5_hash", "render_html", "rounded_hash"]
