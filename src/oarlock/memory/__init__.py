"""oarlock.memory (see README.md)."""
