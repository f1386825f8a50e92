"""The ``oarlock`` command line.

Each capability package contributes its subcommands from a ``commands`` module exposing
``register(subparsers)``; this file only assembles them and turns oarlock's errors into a one-line message
with exit code 2 (the full traceback only with ``--debug``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from oarlock import __version__
from oarlock.errors import OarlockError

# Packages that add subcommands; a package without a commands module yet is skipped.
COMMAND_MODULES = (
    "oarlock.checkpoint.commands",
    "oarlock.attention.commands",
    "oarlock.memory.commands",
    "oarlock.debug.commands",
    "oarlock.models.commands",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's default prints usage; keep one line + exit 2
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="oarlock", description="FlexCheckpoint, AOA, FlashMask, memory and debugging tools "
                                                  "for PyTorch large-model training.")
    parser.add_argument("--version", action="version", version=f"oarlock {__version__}")
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMAND_MODULES:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except (OarlockError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
        if args.debug:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"oarlock: error: {msg}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into head & co: not an error
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("oarlock: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
