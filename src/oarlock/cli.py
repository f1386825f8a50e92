"""The ``oarlock`` command line.

Each capability package contributes its subcommands from a module exposing ``register(subparsers)`` (a
``commands`` module, or one module per command as in ``oarlock.checkpoint.cli``); this file only assembles them
and turns oarlock's errors into a one-line message with exit code 2 (the full traceback only with ``--debug``).

Lazy registration (why: importing torch costs seconds; ``oarlock --help`` and argument errors must not pay
it). :data:`COMMANDS` maps every top-level subcommand to the module that registers it and its one-line help.
:func:`main` imports only the module of the subcommand named on the command line; the other subcommands get
a placeholder parser carrying just that help line, so ``oarlock --help`` and an unknown command import no
capability package at all. A package adding a subcommand therefore:

1. adds ``parser = sub.add_parser("NAME", help=...)`` in its module's ``register(sub)`` (import heavy
   modules such as torch inside the command functions, not at the top of the module), and
2. adds ``"NAME": ("oarlock.PKG.MODULE", "one-line help")`` to :data:`COMMANDS` below
   (``tests/test_cli.py`` checks that the two agree).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from oarlock import __version__
from oarlock.errors import OarlockError

# subcommand -> (module whose register(sub) adds it, one-line help shown by ``oarlock --help``)
COMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("oarlock.checkpoint.cli.inspect",
                "list the tensors of a checkpoint (safetensors file, HF, oarlock or Paddle directory)"),
    "aoa": ("oarlock.checkpoint.cli.aoa", "AOA weight-transformation language tools"),
    "convert": ("oarlock.checkpoint.cli.convert", "convert a checkpoint: HF <-> oarlock (TP/PP-sharded) <-> torch "
                                                  "DCP; Paddle, Megatron, DeepSpeed, GGUF -> any, optionally through "
                                                  "an AOA config or preset"),
    "diff": ("oarlock.checkpoint.cli.diff", "compare the tensors of two checkpoints (any formats and layouts)"),
    "verify": ("oarlock.checkpoint.cli.verify",
               "check a checkpoint's integrity (block checksums, headers, coverage)"),
    "memory": ("oarlock.memory.commands", "allocator simulator and memory observer"),
    "debug": ("oarlock.debug.commands", "captured-run tools: diff two runs, render graphs, list ops"),
    "demo": ("oarlock.models.commands", "fine-tune SmolLM2-135M across parallel layouts (DP2 ZeRO-1 -> TP3), "
                                        "export to HF"),
}
# Kept for callers that iterate over the command modules (each listed once, in COMMANDS' order).
COMMAND_MODULES = tuple(dict.fromkeys(mod for mod, _ in COMMANDS.values()))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's default prints usage; keep one line + exit 2
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _chosen_command(argv: list[str]) -> str | None:
    """The subcommand named in ``argv``: the first word that is not an option (the top-level options take
    no value)."""
    for a in argv:
        if a == "--":
            return None
        if not a.startswith("-"):
            return a
    return None


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser. With ``argv`` given, only the module registering the subcommand named in it is
    imported (the others get a help-only placeholder); with None, every module registers its subcommands."""
    parser = _Parser(prog="oarlock", description="FlexCheckpoint, AOA, FlashMask, memory and debugging tools "
                                                  "for PyTorch large-model training.")
    parser.add_argument("--version", action="version", version=f"oarlock {__version__}")
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    if argv is None:
        load = set(COMMAND_MODULES)
    else:
        chosen = _chosen_command(argv)
        load = {COMMANDS[chosen][0]} if chosen in COMMANDS else set()
    done: set[str] = set()
    for name, (module, help_text) in COMMANDS.items():
        if module not in load:
            sub.add_parser(name, help=help_text, add_help=False)  # placeholder: never parsed
        elif module not in done:
            done.add(module)
            importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except (OarlockError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
        if args.debug:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"oarlock: error: {msg}", file=sys.stderr)
        if getattr(args, "json", False):  # a --json caller parses stdout: the failure is a JSON object there too
            print(json.dumps({"error": msg, "error_type": type(e).__name__, "exit_code": 2}))
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
