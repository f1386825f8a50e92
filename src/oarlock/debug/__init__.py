"""oarlock.debug (see README.md)."""
