"""The one safetensors implementation of oarlock: header parsing, byte-range reads, and a header-first writer.

Format (https://github.com/huggingface/safetensors#format): 8 bytes little-endian ``N``, ``N`` bytes of JSON
header ``{name: {"dtype": code, "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {str: str}}``
(padded with spaces so the data starts 8-byte aligned), then the data section; offsets are relative to its
start. See ``docs/checkpoint-format.md`` for how oarlock uses the ``__metadata__`` block.

* :func:`read_header` is the only header parser: it checks every entry (dtype code known to oarlock, offsets
  inside the file and matching shape and dtype) and has the safetensors library validate the file as well
  before any byte is trusted; errors are :class:`CheckpointFormatError` naming the file and tensor.
* :class:`SafetensorsFile` reads any box of a stored tensor straight into destination memory (``os.preadv``).
* :class:`SafetensorsWriter` is the only writer: the header goes first (shapes and dtypes are known up
  front), then each tensor's bytes land at their offset, from a tensor (``pwrite``) or from byte runs of
  another file (``os.copy_file_range``). :func:`write_safetensors` writes a dict of tensors with it. Tensors
  that share storage (tied weights, views of one buffer) are written as independent copies of their bytes:
  this is the one place that handles shared tensors.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from oarlock.checkpoint.errors import CheckpointError, CheckpointFormatError
from oarlock.checkpoint.model.names import RESERVED_NAME
from oarlock.checkpoint.storage.backend import pread_into
from oarlock.checkpoint.storage.location import is_object_path
from oarlock.utils import dtype_itemsize, dtype_name, numel, safetensors_code, submit, torch_dtype

MAX_HEADER_BYTES = 100 * 1024 * 1024
SUPPORTED_CODES = "F64 F32 F16 BF16 F8_E4M3 F8_E5M2 I64 I32 I16 I8 U64 U32 U16 U8 BOOL C64"


def np_prod(xs) -> int:
    """The product of a shape's dimensions as Python ints (a foreign file's numpy integers would wrap)."""
    return numel(map(int, xs))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass
class SafetensorsHeader:
    """A parsed, validated header.

    Attributes:
        entries: tensor name -> ``(dtype name, shape, begin, end)`` (offsets relative to ``data_start``), in
            header order.
        metadata: the ``__metadata__`` block (str -> str).
        data_start: byte offset of the data section (8 + header length).
    """

    entries: dict[str, tuple[str, tuple[int, ...], int, int]] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    data_start: int = 0


def _library_check(path: Path) -> None:
    """Have the safetensors library validate the file (overlapping or missing offsets, bad JSON, ...)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as e:  # SafetensorError, OSError
        msg = str(e).replace("Error while deserializing header: ", "")
        raise CheckpointFormatError(f"{path}: invalid safetensors file: {msg}") from None


def read_header(path: str | Path, fd: int | None = None) -> SafetensorsHeader:
    """Parse and validate the header of the safetensors file at ``path`` (through ``fd`` when given).

    Checks, in order: a dtype code oarlock does not know (naming the tensor and code); the safetensors library's
    own validation (overlapping or missing offsets, bad JSON, truncation; its message); then every entry's
    offsets against its shape, dtype and the file size.

    Raises:
        CheckpointFormatError: ``"{path}: invalid safetensors file: ..."`` or ``"{path}: tensor ...``" naming the
            file and the tensor at fault; a missing file.
    """
    remote = is_object_path(path)
    path = path if remote else Path(path)
    if remote:
        size, pread = path.storage.ranged_reader(path.key)
        own = False
    else:
        own = fd is None
        if own:
            if not path.is_file():
                raise CheckpointFormatError(f"{path}: file not found")
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointFormatError(f"{path}: cannot open: {e.strerror or e}") from None
        size = os.fstat(fd).st_size
        pread = lambda n, off: os.pread(fd, n, off)  # noqa: E731
    try:
        raw: Any = None
        head = pread(8, 0)
        if len(head) == 8:
            (n,) = struct.unpack("<Q", head)
            if n <= min(size - 8, MAX_HEADER_BYTES):
                try:
                    raw = json.loads(pread(n, 8))
                except (ValueError, UnicodeDecodeError):
                    raw = None
    finally:
        if own:
            os.close(fd)
    if isinstance(raw, dict):  # name the tensor of an unknown dtype (the library's message names neither)
        for name, e in raw.items():
            if name == "__metadata__" or not isinstance(e, dict):
                continue
            try:
                dtype_name(str(e.get("dtype")))
            except ValueError:
                raise CheckpointFormatError(f"{path}: tensor {name!r} has dtype {e.get('dtype')!r}, which oarlock "
                                            f"does not support (safetensors codes: {SUPPORTED_CODES})") from None
    if isinstance(raw, dict):  # the most common damage, named as such (the library says "not fully covered")
        ends = [e["data_offsets"][1] for k, e in raw.items() if k != "__metadata__" and isinstance(e, dict)
                and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
                and isinstance(e["data_offsets"][1], int)]
        if ends and 8 + n + max(ends) > size:
            raise CheckpointFormatError(f"{path}: invalid safetensors file: the header's data offsets run to byte "
                                        f"{8 + n + max(ends)}, the file has only {size} bytes (truncated, or a "
                                        "corrupt header)")
    if not remote:  # the library reads files by path; an object's header is checked by the code below alone
        _library_check(path)
    if not isinstance(raw, dict):
        raise CheckpointFormatError(f"{path}: invalid safetensors file: unreadable header")
    hdr = SafetensorsHeader(data_start=8 + n)
    meta = raw.get("__metadata__") or {}
    hdr.metadata = dict(meta) if isinstance(meta, dict) else {}
    for name, e in raw.items():
        if name == "__metadata__":
            continue
        try:
            dt = dtype_name(str(e["dtype"]))
            shape = tuple(int(x) for x in e["shape"])
            begin, end = (int(x) for x in e["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointFormatError(f"{path}: invalid safetensors file: tensor {name!r}: bad header entry "
                                        f"({err})") from None
        want = np_prod(shape) * torch_dtype(dt).itemsize
        if end - begin != want or begin < 0 or hdr.data_start + end > size:
            raise CheckpointFormatError(f"{path}: invalid safetensors file: tensor {name!r}: data offsets [{begin}, "
                                        f"{end}) do not fit shape {list(shape)} {dt} in a file of {size} bytes")
        hdr.entries[name] = (dt, shape, begin, end)
    # no two tensors may share bytes (checked here too, not only by the library: its check reads the file by
    # path, this header came through ``fd``)
    prev = None
    for name, (_, _, begin, end) in sorted(hdr.entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if prev is not None and begin < prev[1] and end > begin:
            raise CheckpointFormatError(f"{path}: invalid safetensors file: tensors {prev[0]!r} and {name!r} "
                                        f"overlap (data offsets [{prev[2]}, {prev[1]}) and [{begin}, {end}))")
        if end > begin:
            prev = (name, end, begin)
    return hdr


def safetensors_header(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Validated header of one safetensors file: ``{tensor name: (shape, dtype name)}`` sorted by name (the
    order the safetensors library lists them in).

    Raises:
        CheckpointFormatError: see :func:`read_header`.
    """
    hdr = read_header(path)
    return {name: (hdr.entries[name][1], hdr.entries[name][0]) for name in sorted(hdr.entries)}


# ---------------------------------------------------------------- byte-range reads

_RUN_BYTES = 256 * 1024  # contiguous runs at least this long are read one pread each
_BOUNCE_BYTES = 2 * 1024 * 1024  # the rows of a strided read staged at a time: about a core's share of cache
_bounce_local = threading.local()


def _bounce(nbytes: int) -> torch.Tensor:
    """This thread's staging buffer for strided reads, at least ``nbytes`` (uint8, reused: no page faults). A
    request beyond :data:`_BOUNCE_BYTES` (one row longer than that) gets a buffer of its own, not kept: a thread
    must not hold the largest row it ever read for the life of the process."""
    if nbytes > _BOUNCE_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8)
    buf = getattr(_bounce_local, "buf", None)
    if buf is None:
        buf = _bounce_local.buf = torch.empty(_BOUNCE_BYTES, dtype=torch.uint8)
    return buf


class SafetensorsFile:
    """A safetensors file opened for byte-range reads (``os.preadv`` straight into the destination memory).

    The header is parsed and checked (offsets inside the file, sizes matching shapes and dtypes) before any
    data byte is read; the format is specified at https://github.com/huggingface/safetensors#format.

    Raises:
        CheckpointFormatError: naming the file and tensor at fault.
    """

    def __init__(self, path: Any):
        if is_object_path(path):  # an object in a store: ranged GETs through the storage layer, no descriptor
            self.path, self.fd = path, -1
            hdr = read_header(path)
            self.data_start, self.header_metadata, self.entries = hdr.data_start, hdr.metadata, hdr.entries
            return
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointFormatError(f"{self.path}: cannot open: {e.strerror or e}") from None
        try:
            hdr = read_header(self.path, self.fd)
        except BaseException:
            os.close(self.fd)
            raise
        self.data_start = hdr.data_start
        self.header_metadata: dict[str, str] = hdr.metadata
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = hdr.entries

    @property
    def packed(self) -> bool:
        """True for a packed oarlock data file (:data:`~oarlock.checkpoint.model.grid.PACKED_ENTRY`)."""
        from oarlock.checkpoint.model.grid import PACKED_ENTRY, PackedEntries

        return PACKED_ENTRY in self.entries and not isinstance(self.entries, PackedEntries)  # not yet resolved

    def use_packed(self, layout: Any, rank: int | None) -> None:
        """Resolve a packed data file's pieces from the checkpoint's metadata (``layout``, a
        :class:`~oarlock.checkpoint.model.grid.PackedLayout`; ``rank``: the rank whose file this is): afterwards
        ``entries`` names every piece by its key. A file that is not packed is left as it is.

        Raises:
            CheckpointFormatError: naming the file: the packed entry is not ``U8`` 1-D, no metadata or rank to
                resolve it with, or its size disagrees with the metadata.
        """
        from oarlock.checkpoint.model.grid import PACKED_ENTRY

        if not self.packed:
            return
        dt, shape, begin, end = self.entries[PACKED_ENTRY]
        if dt != "uint8" or len(shape) != 1:
            raise CheckpointFormatError(f"{self.path}: the packed entry {PACKED_ENTRY!r} is {dt} of shape "
                                        f"{list(shape)}, not a 1-D uint8 array")
        if layout is None or rank is None:
            raise CheckpointFormatError(f"{self.path}: a packed data file is read with its checkpoint's "
                                        "metadata.json (its pieces are located from the grid records)")
        self.entries = layout.entries(rank, begin, end - begin, str(self.path), named=self.entries)
        self.__dict__.pop("_checked", None)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read_into(self, buf: memoryview, offset: int) -> None:
        """Fill ``buf`` with the file's bytes at ``offset``: ``os.preadv`` on a local file, ranged GETs of exactly
        those bytes on an object (:meth:`oarlock.checkpoint.storage.s3.S3Storage.read_into`)."""
        if self.fd >= 0:
            pread_into(self.fd, buf, offset, self.path)
        else:
            self.path.storage.read_into(self.path.key, offset, buf)

    def check_array(self, name: str, flat_start: int, shape: tuple[int, ...], dtype: str) -> int:
        """Check that stored tensor ``name`` has ``dtype`` and holds the C-contiguous ``shape`` array starting
        ``flat_start`` elements into it; returns the tensor's begin offset in the data section.

        Raises:
            CheckpointFormatError: naming the file and tensor (missing, other dtype, array not inside it).
        """
        ck = (name, flat_start if type(flat_start) is int else int(flat_start),
              shape if type(shape) is tuple else tuple(shape), dtype)
        memo = self.__dict__.get("_checked")  # subclasses for other containers skip __init__
        if memo is None:
            memo = self.__dict__["_checked"] = {}
        begin = memo.get(ck)
        if begin is not None:  # a load checks every item before reading, then reads it: check once
            return begin
        e = self.entries.get(name)
        if e is None:
            raise CheckpointFormatError(f"{self.path}: tensor {name!r} is missing")
        sdt, sshape, begin, _ = e
        if sdt != dtype:
            raise CheckpointFormatError(f"{self.path}: tensor {name!r} is {sdt}, metadata says {dtype}")
        if (flat_start or sshape != shape) and (  # the stored tensor is the array itself: nothing to count
                flat_start < 0 or flat_start + int(np_prod(shape)) > int(np_prod(sshape))
                or (flat_start == 0 and len(sshape) > 1 and tuple(sshape) != tuple(shape))):
            raise CheckpointFormatError(f"{self.path}: tensor {name!r} of shape {list(sshape)} does not hold the "
                                        f"{list(shape)} array at element {flat_start} that the metadata describes")
        memo[ck] = begin
        return begin

    def read_box(self, name: str, flat_start: int, shape: tuple[int, ...], box: tuple[tuple[int, int], ...],
                 dtype: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read ``array[box]``, where ``array`` is the C-contiguous ``shape`` array that starts ``flat_start``
        elements into stored tensor ``name``; into ``out`` (a CPU tensor of the box's extent, any strides) or a
        new tensor. Only the needed byte ranges are read: one pread per contiguous run, or, when the runs are
        short, whole rows of the box in chunks of at most 64 MiB that are then sliced.

        Raises:
            CheckpointFormatError: tensor missing, dtype different from ``dtype``, or the array not inside it.
        """
        begin = self.check_array(name, flat_start, shape, dtype)
        tdt = torch_dtype(dtype)
        isz = tdt.itemsize
        ext = [b - a for a, b in box]
        if out is None:
            out = torch.empty(ext, dtype=tdt)
        if int(np_prod(ext)) == 0:
            return out
        base = self.data_start + begin + flat_start * isz
        nd = len(shape)
        strides = [int(np_prod(shape[d + 1:])) for d in range(nd)]
        if nd == 0:
            self._read_runs(out, [base], isz)
            return out
        k = nd - 1  # dims after k are read whole; dims before k index the runs
        while k > 0 and tuple(box[k]) == (0, shape[k]):
            k -= 1
        run = ext[k] * strides[k]
        start = sum(box[d][0] * strides[d] for d in range(nd))
        nruns = int(np_prod(ext[:k]))
        if nruns == 1:
            self._read_runs(out, [base + start * isz], run * isz)
            return out
        overhead = int(np_prod(shape[1:])) / int(np_prod(ext[1:]))
        if run * isz >= _RUN_BYTES or overhead > 4:
            import numpy as np

            offs = np.zeros((), dtype=np.int64)
            for d in range(k):
                offs = offs[..., None] + np.arange(box[d][0], box[d][1], dtype=np.int64) * strides[d]
            offs = (offs.reshape(-1) + box[k][0] * strides[k]) * isz + base
            self._read_runs(out, offs.tolist(), run * isz)
            return out
        # short runs: read whole rows of dim 0 (contiguous) into a small buffer reused by this thread, then slice
        # the box out of them while the rows are still in the CPU's cache (a fresh buffer per chunk cost a page
        # fault per 4 KiB and a trip through memory: it made a column reshard's reads 4x slower than its I/O)
        row = strides[0]
        rows_per_chunk = max(1, _BOUNCE_BYTES // max(1, row * isz))
        inner = tuple(slice(a, b) for a, b in box[1:])
        flat = _bounce(rows_per_chunk * row * isz)
        r = box[0][0]
        while r < box[0][1]:
            r2 = min(box[0][1], r + rows_per_chunk)
            buf = flat[:(r2 - r) * row * isz].view(tdt).view(r2 - r, *shape[1:])
            self.read_into(tensor_bytes(buf), base + r * row * isz)
            out[r - box[0][0]:r2 - box[0][0]].copy_(buf[(slice(None), *inner)])
            r = r2
        return out

    def _read_runs(self, out: torch.Tensor, offsets: list[int], run_bytes: int) -> None:
        """Read ``len(offsets)`` runs of ``run_bytes`` each, in order, into ``out`` (C order)."""
        direct = out.is_contiguous() and out.device.type == "cpu"
        dst = out if direct else torch.empty(out.shape, dtype=out.dtype)
        mv = tensor_bytes(dst)
        pos = 0
        for off in offsets:
            self.read_into(mv[pos:pos + run_bytes], off)
            pos += run_bytes
        if not direct:
            out.copy_(dst)


def contiguous_run(shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> tuple[int, int] | None:
    """``(first element, element count)`` when ``box`` of a C-contiguous array of ``shape`` is one contiguous run
    (leading dims of extent 1, one partial dim, then full dims), else None."""
    nd = len(shape)
    k = nd - 1
    while k > 0 and tuple(box[k]) == (0, shape[k]):
        k -= 1
    if nd and any(b - a != 1 for a, b in box[:k]):
        return None
    strides = [np_prod(shape[d + 1:]) for d in range(nd)]
    start = sum(box[d][0] * strides[d] for d in range(nd))
    return start, np_prod(b - a for a, b in box)


# ---------------------------------------------------------------- the writer

def _write_all(fd: int, mv: memoryview, pos: int) -> int:
    n = 0
    while n < len(mv):
        n += os.pwrite(fd, mv[n:], pos + n)
    return pos + n


def copy_run(src_fd: int, src_off: int, nbytes: int, fd: int, pos: int) -> int:
    """Copy ``nbytes`` from ``src_fd`` at ``src_off`` to ``fd`` at ``pos`` in the kernel (``copy_file_range``),
    falling back to pread/pwrite through a bounded buffer where the filesystem refuses. Returns the end position."""
    done = 0
    try:
        while done < nbytes:
            got = os.copy_file_range(src_fd, fd, nbytes - done, src_off + done, pos + done)
            if got <= 0:
                break
            done += got
    except OSError:
        pass
    while done < nbytes:
        chunk = os.pread(src_fd, min(nbytes - done, 1 << 24), src_off + done)
        if not chunk:
            raise CheckpointError(f"source file ends {nbytes - done} bytes early while copying")
        _write_all(fd, memoryview(chunk), pos + done)
        done += len(chunk)
    return pos + nbytes


class SafetensorsWriter:
    """A safetensors file being written, header first.

    ``entries`` lists ``(name, shape, dtype)`` in file order; the header (with ``metadata`` added to its
    ``__metadata__`` block, after ``"format": "pt"``) is written at once, then :meth:`put` writes each tensor's
    bytes at its known offset, in any order, from a tensor (any device, layout or storage sharing: it is copied
    to contiguous CPU memory when needed) or from byte runs ``[(fd, offset, nbytes)]`` of another file.
    :meth:`close` fsyncs (with ``fsync``) and closes; use it as a context manager. A ``hasher`` (an
    :class:`oarlock.checkpoint.integrity.BlockHasher`) is fed the bytes as they are written, and its record of the
    file (``hasher.finish(fd, size)`` at close) is left in ``checksum_record``.

    ``path`` may be an :class:`~oarlock.checkpoint.storage.location.ObjectPath`: the file is then streamed as a
    multipart upload with bounded memory (tensors must be put in file order), and appears only at :meth:`close`;
    leaving the context with an exception aborts the upload.

    Raises:
        CheckpointFormatError: a dtype safetensors cannot store, or the name ``__metadata__`` (reserved by the
            format for the header's metadata block), naming the tensor.
        CheckpointError: an I/O error (a full disk, ...), naming the file and, while writing data, the tensor.
    """

    def __init__(self, path: str | Path, entries: Sequence[tuple[str, Sequence[int], Any]],
                 metadata: dict[str, str] | None = None, *, fsync: bool = True, hasher: Any = None,
                 packed: Sequence[tuple[str, Sequence[int], Any]] = ()):
        self.path = path if is_object_path(path) else Path(path)
        self.fsync = fsync
        self.checksum_record: dict[str, Any] | None = None
        self._hasher = hasher
        header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        self.where: dict[str, tuple[int, tuple[int, ...], str]] = {}
        off = 0
        # ``packed`` pieces (an oarlock data file's grid shards) share one U8 entry, first in the file; they are
        # put by name like the others but are not named in the header (docs/checkpoint-format.md)
        for group in (packed, entries):
            start = off
            for name, shape, dtype in group:
                if name == RESERVED_NAME and group is entries:
                    raise CheckpointFormatError(f"{self.path}: tensor {name!r}: the name is reserved by the "
                                                "safetensors format for the header's metadata block; rename this key")
                if name in self.where:
                    raise CheckpointFormatError(f"{self.path}: tensor {name!r} is written twice")
                try:
                    code = safetensors_code(dtype)
                except (ValueError, KeyError):
                    raise CheckpointFormatError(f"{self.path}: tensor {name!r} has dtype {dtype}, which "
                                                "safetensors cannot store") from None
                dt = dtype_name(dtype)
                n = numel(shape) * dtype_itemsize(dt)
                if group is entries:
                    header[name] = {"dtype": code, "shape": [int(x) for x in shape], "data_offsets": [off, off + n]}
                self.where[name] = (off, tuple(int(x) for x in shape), dt)
                off += n
            if group is packed and packed:
                from oarlock.checkpoint.model.grid import PACKED_ENTRY

                if any(name == PACKED_ENTRY for name, _, _ in entries):
                    raise CheckpointFormatError(f"{self.path}: tensor name {PACKED_ENTRY!r} is reserved for the "
                                                "packed entry of oarlock data files; rename this key")
                header[PACKED_ENTRY] = {"dtype": "U8", "shape": [off - start], "data_offsets": [start, off]}
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)  # the data section starts 8-byte aligned
        self.base = 8 + len(hb)
        self.nbytes = self.base + off
        self._pending: list[tuple[int, int]] = []  # byte ranges written since the last writeback started
        self._unflushed = 0
        self._writebacks: list[Future] = []  # writeback requests handed to the writeback thread, not yet waited on
        self.fd = -1
        self._sink = None  # the streamed upload of an object (sequential writes), else None
        self._pos = 0
        try:
            head = memoryview(struct.pack("<Q", len(hb)) + hb)
            if is_object_path(path):
                self.path = path
                self._sink = path.storage.open_writer(path.key)
            else:
                mode = os.O_RDWR if hasher is not None else os.O_WRONLY  # the hasher may read blocks back
                self.fd = os.open(self.path, mode | os.O_CREAT | os.O_TRUNC, 0o644)
            self._write(head, 0)
            if self._hasher is not None:
                self._hasher.feed(0, head)
        except OSError as e:
            self._abandon()
            raise self._io_error(e, "the header") from None
        except BaseException:
            self._abandon()
            raise

    def _io_error(self, e: OSError, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: cannot write {what}: {e.strerror or e}"
                               + (" (the disk is full)" if e.errno == errno.ENOSPC else ""))

    def abandon(self) -> None:
        """Give the file up after an error: close it without hashing or fsync (which could only mask the error;
        the caller removes it), abort an object upload."""
        self._abandon()

    def _wait_writebacks(self) -> None:
        # before the fd is fsynced or closed: a request still queued would otherwise name a closed descriptor
        # (or one the process has since reused for another file)
        for f in self._writebacks:
            f.exception()
        self._writebacks = []

    def _abandon(self) -> None:
        if self.fd >= 0:
            self._wait_writebacks()
            os.close(self.fd)
            self.fd = -1
        if self._sink is not None:
            sink, self._sink = self._sink, None
            sink.abort()

    def _write(self, mv: memoryview, pos: int) -> int:
        """Write ``mv`` at ``pos``; returns the end position. An object is written as a stream: in file order."""
        if self._sink is None:
            return _write_all(self.fd, mv, pos)
        if pos != self._pos:
            raise CheckpointError(f"{self.path}: object data must be written in file order (at byte {self._pos}, "
                                  f"got a write at {pos})")
        self._sink.write(mv)
        self._pos = pos + len(mv)
        return self._pos

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is not None:  # the file is abandoned (an object upload is aborted): no hashing or fsync
            # that could mask the error
            self._abandon()
        else:
            self.close()

    def put(self, name: str, data: torch.Tensor | list[tuple[int, int, int]]) -> int:
        """Write tensor ``name`` from a tensor of its shape and dtype or from byte runs ``[(fd, offset, nbytes)]``
        (concatenated in order); returns its byte count."""
        try:
            return self._put(name, data)
        except OSError as e:
            raise self._io_error(e, f"tensor {name!r}") from None

    def _put(self, name: str, data: torch.Tensor | list[tuple[int, int, int]]) -> int:
        off, shape, dtype = self.where[name]
        pos = self.base + off
        if isinstance(data, list):
            if self._hasher is not None and self._sink is None:
                self._hasher.feed(pos, None)  # kernel copies: hashed from the file at close
            for src_fd, src_off, n in data:
                if self._sink is None:
                    pos = copy_run(src_fd, src_off, n, self.fd, pos)
                    continue
                for a in range(0, n, 1 << 24):  # into an object: through a bounded buffer
                    chunk = os.pread(src_fd, min(n - a, 1 << 24), src_off + a)
                    if not chunk:
                        raise CheckpointError(f"source file ends {n - a} bytes early while copying")
                    if self._hasher is not None:
                        self._hasher.feed(pos, chunk)
                    pos = self._write(memoryview(chunk), pos)
        else:
            t = data.detach()
            if tuple(t.shape) != shape or t.dtype != torch_dtype(dtype):
                raise CheckpointError(f"{self.path}: tensor {name!r} is {tuple(t.shape)} {t.dtype}, the header "
                                      f"says {list(shape)} {dtype}")
            if t.numel():
                if t.device.type != "cpu":
                    t = t.cpu()
                # a lazily conjugated or negated view (``x.conj()``) is stored as the values it shows
                mv = tensor_bytes(t.resolve_conj().resolve_neg().contiguous())
                if self._hasher is not None:
                    self._hasher.feed(pos, mv)
                pos = self._write(mv, pos)
        n = numel(shape) * dtype_itemsize(dtype)
        if self.fsync and n and self._sink is None:
            # the byte range just written; tensors may be put in any order (convert writes key by key over
            # several files), so the ranges are kept rather than assumed to follow one another
            start = self.base + off
            if self._pending and self._pending[-1][1] == start:
                self._pending[-1] = (self._pending[-1][0], start + n)
            else:
                self._pending.append((start, start + n))
            self._unflushed += n
            if self._unflushed >= _WRITEBACK_BYTES:
                self._writebacks.append(submit(_writeback_pool(), _start_writebacks, self.fd, self._pending))
                self._pending, self._unflushed = [], 0
        return n

    def close(self) -> None:
        if self._sink is not None:
            if self._hasher is not None:
                self.checksum_record = self._hasher.finish(-1, self.nbytes)  # streamed in order: no read-back
            sink, self._sink = self._sink, None
            sink.close()  # completes the upload: the object appears now
            return
        if self.fd >= 0:
            try:
                if self._hasher is not None:
                    self.checksum_record = self._hasher.finish(self.fd, self.nbytes)
                self._wait_writebacks()
                if self.fsync:
                    os.fsync(self.fd)
            except OSError as e:
                raise self._io_error(e, "(fsync)") from None
            finally:
                os.close(self.fd)
                self.fd = -1


def write_safetensors(path: str | Path, tensors: Mapping[str, torch.Tensor], *, fsync: bool = True,
                      metadata: dict[str, str] | None = None, hasher: Any = None,
                      ready: Callable[[str], torch.Tensor] | None = None,
                      packed: Mapping[str, torch.Tensor] | None = None) -> int:
    """Write ``tensors`` (CPU or device, any layout, storage shared or not) as one safetensors file in the given
    order with :class:`SafetensorsWriter`, and fsync it. Returns the bytes written. ``metadata`` (str -> str) is
    added to the header's ``__metadata__`` block. ``hasher``: see :class:`SafetensorsWriter` (its ``finish``
    result is then in ``hasher.record``). ``ready(name)``, when given, is called before each tensor's bytes are
    written and returns the tensor to write instead (same shape and dtype; ``tensors`` then only gives the header).
    ``packed``: pieces written back to back, in the given order, into the file's one
    :data:`~oarlock.checkpoint.model.grid.PACKED_ENTRY`, before ``tensors`` (oarlock data files); ``ready`` covers
    them too.

    Raises:
        CheckpointFormatError: a dtype that safetensors cannot store (naming the tensor).
    """
    packed = packed or {}
    for name, t in (*packed.items(), *tensors.items()):
        try:
            safetensors_code(t.dtype)
        except (ValueError, KeyError):
            raise CheckpointFormatError(f"{path}: tensor {name!r} has dtype {t.dtype}, which safetensors cannot "
                                        "store") from None
    with SafetensorsWriter(path, [(k, tuple(t.shape), t.dtype) for k, t in tensors.items()], metadata,
                           fsync=fsync, hasher=hasher,
                           packed=[(k, tuple(t.shape), t.dtype) for k, t in packed.items()]) as w:
        for k, t in (*packed.items(), *tensors.items()):
            w.put(k, t if ready is None else ready(k))
    return w.nbytes


_WRITEBACK_BYTES = 16 * 1024 * 1024
_sync_file_range = None
_wb_pool: ThreadPoolExecutor | None = None
_wb_pid = -1
_wb_lock = threading.Lock()


def _writeback_pool() -> ThreadPoolExecutor:
    """The process's one writeback thread. ``sync_file_range`` blocks while the disk's request queue is full
    (a profile of ``oarlock convert`` HF -> TP=3 found 0.11 s of 0.65 s inside it): issued from here, the
    writing thread goes on copying while the requests wait."""
    global _wb_pool, _wb_pid
    with _wb_lock:
        if _wb_pool is None or _wb_pid != os.getpid():  # a forked child needs its own thread
            _wb_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oarlock-writeback")
            _wb_pid = os.getpid()
        return _wb_pool


def _start_writebacks(fd: int, ranges: list[tuple[int, int]]) -> None:
    for a, b in ranges:
        _start_writeback(fd, a, b - a)


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + nbytes)`` to disk now (Linux ``sync_file_range`` with
    ``SYNC_FILE_RANGE_WRITE``), so the disk works while later tensors are still being copied and the final
    fsync has little left to do. A no-op where the call is unavailable."""
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = False
        try:
            import ctypes
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fn = libc.sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            _sync_file_range = fn
        except (OSError, AttributeError):
            pass
    if _sync_file_range:
        _sync_file_range(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE
