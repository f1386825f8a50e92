"""What the checkpoint commands share: a manager root resolved to its latest step, the key filters, AOA config files
and the one-line error a command returns with exit code 2. Light: torch and the checkpoint modules are imported
inside the functions (``oarlock convert --help`` must not wait for them)."""

from __future__ import annotations

import argparse
import json
import sys


def fail(message: str) -> int:
    """Print ``oarlock: error: MESSAGE`` on stderr; the exit code of a command refused for bad input (2)."""
    print(f"oarlock: error: {message}", file=sys.stderr)
    return 2


def resolve_path(path: str) -> str:
    """``path``, or the latest committed step when ``path`` is a CheckpointManager root (said on stderr)."""
    from oarlock.checkpoint.lifecycle.manager import resolve_manager_root

    resolved, step = resolve_manager_root(path)
    if step is not None:
        print(f"{path}: a CheckpointManager root; reading its latest committed step {step} ({resolved})",
              file=sys.stderr)
    return str(resolved)


def add_filters(p: argparse.ArgumentParser) -> None:
    """The ``--include`` / ``--exclude`` key globs."""
    p.add_argument("--include", action="append", metavar="GLOB",
                   help="only keys matching this glob (fnmatch syntax, e.g. 'model.layers.*'); repeatable")
    p.add_argument("--exclude", action="append", metavar="GLOB",
                   help="leave out keys matching this glob (e.g. '*.exp_avg*'); repeatable, applied after --include")


def reversed_config(config: object) -> dict:
    """An AOA config (a dict, or a list of statements) with ``aoa_config_reverse`` set."""
    config = {"aoa_statements": config} if isinstance(config, list) else dict(config)
    config["aoa_config_reverse"] = True
    return config


def read_aoa_config(path: str) -> object:
    """An AOA config file: JSON (``{"aoa_statements": [...], ...}`` or a list of strings) or plain text with one
    statement per line (blank lines and ``#`` comments ignored)."""
    from pathlib import Path

    from oarlock.checkpoint.aoa import AOASyntaxError

    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise AOASyntaxError(f"{path}: cannot read the AOA config: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise AOASyntaxError(f"{path}: not a text AOA config (byte {e.start} is not UTF-8)") from None
    if "\x00" in text:
        raise AOASyntaxError(f"{path}: not a text AOA config (it holds NUL bytes)")
    if text.lstrip()[:1] in ("{", "["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise AOASyntaxError(f"{path}: invalid JSON: {e}") from None
        except RecursionError:
            raise AOASyntaxError(f"{path}: JSON nested too deeply for an AOA config") from None
        statements = data.get("aoa_statements") if isinstance(data, dict) else data
        if not isinstance(statements, (list, str)) or not all(isinstance(x, str) for x in
                                                              ([statements] if isinstance(statements, str)
                                                               else statements)):
            raise AOASyntaxError(f"{path}: expected {{\"aoa_statements\": [\"...\", ...]}} or a list of statement "
                                 "strings")
        if not statements:
            raise AOASyntaxError(f"{path}: the AOA config holds no statements")
        return data
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise AOASyntaxError(f"{path}: the AOA config holds no statements")
    return lines
