"""Reading capture dumps (the JSONL files written by :func:`oarlock.debug.capture`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from oarlock.debug.capture import FORMAT, VERSION
from oarlock.debug.errors import DumpFormatError


@dataclass
class Dump:
    """A loaded capture dump.

    Attributes:
        path: the JSONL file.
        header: the header record (``checksum``, ``stacks``, ``tensors``, ``torch``, ...).
        ops: op records in execution order (dicts; keys in :mod:`oarlock.debug.capture`).
        stacks: stack id -> frames ``[(file, line, function), ...]``, innermost first.
        nodes: autograd node id -> node record.
    """

    path: Path
    header: dict
    ops: list[dict] = field(default_factory=list)
    stacks: dict[int, list[tuple[str, int, str]]] = field(default_factory=dict)
    nodes: dict[int, dict] = field(default_factory=dict)

    @property
    def checksum(self) -> str | None:
        return self.header.get("checksum")

    @property
    def tensors_path(self) -> Path | None:
        name = self.header.get("tensors")
        return self.path.with_name(name) if name else None

    def stack(self, sid: int | None) -> list[tuple[str, int, str]]:
        """Frames of a stack id (empty for None)."""
        return self.stacks.get(sid, []) if sid is not None else []

    def forward_ops(self) -> list[dict]:
        return [r for r in self.ops if r["ph"] == "f"]

    def backward_ops(self) -> list[dict]:
        return [r for r in self.ops if r["ph"] == "b"]

    def load_tensor(self, key: str) -> torch.Tensor | None:
        """A saved output (key ``"o12.0"``), or None when it was not saved."""
        p = self.tensors_path
        if p is None or not p.is_file():
            return None
        from safetensors import safe_open

        with safe_open(str(p), framework="pt") as f:
            return f.get_tensor(key) if key in f.keys() else None


def load_dump(path: str | os.PathLike) -> Dump:
    """Read a capture dump. Raises :class:`DumpFormatError` naming the file and line when it is not one,
    (also when it does not exist or cannot be read)."""
    path = Path(path)
    if path.is_dir():
        raise DumpFormatError(f"{path}: is a directory, expected a capture dump (.jsonl)")
    if not path.is_file():
        raise DumpFormatError(f"{path}: no such file (expected a capture dump written by oarlock.debug.capture)")
    with open(path, encoding="utf-8") as f:
        dump = None
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                kind = rec["k"] if isinstance(rec, dict) else None
            except (json.JSONDecodeError, KeyError):
                raise DumpFormatError(f"{path}:{lineno}: not a capture record") from None
            if dump is None:
                if kind != "header" or rec.get("format") != FORMAT:
                    raise DumpFormatError(f"{path}:{lineno}: not an oarlock debug capture (no {FORMAT} header)")
                if rec.get("version") != VERSION:
                    raise DumpFormatError(f"{path}:{lineno}: capture format version {rec.get('version')}, "
                                          f"this oarlock reads version {VERSION}")
                dump = Dump(path, rec)
            elif kind == "op":
                dump.ops.append(rec)
            elif kind == "stack":
                dump.stacks[rec["id"]] = [tuple(fr) for fr in rec["frames"]]
            elif kind == "node":
                dump.nodes[rec["id"]] = rec
            elif kind not in ("end",):
                raise DumpFormatError(f"{path}:{lineno}: unknown record kind {kind!r}")
    if dump is None:
        raise DumpFormatError(f"{path}: empty file, not a capture dump")
    return dump
