"""oarlock's own format: a directory with ``metadata.json`` and per-rank ``rank-XXXXX.safetensors`` data files
(``docs/checkpoint-format.md``). The metadata file may be shipped to ranks whose node-local directory lacks it."""

from __future__ import annotations

import re
from pathlib import Path

from oarlock.checkpoint.errors import CheckpointError, CheckpointFormatError
from oarlock.checkpoint.storage.location import storage_for, storage_key
from oarlock.checkpoint.model.metadata import METADATA_FILE, CheckpointMetadata, parse_json
from oarlock.checkpoint.formats.reader import CheckpointReader, checkpoint_file, register_format


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
            st, key = storage_key(checkpoint_file(path, METADATA_FILE, METADATA_FILE))
            head, _ = st.read_head(key, 4096)
        except (OSError, CheckpointError):
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
            try:
                text = checkpoint_file(root, METADATA_FILE, str(root)).read_bytes()
            except FileNotFoundError:
                raise CheckpointFormatError(f"{source}: missing; the oarlock data files in {root} cannot be loaded "
                                            "without it (an incomplete or damaged checkpoint)") from None
            except OSError as e:
                raise CheckpointFormatError(f"{source}: cannot read: {e.strerror or e}") from None
        raw = parse_json(text, source)
        check_field_types(raw, source)
        meta = CheckpointMetadata.from_json(raw, source=source)
        reader = cls(root, meta)  # checks that every data file stays inside the checkpoint, naming the tensor
        if not partial and not storage_for(root).shared:
            # (in a shared store the commit record's objects were all written before it; asking for each would
            # cost a request per object, and a missing one fails its read naming the key)
            for f in meta.files:
                if not (root / f).is_file():
                    raise CheckpointFormatError(f"{root / f}: data file named in {METADATA_FILE} is missing")
        return reader


_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
               float: "a number", type(None): "null"}


def _kind(v: object) -> str:
    return _JSON_TYPES.get(type(v), type(v).__name__)


def _int_list(v: object) -> bool:
    return isinstance(v, list) and all(type(x) is int for x in v)


def check_field_types(raw: object, source: str) -> None:
    """Check the JSON types of ``metadata.json``'s fields before anything is built from them, so that a field of
    the wrong type (a list where an object is expected) is reported as that, naming the field, instead of
    surfacing later as missing keys.

    Raises:
        CheckpointFormatError: naming ``source``, the field (``tensors``, ``tensors["w"].shards[0].local_shape``,
            ...), the expected and the found JSON type.
    """
    if not isinstance(raw, dict):
        raise CheckpointFormatError(f"{source}: expected a JSON object at the top level, found {_kind(raw)}")

    def bad(field: str, expected: str, v: object) -> CheckpointFormatError:
        return CheckpointFormatError(f"{source}: field {field} must be {expected}, found {_kind(v)}")

    for name in ("tensors", "objects", "nested", "extra"):
        if name in raw and not isinstance(raw[name], dict):
            raise bad(f'"{name}"', "a JSON object", raw[name])
    for key, t in raw.get("tensors", {}).items():
        where = f"tensors[{key!r}]"
        if not isinstance(t, dict):
            raise bad(where, "a JSON object {\"global_shape\", \"dtype\", \"shards\"}", t)
        if "global_shape" in t and not _int_list(t["global_shape"]):
            raise bad(f"{where}.global_shape", "a list of integers", t["global_shape"])
        if "dtype" in t and not isinstance(t["dtype"], str):
            raise bad(f"{where}.dtype", "a string", t["dtype"])
        shards = t.get("shards", [])
        if not isinstance(shards, list):
            raise bad(f"{where}.shards", "a list", shards)
        for i, sh in enumerate(shards):
            if not isinstance(sh, dict):
                raise bad(f"{where}.shards[{i}]", "a JSON object", sh)
            for f in ("global_offset", "local_shape"):
                if f in sh and not _int_list(sh[f]):
                    raise bad(f"{where}.shards[{i}].{f}", "a list of integers", sh[f])
            fr = sh.get("flattened_range")
            if fr is not None and not (_int_list(fr) and len(fr) == 2):
                raise bad(f"{where}.shards[{i}].flattened_range", "null or a list of two integers", fr)
            rid = sh.get("replica_id")
            if rid is not None and type(rid) is not int:
                raise bad(f"{where}.shards[{i}].replica_id", "null or an integer", rid)
