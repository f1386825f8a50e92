"""The checkpoint data model: pure descriptions, no I/O and no communication.

* :mod:`.boxes`: boxes of global tensors, their arithmetic, and :func:`~.boxes.numel`, the one shape product.
* :mod:`.sharded`: :class:`~.sharded.ShardedWeight` (a rank's shard with its tensor), its hashable
  :class:`~.sharded.ShardDesc`, and the constructors that describe replicated, axis-sharded and DTensor parameters.
* :mod:`.metadata`: what a checkpoint stores, where, in which box (every source format is read into it).
* :mod:`.grid`, :mod:`.flatgrid`, :mod:`.packed`: the compact records of regular shard layouts, and where a packed
  data file holds each piece; :mod:`.names`: the data files' names and the records' bounds.
* :mod:`.mapping`: the contract between a mapping program (identity or compiled AOA) and the planner.
* :mod:`.traversal`: walking nested state dicts.

Nothing here is re-exported: the public names stay those of :mod:`oarlock.checkpoint`.
"""
