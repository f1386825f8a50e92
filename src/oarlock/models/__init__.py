"""oarlock.models (see README.md)."""
