"""Block checksums of checkpoint data files: computed while a file is written, recorded with the checkpoint,
verified before a load writes anything, and checked in full by ``oarlock verify``.

Every data file of an oarlock checkpoint is cut into fixed-size blocks of its bytes (:data:`BLOCK_SIZE`; the
last block may be shorter), header included; each block's XXH3 64-bit hash (the ``xxhash`` library,
https://xxhash.com) is kept as 8 big-endian bytes. ``metadata.json`` records them under ``extra.checksums``, per
file either in a *digests file* next to the data file (what a save writes, format version 4: ``F.xxh3`` for data
file ``F``, the raw 8-byte digests in block order, with the XXH3 of those bytes in the metadata; ``oarlock convert`` writes them too) or
inline, as earlier versions wrote them (``digests``: base64 of the same bytes; ``blocks``: a list of 16-hex-digit
strings; both still read)::

    {"algorithm": "xxh3_64", "block_size": 4194304,
     "files": {"rank-00000.safetensors": {"size": 123456, "digests_xxh3": "5f0e3c9a1b2d4e6f"}}}

With digests files, what the save's coordinator receives and what every loading rank parses is a fixed few dozen
bytes per data file, whatever the checkpoint's size (inline, a 5 TB checkpoint's 1.2 M blocks would be 12 MiB of
``metadata.json`` parsed by every rank and gathered to rank 0 at each save); a rank reads the digests only of
the files whose blocks it hashes.

A load verifies, before any destination tensor is written, every block that holds a byte the group's reads take
(a partial read checks only the blocks it touches), each block hashed by one rank: :func:`verify_group` (the
owner of a block is the rank reading most of it, agreed in one ``all_reduce``). A same-layout restart verifies
each rank's own file (:func:`verify_own_file`). A mismatch raises :class:`ChecksumError` on every rank, naming the
file, the block's byte range and every key stored in it. Checkpoints without ``extra.checksums`` (written by
earlier oarlock versions, or foreign formats) load without a check. See ``docs/checkpoint-format.md``.

The package by role:

- :mod:`~oarlock.checkpoint.integrity.hashing`: the block hash and what a save writes (:class:`BlockHasher`,
  :func:`make_record`, :func:`write_digests`);
- :mod:`~oarlock.checkpoint.integrity.checksums`: the recorded checksums as a load reads them
  (:class:`FileChecksums`, :func:`recorded`, :func:`prefetch_digests`, :func:`equal_by_checksum`);
- :mod:`~oarlock.checkpoint.integrity.verifier`: stored blocks hashed against them (:class:`BlockVerifier`);
- :mod:`~oarlock.checkpoint.integrity.ownership`: the blocks a load's reads touch and the rank that hashes each
  (:func:`touched_blocks`, :func:`block_owners`, a collective);
- :mod:`~oarlock.checkpoint.integrity.verify`: verification by a load, a warm restart and a conversion
  (:func:`verify_group`, :func:`verify_own_file`, :func:`verify_all_blocks`);
- :mod:`~oarlock.checkpoint.integrity.report`: ``oarlock verify`` (:func:`verify_checkpoint`, :class:`VerifyReport`).
"""

from oarlock.checkpoint.integrity.hashing import (ALGORITHM, BLOCK_SIZE, CHECKSUMS_KEY, DIGESTS_SUFFIX, BlockHasher,
                                                  ChecksumError, digests_record, file_checksums, make_record,
                                                  write_digests)
from oarlock.checkpoint.integrity.checksums import (FileChecksums, equal_by_checksum, parse_checksums,
                                                    prefetch_digests, recorded)
from oarlock.checkpoint.integrity.verifier import BlockVerifier
from oarlock.checkpoint.integrity.ownership import (LEVELS, OWNER_RUN, block_bytes, block_owners, c_strides,
                                                    touched_blocks)
from oarlock.checkpoint.integrity.verify import (OVERLAP, corrupt_keys, hash_beside, overlapped_error,
                                                 verify_all_blocks, verify_group, verify_mode, verify_own_file,
                                                 verify_reads_for_others)
from oarlock.checkpoint.integrity.report import Problem, VerifyReport, verify_checkpoint

__all__ = [
    "ALGORITHM", "BLOCK_SIZE", "CHECKSUMS_KEY", "DIGESTS_SUFFIX", "BlockHasher", "ChecksumError", "digests_record",
    "file_checksums", "make_record", "write_digests",
    "FileChecksums", "equal_by_checksum", "parse_checksums", "prefetch_digests", "recorded",
    "BlockVerifier",
    "LEVELS", "OWNER_RUN", "block_bytes", "block_owners", "c_strides", "touched_blocks",
    "OVERLAP", "corrupt_keys", "hash_beside", "overlapped_error", "verify_all_blocks", "verify_group", "verify_mode",
    "verify_own_file", "verify_reads_for_others",
    "Problem", "VerifyReport", "verify_checkpoint",
]
