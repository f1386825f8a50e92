"""Names and bounds of oarlock's on-disk layout (``docs/checkpoint-format.md``): the data files' names, the entry
of a packed data file, the metadata file and the header key every data file carries, and the bounds a grid or flat
record is checked against (records are hostile input). Pure: no I/O."""

from __future__ import annotations

#: Largest number of cells one grid record may describe (hostile-input bound: a record is expanded lazily, but
#: a single dimension's cut points are materialised and cached).
MAX_CELLS_PER_DIM = 1 << 20
MAX_RANK = 1 << 24

METADATA_FILE = "metadata.json"
#: The header entry safetensors reserves for its metadata block: no tensor of a file can carry this name. An
#: oarlock checkpoint stores a key spelled so under another name (metadata.json maps key -> name); formats whose
#: tensor names are the keys (a HuggingFace directory, a single .safetensors file) cannot hold it.
RESERVED_NAME = "__metadata__"
SAVE_ID_HEADER = "oarlock.save_id"  # safetensors __metadata__ entry of every data file: the save it belongs to
#: Name of the one safetensors entry of a packed data file (``docs/checkpoint-format.md``, "Packed data files"):
#: a ``U8`` array holding, back to back, the piece of every grid- or flat-recorded tensor this file's rank writes.
PACKED_ENTRY = "oarlock.packed"


def data_file_name(rank: int) -> str:
    """The data file rank ``rank`` writes: ``rank-XXXXX.safetensors``."""
    return f"rank-{rank:05d}.safetensors"


def rank_of_file(name: str) -> int | None:
    """The rank whose data file is ``name`` (:func:`data_file_name`), or None for any other name."""
    if name.startswith("rank-") and name.endswith(".safetensors"):
        digits = name[5:-12]
        if digits.isdigit() and len(digits) >= 5 and (len(digits) == 5 or digits[0] != "0"):
            if data_file_name(int(digits)) == name:
                return int(digits)
    return None

# the shard records every data file's header carries (a same-layout restart checks them)
SHARDS_DIGEST_HEADER = "oarlock.shards.sha256"  # packed files: SHA-256 of the shard records instead of the records
SHARDS_HEADER = "oarlock.shards"  # safetensors __metadata__ entry: {name: [offset, local shape, global shape, ...]}
WORLD_HEADER = "oarlock.world_size"  # ... and the size of the group that saved
