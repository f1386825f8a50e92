"""Moved: checkpoint locations and the storage protocol live in :mod:`oarlock.checkpoint.storage` now
(``location``, ``backend``, ``local``, ``s3``). This module keeps the old import path working for one release."""

from oarlock.checkpoint.storage.backend import (ObjectStoreError, ObjectWriter, Storage,  # noqa: F401
                                                UnsupportedLocationError, pread_into)
from oarlock.checkpoint.storage.local import LocalStorage  # noqa: F401
from oarlock.checkpoint.storage.location import ObjectPath, is_object_path, location, storage_for  # noqa: F401
from oarlock.checkpoint.storage.s3 import (MIN_PART_BYTES, S3Storage, S3Writer, keep_budget,  # noqa: F401
                                           keep_verified_blocks, kept_room, remember_verified_block,
                                           s3_concurrency)

__all__ = ["LocalStorage", "ObjectPath", "ObjectStoreError", "ObjectWriter", "S3Storage", "Storage",
           "UnsupportedLocationError", "is_object_path", "location", "storage_for"]


def __getattr__(name: str):
    from oarlock.checkpoint.storage import location as _location, s3 as _s3

    for m in (_s3, _location):
        if hasattr(m, name):
            return getattr(m, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
