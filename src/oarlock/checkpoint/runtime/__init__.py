"""What runs a checkpoint plan across ranks: agreement between ranks and the views they share of a checkpoint
(internal; the public names are in :mod:`oarlock.checkpoint`)."""
