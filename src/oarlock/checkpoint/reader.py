"""The storage protocol: one reader class per source format, found through a registry.

A format is **one module** in :mod:`oarlock.checkpoint.formats` defining one subclass of
:class:`CheckpointReader` decorated with :func:`register_format`; every module of that package is imported
when a checkpoint is opened, so adding a format needs no edit anywhere else. The load planner, the load
executor, the communication layer, ``convert`` and the CLI only ever see this protocol.

What a format class provides:

``format`` (class attribute)
    Its name (``"oarlock"``, ``"huggingface"``, ``"paddle"``, ``"safetensors"``, ...), also the
    :attr:`CheckpointMetadata.format` of what it opens.
``claim(path, names) -> int`` (classmethod)
    How surely ``path`` is this format: 0 no, 1 a fallback guess (e.g. "some ``*.safetensors`` files"), 2 yes
    (its own metadata file is there). ``names`` is the directory listing (None when ``path`` is a file).
    :func:`oarlock.checkpoint.storage.detect_format` rejects a directory claimed with 2 by two formats.
``open(path, *, shipped=None, partial=False) -> reader`` (classmethod)
    Read and validate the metadata (nothing else) and return the reader. ``shipped`` maps the names in
    ``metadata_files`` to their bytes when this rank cannot see them itself and another rank sent them (node-local
    disks); ``partial`` means this rank may see only some data files (the caller checks that every data file is
    visible to some rank), so missing data files are not an error. Formats that leave ``metadata_files`` empty
    never get either (their metadata is read from the data files, which must all be visible).
``priority``, ``hint`` (class attributes)
    Order and description of the format in detection messages.
``metadata_files`` (class attribute)
    Files that describe the whole checkpoint and may be shipped to ranks that lack them (oarlock: ``metadata.json``).
``read_box(key, file, name, flat_start, shape, box, out=None) -> Tensor``
    The only data access: ``array[box]`` where ``array`` is the C-contiguous ``shape`` array that starts
    ``flat_start`` elements into stored tensor ``name`` of data file ``file`` (relative to the checkpoint), as a
    CPU tensor of the metadata's dtype for ``key``; written into ``out`` (a tensor of the box's extent, any
    strides, any device) when given. The base class implements it for safetensors data files with byte-range
    reads (``os.preadv``); formats with other data files override it (and may call ``super()`` for safetensors
    ones).
``byte_run(key, file, name, flat_start, shape, box) -> (fd, offset, nbytes) | None``
    Optional fast path: the box as one contiguous run of file bytes (``os.copy_file_range`` in ``convert``);
    None when not available. Implemented by the base class for safetensors data files.
``visible_files() -> set[str]``
    The data files of the metadata this rank can open (node-local disks see only some).

The metadata model (:class:`~oarlock.checkpoint.metadata.CheckpointMetadata`: keys, global shapes, dtypes,
shard boxes, data files, stored tensor names, flattened ranges) is the whole contract with the planner: a
reader never plans. Readers never write into the source, never open a file outside it, and never build objects
from file bytes with pickle (see :mod:`oarlock.checkpoint.paddle` for the restricted unpickler).
On-disk formats are described in ``docs/checkpoint-format.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch

from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.checkpoint.metadata import CheckpointMetadata, ShardMeta
from oarlock.checkpoint.safetensors_io import SafetensorsFile, contiguous_run, np_prod
from oarlock.utils import torch_dtype

_REGISTRY: dict[str, type["CheckpointReader"]] = {}


def register_format(cls: type["CheckpointReader"]) -> type["CheckpointReader"]:
    """Class decorator: make ``cls`` one of the formats :func:`~oarlock.checkpoint.storage.open_checkpoint`
    detects (keyed by ``cls.format``; registering a name again replaces the earlier class)."""
    if not cls.format:
        raise TypeError(f"{cls.__name__}: a registered reader needs a format name")
    _REGISTRY[cls.format] = cls
    return cls


def unregister_format(name: str) -> None:
    """Remove format ``name`` from the registry (no error when absent)."""
    _REGISTRY.pop(name, None)


def registered_formats() -> dict[str, type["CheckpointReader"]]:
    """Format name -> reader class, in registration order (import :mod:`oarlock.checkpoint.formats` first)."""
    return dict(_REGISTRY)


class CheckpointReader:
    """An opened checkpoint source: its metadata and byte-range access to its data (see the module docstring).

    Also usable directly as ``CheckpointReader(root, metadata)`` for a source whose data files are all
    safetensors files (the base implementation).
    """

    format: ClassVar[str] = ""
    metadata_files: ClassVar[tuple[str, ...]] = ()
    priority: ClassVar[int] = 5  # order in which formats are named in messages
    hint: ClassVar[str] = ""  # what identifies the format, for "no checkpoint found" messages

    def __init__(self, root: Path, metadata: CheckpointMetadata):
        self.root = Path(root)
        self.metadata = metadata
        self._st_files: dict[str, SafetensorsFile] = {}
        self.files_opened: list[str] = []  # instrumentation: one entry per data file actually opened

    # ------------------------------------------------------------ format hooks

    @classmethod
    def claim(cls, path: Path, names: set[str] | None) -> int:
        return 0

    @classmethod
    def open(cls, path: Path, *, shipped: dict[str, bytes] | None = None, partial: bool = False
             ) -> "CheckpointReader":
        raise NotImplementedError(f"{cls.__name__}.open")

    # ------------------------------------------------------------ lifetime

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for f in self._st_files.values():
            f.close()
        self._st_files.clear()

    # ------------------------------------------------------------ files

    def path_of(self, file: str) -> Path:
        """Absolute path of data file ``file`` (the root itself for a single-file source)."""
        return self.root / file if self.root.is_dir() else self.root

    def visible_files(self) -> set[str]:
        """The metadata's data files this rank can open."""
        return {f for f in self.metadata.files if self.path_of(f).is_file()}

    def safetensors_file(self, file: str) -> SafetensorsFile:
        """The opened (header-validated, cached) safetensors data file ``file``."""
        f = self._st_files.get(file)
        if f is None:
            f = self._st_files[file] = SafetensorsFile(self.path_of(file))
            self.files_opened.append(file)
        return f

    # ------------------------------------------------------------ data

    def read_box(self, key: str, file: str, name: str, flat_start: int, shape: tuple[int, ...],
                 box: tuple[tuple[int, int], ...], out: torch.Tensor | None = None) -> torch.Tensor:
        """See the module docstring. Raises :class:`CheckpointFormatError` naming file and tensor."""
        return self.safetensors_file(file).read_box(name, flat_start, shape, box, self.metadata.tensors[key].dtype,
                                                    out)

    def byte_run(self, key: str, file: str, name: str, flat_start: int, shape: tuple[int, ...],
                 box: tuple[tuple[int, int], ...]) -> tuple[int, int, int] | None:
        """See the module docstring."""
        run = contiguous_run(shape, box)
        if run is None:
            return None
        f = self.safetensors_file(file)
        e = f.entries.get(name)
        dtype = self.metadata.tensors[key].dtype
        if e is None or e[0] != dtype or flat_start + np_prod(shape) > np_prod(e[1]):
            return None
        isz = torch_dtype(dtype).itemsize
        return f.fd, f.data_start + e[2] + (flat_start + run[0]) * isz, run[1] * isz

    def read(self, key: str, shard: ShardMeta, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """``stored[index]`` of ``shard`` of ``key``, where ``stored`` is the shard as stored (its box, or the
        1-D flat range of a flattened shard); ``index`` is a tuple of step-1 slices (None: everything)."""
        stored = (shard.numel,) if shard.flattened_range is not None else tuple(shard.local_shape)
        index = tuple(index or ()) + (slice(None),) * (len(stored) - len(index or ()))
        box = []
        for sl, n in zip(index, stored):
            a, b, step = sl.indices(n)
            if step != 1:
                raise CheckpointFormatError(f"read of {key!r}: only step-1 slices are supported, got {sl}")
            box.append((a, max(a, b)))
        return self.read_box(key, shard.file, shard.name, 0, stored, tuple(box))

