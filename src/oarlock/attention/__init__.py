"""oarlock.attention (see README.md)."""
