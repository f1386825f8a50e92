"""oarlock's own format: a directory with ``metadata.json`` and per-rank ``rank-XXXXX.safetensors`` data files
(``docs/checkpoint-format.md``). The metadata file may be shipped to ranks whose node-local directory lacks it."""

from __future__ import annotations

import re
from pathlib import Path

from oarlock.checkpoint.errors import CheckpointFormatError
from oarlock.checkpoint.metadata import METADATA_FILE, CheckpointMetadata, parse_json
from oarlock.checkpoint.reader import CheckpointReader, checkpoint_file, register_format


DATA_FILE = re.compile(r"^rank-\d{5,}\.safetensors$")


@register_format
class OarlockReader(CheckpointReader):
    """Reader of oarlock checkpoint directories (data: safetensors files, read by the base class)."""

    format = "oarlock"
    priority = 0
    hint = METADATA_FILE
    metadata_files = (METADATA_FILE,)

    @classmethod
    def claim(cls, path: Path, names: set[str] | None) -> int:
        if names is None:
            return 2 if path.name == METADATA_FILE else 0
        if METADATA_FILE not in names:
            # oarlock data files without their metadata: a guess, so that opening names the missing file instead
            # of reading them as some other format
            return 1 if any(DATA_FILE.match(n) for n in names) else 0
        try:  # Megatron-Core writes a metadata.json of its own ({"sharded_backend": ...})
            # the path-safety rule first: a metadata.json linking outside is refused by open(), never read here
            with open(checkpoint_file(path, METADATA_FILE, METADATA_FILE), "rb") as f:
                head = f.read(4096)
        except (OSError, CheckpointFormatError):
            return 2
        return 0 if b'"sharded_backend"' in head else 2

    @classmethod
    def open(cls, path: Path, *, shipped: dict[str, bytes] | None = None, partial: bool = False
             ) -> "OarlockReader":
        root = path if path.is_dir() else path.parent
        if shipped is not None and METADATA_FILE in shipped:
            text, source = shipped[METADATA_FILE], f"{METADATA_FILE} (received from another rank)"
        else:
            source = str(root / METADATA_FILE)
            if not (root / METADATA_FILE).exists():
                raise CheckpointFormatError(f"{source}: missing; the oarlock data files in {root} cannot be loaded "
                                            "without it (an incomplete or damaged checkpoint)")
            try:
                text = checkpoint_file(root, METADATA_FILE, str(root)).read_bytes()
            except OSError as e:
                raise CheckpointFormatError(f"{source}: cannot read: {e.strerror or e}") from None
        raw = parse_json(text, source)
        meta = CheckpointMetadata.from_json(raw, source=source)
        reader = cls(root, meta)  # checks that every data file stays inside the checkpoint, naming the tensor
        if not partial:
            for f in meta.files:
                if not (root / f).is_file():
                    raise CheckpointFormatError(f"{root / f}: data file named in {METADATA_FILE} is missing")
        return reader
