"""Checkpoint locations: a local path, ``s3://BUCKET/PREFIX``, or a prefix in another registered store.

:func:`location` turns what a user passed into a ``pathlib.Path`` (the local filesystem) or an
:class:`ObjectPath` (a prefix in an object store); :func:`storage_key` gives the :class:`Storage` holding a
location and its key there. Any URL scheme no store is registered for (``gs://``, ``http://``, ``file:``, ...) is
refused with :class:`UnsupportedLocationError`, never taken as a local directory named ``gs:``. A new store is
one module: a :class:`~oarlock.checkpoint.storage.backend.Storage` subclass and a :func:`register_store` call
(see :mod:`oarlock.checkpoint.storage.memory`).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from oarlock.checkpoint.storage.backend import Storage, UnsupportedLocationError

__all__ = ["ObjectPath", "is_object_path", "location", "register_store", "storage_for", "storage_key"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):(//?)?")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")

# scheme -> the store of one bucket; filled by the store modules (s3 here, memory on import)
_STORES: dict[str, Callable[[str], Storage]] = {}


def register_store(scheme: str, for_bucket: Callable[[str], Storage]) -> None:
    """Make ``SCHEME://BUCKET/PREFIX`` locations name prefixes in the store ``for_bucket(BUCKET)`` returns.
    Stores registered this way have object-store semantics: no rename, the commit record written last."""
    _STORES[scheme.lower()] = for_bucket


@dataclass(frozen=True)
class ObjectPath:
    """An object (or a prefix, when used as a checkpoint directory) ``scheme://bucket/key`` in an object store.

    ``key`` has no leading or trailing ``/``; the checkpoint at ``s3://b/run/ckpt`` holds the objects
    ``run/ckpt/metadata.json``, ``run/ckpt/rank-00000.safetensors``, ... It behaves like the few ``pathlib.Path``
    methods the checkpoint code uses (``/``, ``name``, ``parent``, ``exists``, ``is_file``, ``is_dir``,
    ``read_bytes``) and deliberately has no ``__fspath__``: handing it to ``open`` fails instead of creating a
    local file.
    """

    bucket: str
    key: str
    scheme: str = "s3"

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}" if self.key else f"{self.scheme}://{self.bucket}"

    def __truediv__(self, name: str) -> "ObjectPath":
        name = str(name).strip("/")
        return ObjectPath(self.bucket, f"{self.key}/{name}" if self.key else name, self.scheme)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> "ObjectPath":
        return ObjectPath(self.bucket, self.key.rsplit("/", 1)[0] if "/" in self.key else "", self.scheme)

    @property
    def storage(self) -> Storage:
        return _STORES[self.scheme](self.bucket)

    # the pathlib methods the checkpoint code calls on directories and files
    def exists(self) -> bool:
        """An object with this key, or a prefix holding at least one object."""
        return self.is_file() or bool(self.storage.list(self.key))

    def is_file(self) -> bool:
        return self.storage.exists(self.key)

    def is_dir(self) -> bool:
        """A prefix is a "directory" when it is not itself an object (object stores have no directories). Asked
        once per location and process (the checkpoint code asks on every data access)."""
        return _is_prefix(self.scheme, self.bucket, self.key)

    def is_symlink(self) -> bool:
        return False

    def read_bytes(self) -> bytes:
        return self.storage.read_bytes(self.key)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def iterdir(self) -> Iterable["ObjectPath"]:
        return [self / n for n in self.storage.list(self.key)]


@functools.lru_cache(maxsize=4096)
def _is_prefix(scheme: str, bucket: str, key: str) -> bool:
    return not _STORES[scheme](bucket).exists(key)


def is_object_path(p: Any) -> bool:
    """True for an :class:`ObjectPath` (a location in an object store)."""
    return isinstance(p, ObjectPath)


def location(path: "str | os.PathLike | ObjectPath") -> "Path | ObjectPath":
    """The checkpoint location ``path`` names: an :class:`ObjectPath` for ``s3://bucket/prefix`` (or another
    registered scheme), else a local ``Path``.

    Raises:
        UnsupportedLocationError: another URL scheme (``gs://``, ``http://``, ``file:``, ``az://``, ...), a URL
            without a valid bucket, or an ``s3:/...`` path (an ``s3://`` URL whose double slash ``pathlib.Path``
            collapsed).
    """
    if isinstance(path, ObjectPath):
        return path
    s = os.fspath(path)
    if isinstance(s, bytes):
        s = os.fsdecode(s)
    m = _SCHEME.match(s)
    # one letter before ':' is a Windows drive, never a scheme; "name:" without a slash is a local file name
    if m is None or len(m.group(1)) == 1 or (m.group(2) is None and m.group(1).lower() != "file"):
        return Path(s)
    scheme = m.group(1).lower()
    if scheme in _STORES and m.group(2) == "//":
        rest = s[m.end():]
        bucket, _, key = rest.partition("/")
        if not _BUCKET.match(bucket):
            what = "S3 bucket" if scheme == "s3" else "bucket"
            raise UnsupportedLocationError(f"{s}: {bucket!r} is not a valid {what} name (3-63 characters: "
                                           "lowercase letters, digits, '.' and '-')")
        parts = [p for p in key.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise UnsupportedLocationError(f"{s}: '.' and '..' are not allowed in an object key prefix")
        return ObjectPath(bucket, "/".join(parts), scheme)
    if scheme in _STORES:
        raise UnsupportedLocationError(f"{s}: looks like an {scheme}:// URL that lost a slash (pathlib.Path turns "
                                       f"'{scheme}://b/x' into '{scheme}:/b/x'); pass the URL as a string")
    raise UnsupportedLocationError(f"{s}: URL scheme {scheme!r} is not supported; checkpoints live in a local "
                                   "directory or in an S3-compatible object store (s3://bucket/prefix, with "
                                   "AWS_ENDPOINT_URL for non-AWS endpoints)")


def storage_for(p: "Path | ObjectPath") -> Storage:
    """The storage holding location ``p``: its bucket's store, or the :class:`LocalStorage`."""
    if isinstance(p, ObjectPath):
        return p.storage
    from oarlock.checkpoint.storage.local import LocalStorage

    return LocalStorage()


def storage_key(p: "str | os.PathLike | ObjectPath") -> tuple[Storage, str]:
    """``(storage, key)`` of location ``p`` (a key is a path string on the filesystem)."""
    p = location(p)
    return storage_for(p), (p.key if isinstance(p, ObjectPath) else os.fspath(p))


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def resolve_child(root: "Path | ObjectPath", name: str) -> "Path | ObjectPath":
    """The location of the relative name ``name`` (already free of ``..`` and absolute forms) inside the checkpoint
    ``root``, checked against what the store can do to escape it: in an object store, a URL (another bucket) or
    empty, ``.`` or ``\\`` components (keys are compared as strings, so ``a//b`` names another object); on a
    filesystem, symlinks resolving outside ``root`` (files of a HuggingFace hub snapshot ``.../snapshots/REV/``
    may resolve into the repository's ``blobs/``). Nothing is opened.

    Raises:
        ValueError: why the name is refused (the caller names the entry).
    """
    if isinstance(root, ObjectPath):
        if re.match(r"^[A-Za-z][A-Za-z0-9+.\-]*:", name):
            raise ValueError("is a URL (another bucket or store), outside the checkpoint prefix")
        if "\\" in name or any(p in ("", ".") for p in name.split("/")):
            raise ValueError("is not a plain relative object key (empty, '.' or '\\' components)")
        return root / name
    root = Path(root)
    path = root / name
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if _within(real, real_root):
        return path
    if root.parent.name == "snapshots" and (root.parent.parent / "blobs").is_dir():
        if _within(real, os.path.realpath(root.parent.parent / "blobs")):
            return path
    raise ValueError(f"resolves to {real}, outside the checkpoint directory {real_root} (a symlink)")
