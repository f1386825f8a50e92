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
``visible_files(files=None) -> set[str]``
    The data files of the metadata (or of ``files``) this rank can open (node-local disks see only some).

Path safety (one rule for every format): every file a checkpoint names -- a data file of the metadata, an HF
index ``weight_map`` entry, a Paddle storage file name, a file found by listing the directory -- must resolve
inside the checkpoint directory: no absolute path, no ``..`` component, no symlink whose target leaves the
directory (the one exception: a HuggingFace hub cache snapshot, whose files link into the repository's
``blobs/``). :func:`checkpoint_file` checks a name and returns its path, refusing with an error naming the entry
*before* anything is opened; the base class applies it to every data file of the metadata when a reader is
built and again in :meth:`CheckpointReader.path_of`, so a format gets the rule by building its reader from its
metadata and reaching data through ``path_of``; files a format reads in ``open`` (its metadata files, index
files, listed files) go through :func:`checkpoint_file` too.

The metadata model (:class:`~oarlock.checkpoint.model.metadata.CheckpointMetadata`: keys, global shapes, dtypes,
shard boxes, data files, stored tensor names, flattened ranges) is the whole contract with the planner: a
reader never plans. Readers never write into the source, never open a file outside it, and never build objects
from file bytes with pickle (see :mod:`oarlock.checkpoint.formats.paddle_pickle` for the restricted unpickler).
On-disk formats are described in ``docs/checkpoint-format.md``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import torch

from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.checkpoint.model.grid import rank_of_file
from oarlock.checkpoint.storage.location import location, resolve_child, storage_for
from oarlock.checkpoint.model.metadata import SAVE_ID_HEADER, CheckpointMetadata, ShardMeta
from oarlock.checkpoint.storage.safetensors import SafetensorsFile, contiguous_run, np_prod
from oarlock.utils import error_reason, torch_dtype

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


def checkpoint_file(root: Any, name: Any, entry: str) -> Path:
    """The path of file ``name`` named by the checkpoint directory ``root`` (in ``entry``, e.g.
    ``"metadata.json: tensor 'w'"``), after checking that it stays inside ``root``: a non-empty relative name
    without ``..`` components whose real path (symlinks resolved) lies inside the real path of ``root``. For a
    checkpoint in an object store (``root`` an :class:`~oarlock.checkpoint.storage.location.ObjectPath`) the name must
    also not be a URL (another bucket) nor hold empty, ``.`` or ``\\`` components; the result is then the
    object under ``root``'s prefix. Files of
    a HuggingFace hub cache snapshot (``.../snapshots/REV/``) may also resolve into the repository's ``blobs/``.
    Only the name and symlinks are examined; nothing is opened.

    Raises:
        CheckpointFormatError: ``"{entry}: file {name!r} ...; refusing to open it"`` naming the entry and why.
    """
    def refuse(why: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{entry}: file {name!r} {why}; refusing to open it")

    if not isinstance(name, str) or not name or "\0" in name:
        raise refuse("is not a file name")
    if os.path.isabs(name) or name.startswith(("/", "\\")):
        raise refuse("is an absolute path, outside the checkpoint directory")
    if ".." in name.replace("\\", "/").split("/"):
        raise refuse("leaves the checkpoint directory (a '..' component)")
    try:
        return resolve_child(root, name)
    except ValueError as e:
        raise refuse(str(e)) from None


def load_weights_only(source: Any, where: Any, what: str = "weights-only torch.save archive", *,
                      safe_globals: Any = (), map_location: str = "cpu", mmap: bool = False) -> Any:
    """``torch.load(source, weights_only=True)``: torch's weights-only unpickler, which builds tensors and plain
    data and refuses every other global before it runs, with ``safe_globals`` (``[(stand-in, "module.Name")]``:
    inert local classes for a format's own records) admitted as well.

    ``source``: a path or a seekable binary stream; ``where`` names it in the error.

    Raises:
        CheckpointFormatError: ``"{where}: not a {what}: {reason}"`` (the first line of torch's reason) for a
            missing, truncated or refused file.
    """
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(source, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # truncated zips, refused globals, ...
        raise CheckpointFormatError(f"{where}: not a {what}: {error_reason(e)}") from None


def box_of_stored(stored: torch.Tensor, flat_start: int, shape: tuple[int, ...], box: tuple[tuple[int, int], ...],
                  out: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """:meth:`CheckpointReader.read_box` for a format that holds the stored tensor in memory: ``array[box]``
    where ``array`` is the C-contiguous ``shape`` array starting ``flat_start`` elements into ``stored``
    (flattened row-major, any shape), cast to ``dtype`` when given, written into ``out`` when given, else
    returned as a new tensor (never a view of ``stored``). The caller checks that ``stored`` holds the array."""
    n = np_prod(shape)
    part = stored.reshape(-1)[flat_start:flat_start + n].reshape(shape)[tuple(slice(a, b) for a, b in box)]
    if dtype is not None and part.dtype != dtype:
        part = part.to(dtype)  # a new tensor
    elif out is None:
        part = part.clone()
    if out is None:
        return part
    out.copy_(part)
    return out


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
        self.root = location(root)
        self.metadata = metadata
        self._st_files: dict[str, SafetensorsFile] = {}
        self.files_opened: list[str] = []  # instrumentation: one entry per data file actually opened
        self._safe: set[str] = set()
        if self.root.is_dir():  # path safety, before any data file is opened (see the module docstring)
            for t in metadata.tensors.values():
                if t.grid is not None and t._shards is None:  # a grid's files, without listing its shards
                    for f in t.files():
                        if f not in self._safe:
                            checkpoint_file(self.root, f, f"{self.root}: tensor {t.key!r}")
                            self._safe.add(f)
                    continue
                for s in t.shards:
                    if s.file not in self._safe:
                        checkpoint_file(self.root, s.file, f"{self.root}: tensor {t.key!r}")
                        self._safe.add(s.file)

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
        """Path of data file ``file`` (the root itself for a single-file source), checked by
        :func:`checkpoint_file` to stay inside the checkpoint."""
        if not self.root.is_dir():
            return self.root
        if file not in self._safe:
            checkpoint_file(self.root, file, f"{self.root}: data file")
            self._safe.add(file)
        return self.root / file

    def visible_files(self, files: Any = None) -> set[str]:
        """The metadata's data files this rank can open; with ``files`` (an iterable of names), those of them it
        can open. A load asks only about the files it reads: asking about every data file costs one ``stat`` per
        rank of the saving job on every rank. Each answer is remembered for this reader (the load keeps what it
        checked open)."""
        known = self.__dict__.setdefault("_visible", {})
        wanted = self.metadata.files if files is None else files
        todo = [f for f in dict.fromkeys(wanted) if f not in known]
        if todo and storage_for(self.root).shared:
            # a shared store holds every object its commit record names (uploaded before it): nothing is asked of
            # the store (a missing object fails its read, naming the key)
            for f in todo:
                self.path_of(f)  # the key rule, before anything is read
            known.update((f, True) for f in todo)
        else:
            known.update((f, self.path_of(f).is_file()) for f in todo)
        return {f for f in dict.fromkeys(wanted) if known[f]}

    def safetensors_file(self, file: str) -> SafetensorsFile:
        """The opened (header-validated, cached) safetensors data file ``file``. When the metadata carries a
        save id, the file's header must carry the same one.

        Raises:
            CheckpointFormatError: naming the file: invalid header, or a file of another save.
        """
        f = self._st_files.get(file)
        if f is None:
            f = SafetensorsFile(self.path_of(file))
            want = self.metadata.save_id
            got = f.header_metadata.get(SAVE_ID_HEADER)
            if want is not None and got != want:
                f.close()
                raise CheckpointFormatError(
                    f"{self.path_of(file)}: data file of {'save ' + repr(got) if got else 'no recorded save'}, but "
                    f"the metadata is of save {want!r}: the checkpoint mixes files of two saves (or was replaced "
                    "while being read)")
            try:
                f.use_packed(self.metadata.packed_layout(), rank_of_file(file))
            except BaseException:
                f.close()
                raise
            self._st_files[file] = f
            self.files_opened.append(file)
        return f

    def check_files(self) -> None:
        """Check, without reading data, every data file of the metadata: a safetensors data file opens, belongs to
        this save and is as long as its header's data offsets say (a truncated copy is named here); any other
        data file is there (formats with data files of their own check what their ``open`` reads).
        ``oarlock inspect`` runs it, so that a damaged checkpoint is not listed as if it loaded. Each file is
        closed again after its check.

        Raises:
            CheckpointFormatError: naming the file (missing, invalid or truncated header, another save's file).
        """
        for file in self.metadata.files:
            if not file.endswith(".safetensors"):
                if not self.path_of(file).is_file():
                    raise CheckpointFormatError(f"{self.path_of(file)}: data file is missing")
                continue
            kept = file in self._st_files
            self.safetensors_file(file)
            if not kept:  # thousands of files must not hold thousands of descriptors
                self._st_files.pop(file).close()

    def check_read(self, key: str, file: str, name: str, flat_start: int, shape: tuple[int, ...]) -> None:
        """Check, without reading data, that :meth:`read_box` of any box of this array would succeed: the file
        opens and belongs to this save, the tensor is there with the metadata's dtype and holds the array. The
        base implementation covers safetensors data files; formats with other data files override it.

        Raises:
            CheckpointFormatError: naming the file and tensor.
        """
        if type(self).read_box is not CheckpointReader.read_box:
            # a format with data files of its own (its read_box validates them): here, only that the file is there
            path = self.path_of(file)
            if not path.is_file():
                raise CheckpointFormatError(f"{path}: data file of key {key!r} is missing")
            return
        self.safetensors_file(file).check_array(name, flat_start, shape, self.metadata.tensors[key].dtype)

    def check_items(self, items: Any) -> None:
        """:meth:`check_read` of every read item (``src_key``, ``file``, ``name``, ``src_flat_start``,
        ``src_shape``): the load calls it (through :func:`oarlock.checkpoint.runtime.executor.prepare_work`) on the
        items
        of files read item by item before the first target byte is written, and keeps the files open, so that the
        reads see the files it checked."""
        done = set()
        for it in items:
            k = (it.src_key, it.file, it.name, it.src_flat_start, tuple(it.src_shape))
            if k not in done:
                done.add(k)
                self.check_read(*k)

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
        if f.fd < 0:  # an object in a store: no descriptor for kernel copies (read_box fetches it)
            return None
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

