"""Reading capture dumps (the JSONL files written by :func:`oarlock.debug.capture`)."""

from __future__ import annotations

import json
import os
import re
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
        user_index: stack id -> index in its frames of the innermost user frame (outside torch,
            transformers, oarlock and installed packages), or None.
    """

    path: Path
    header: dict
    ops: list[dict] = field(default_factory=list)
    stacks: dict[int, list[tuple[str, int, str]]] = field(default_factory=dict)
    nodes: dict[int, dict] = field(default_factory=dict)
    user_index: dict[int, int | None] = field(default_factory=dict)

    def __repr__(self) -> str:  # ops can number hundreds of thousands: summarise
        return (f"Dump({str(self.path)!r}, ops={len(self.ops)}, stacks={len(self.stacks)}, nodes={len(self.nodes)}, "
                f"checksum={self.checksum!r})")

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

    def user_frame(self, sid: int | None) -> tuple[str, int, str] | None:
        """The innermost user frame ``(file, line, function)`` of a stack id, or None."""
        if sid is None or self.user_index.get(sid) is None:
            return None
        return self.stacks[sid][self.user_index[sid]]

    def format_stack(self, sid: int | None, max_frames: int = 6) -> list[str]:
        """Lines for a stack id: user frame first, library frames folded (see :func:`format_stack`)."""
        return format_stack(self.stack(sid), self.user_index.get(sid) if sid is not None else None, max_frames)

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


_SRC_RE = re.compile(r"o\d+\.\d+|p:.*", re.S)  # an input's source: output j of op i, or a parameter


def _is_meta(m) -> bool:
    return m is None or (isinstance(m, list) and len(m) == 2 and isinstance(m[0], list)
                         and all(isinstance(x, int) for x in m[0]) and isinstance(m[1], str))


def _opt(rec: dict, key: str, kind) -> bool:
    return rec.get(key) is None or (isinstance(rec[key], kind) and not isinstance(rec[key], bool))


def _check_op(rec: dict) -> bool:
    """The op record's fields have the types the readers rely on (see the format in ``capture``)."""
    lists_of = {"in": _is_meta, "out": _is_meta,
                "src": lambda x: x is None or (isinstance(x, str) and _SRC_RE.fullmatch(x) is not None),
                "h": lambda x: x is None or isinstance(x, str), "sv": lambda x: x is None or isinstance(x, str)}
    return (isinstance(rec.get("i"), int) and isinstance(rec.get("op"), str) and rec.get("ph") in ("f", "b")
            and all(_opt(rec, k, str) for k in ("mod", "nname", "rg"))
            and all(_opt(rec, k, int) for k in ("st", "fst", "node"))
            and all(rec.get(k) is None or (isinstance(rec[k], list) and all(map(ok, rec[k])))
                    for k, ok in lists_of.items()))


def _check_frames(frames) -> bool:
    return isinstance(frames, list) and all(
        isinstance(f, list) and len(f) == 3 and isinstance(f[0], str) and isinstance(f[1], int)
        and isinstance(f[2], str) for f in frames)


def load_dump(path: str | os.PathLike, *, allow_incomplete: bool = False) -> Dump:
    """Read a capture dump.

    Args:
        path: the ``.jsonl`` file written by :func:`oarlock.debug.capture`.
        allow_incomplete: also read a dump without its ``end`` record or whose capture raised (the
            ``<path>.partial`` file a failed capture leaves); by default such a dump is refused.

    Raises:
        DumpFormatError: naming the file (and line) when it is missing, unreadable, not UTF-8 text, not a
            capture dump, of another format version, nested too deeply, or incomplete.
    """
    path = Path(path)
    if path.is_dir():
        raise DumpFormatError(f"{path}: is a directory, expected a capture dump (.jsonl)")
    if not path.is_file():
        hint = ""
        if path.with_name(path.name + ".partial").is_file():
            hint = f"; {path.name}.partial holds an incomplete capture (the captured code raised)"
        raise DumpFormatError(f"{path}: no such file (expected a capture dump written by oarlock.debug.capture)"
                              + hint)
    dump = None
    end = None
    lineno = 0
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    raise DumpFormatError(f"{path}:{lineno}: not a capture record (invalid JSON)") from None
                kind = rec.get("k") if isinstance(rec, dict) else None
                if dump is None:
                    if kind != "header" or rec.get("format") != FORMAT:
                        raise DumpFormatError(f"{path}:{lineno}: not an oarlock debug capture (no {FORMAT} "
                                              "header)")
                    if rec.get("version") != VERSION:
                        raise DumpFormatError(f"{path}:{lineno}: capture format version {rec.get('version')}, "
                                              f"this oarlock reads version {VERSION}")
                    dump = Dump(path, rec)
                elif kind == "op":
                    if not _check_op(rec):
                        raise DumpFormatError(f"{path}:{lineno}: malformed op record")
                    dump.ops.append(rec)
                elif kind == "stack":
                    if not isinstance(rec.get("id"), int) or not _check_frames(rec.get("frames")):
                        raise DumpFormatError(f"{path}:{lineno}: malformed stack record")
                    dump.stacks[rec["id"]] = [tuple(fr) for fr in rec["frames"]]
                    u = rec.get("u", _guess_user(rec["frames"]))
                    dump.user_index[rec["id"]] = u if isinstance(u, int) and 0 <= u < len(rec["frames"]) else None
                elif kind == "node":
                    if (not isinstance(rec.get("id"), int) or not isinstance(rec.get("name"), str)
                            or not _opt(rec, "mod", str) or not _opt(rec, "st", int)
                            or not (rec.get("next") is None or (isinstance(rec["next"], list) and all(
                                n is None or (isinstance(n, list) and len(n) == 2
                                              and all(isinstance(x, int) for x in n)) for n in rec["next"])))
                            or not (rec.get("grads") is None or (isinstance(rec["grads"], list)
                                                                 and all(map(_is_meta, rec["grads"]))))):
                        raise DumpFormatError(f"{path}:{lineno}: malformed autograd node record")
                    dump.nodes[rec["id"]] = rec
                elif kind == "end":
                    end = rec
                else:
                    raise DumpFormatError(f"{path}:{lineno}: unknown record kind {kind!r}")
    except UnicodeDecodeError:
        raise DumpFormatError(f"{path}:{lineno + 1}: not UTF-8 text, not a capture dump") from None
    except RecursionError:
        raise DumpFormatError(f"{path}:{lineno}: JSON nested too deeply, not a capture record") from None
    except OSError as e:
        raise DumpFormatError(f"{path}: cannot read ({e.strerror or e})") from None
    if dump is None:
        raise DumpFormatError(f"{path}: empty file, not a capture dump")
    if not allow_incomplete:
        if end is None:
            raise DumpFormatError(f"{path}: incomplete capture (no end record: the capture was interrupted)")
        if end.get("error"):
            raise DumpFormatError(f"{path}: incomplete capture: the captured code raised {end['error']}")
    return dump


def _guess_user(frames: list) -> int | None:
    """Innermost frame outside torch/transformers/oarlock/installed packages, for dumps without ``u``."""
    lib = (f"{os.sep}torch{os.sep}", f"{os.sep}transformers{os.sep}", f"{os.sep}oarlock{os.sep}",
           f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
    for k, fr in enumerate(frames):
        if isinstance(fr, list) and fr and isinstance(fr[0], str) and not any(p in fr[0] for p in lib):
            return k
    return None


def _short(file: str) -> str:
    """A library file's path from its package directory on (``torch/nn/modules/module.py``)."""
    for pkg in ("torch", "transformers", "oarlock", "site-packages", "dist-packages"):
        k = file.rfind(f"{os.sep}{pkg}{os.sep}")
        if k >= 0:
            return file[k + 1:].removeprefix("site-packages/").removeprefix("dist-packages/")
    return file


def format_stack(frames: list, user: int | None, max_frames: int = 6) -> list[str]:
    """Lines showing a recorded stack: the innermost user frame first, then the library frames inside it
    folded onto one line, then up to ``max_frames - 1`` outer frames. Without a user frame, the innermost
    ``max_frames`` frames."""
    if not frames:
        return []
    if user is None:
        return ["(no frame outside torch/transformers/oarlock)"] + \
            [f"{f}:{ln} in {fn}" for f, ln, fn in frames[:max_frames]]
    f, ln, fn = frames[user]
    out = [f"{f}:{ln} in {fn}"]
    if user:
        # the innermost frame, then the first frame of each change of package (torch -> transformers ...)
        shown, last_pkg = [], None
        for f, ln, fn in frames[:user]:
            short = _short(f)
            pkg = short.split("/", 1)[0]
            if pkg != last_pkg:
                shown.append(f"{short}:{ln} {fn}")
                last_pkg = pkg
        if len(shown) > 4:
            shown = shown[:3] + ["..."]
        out.append(f"  [{user} library frame{'s' if user > 1 else ''} folded: {' < '.join(shown)}]")
    out += [f"  called from {f}:{ln} in {fn}" for f, ln, fn in frames[user + 1:user + max(1, max_frames)]]
    return out
