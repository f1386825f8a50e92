"""Planning: pure functions of descriptions, no files and no processes.

* :mod:`.load`: the load plan, (saved metadata, requested shards, mapping program) -> read items.
* :mod:`.assign`: which rank reads which file (visibility-aware, byte-balanced, deterministic).

Nothing here is re-exported: the public names stay those of :mod:`oarlock.checkpoint`.
"""
