"""The checkpoint commands of the ``oarlock`` CLI, one module per command: :mod:`.inspect`, :mod:`.diff`,
:mod:`.verify`, :mod:`.aoa` (``aoa explain``) and :mod:`.convert`; :mod:`.common` holds what they share.

Each module has a ``register(sub)`` adding its one subcommand; :data:`oarlock.cli.COMMANDS` names that module, so
``oarlock CMD`` imports only CMD's (no module here imports torch at the top). :func:`register` adds all five.
"""

from __future__ import annotations

import argparse

from oarlock.checkpoint.cli import aoa, convert, diff, inspect, verify
from oarlock.checkpoint.cli.aoa import cmd_aoa_explain, read_target_keys
from oarlock.checkpoint.cli.common import read_aoa_config
from oarlock.checkpoint.cli.convert import cmd_convert
from oarlock.checkpoint.cli.diff import cmd_diff
from oarlock.checkpoint.cli.inspect import cmd_inspect
from oarlock.checkpoint.cli.verify import cmd_verify

__all__ = ["cmd_aoa_explain", "cmd_convert", "cmd_diff", "cmd_inspect", "cmd_verify", "read_aoa_config",
           "read_target_keys", "register"]


def register(sub: argparse._SubParsersAction) -> None:
    """Add every checkpoint command to ``sub``."""
    for module in (inspect, aoa, convert, diff, verify):
        module.register(sub)
