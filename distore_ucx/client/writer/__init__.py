"""The writer (actor side): `Writer` (writer.py), and its parts, one concept
a module (writer.py's docstring lists them)."""

from .writer import Writer

__all__ = ["Writer"]
