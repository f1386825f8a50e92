"""Training lifecycle: what a training loop saves and resumes besides the model weights.

* :mod:`.optim`: optimizer state as sharded checkpoint entries, and exact resume across layouts.

Nothing here is re-exported: the public names stay those of :mod:`oarlock.checkpoint`.
"""
