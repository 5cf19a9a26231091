"""Byte counts as people read them (error messages and plans)."""

from __future__ import annotations

GiB = 2**30


def format_bytes(nbytes: float) -> str:
    """Bytes in the unit that keeps three significant digits readable (tiny test models to Mixtral)."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{int(nbytes)} B"
