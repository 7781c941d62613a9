"""Byte units and the one way mlxd writes a byte count for people.

Memory is counted in binary units everywhere (budgets, estimates, reports,
error messages): ``1 GiB = 1024**3`` bytes. The config's ``*_gb`` keys are
read as GiB too (the seed's parser does the same).
"""

from __future__ import annotations

KIB = 1024
MIB = 1024**2
GIB = 1024**3


def format_bytes(n: int | float | None) -> str:
    """``n`` bytes for people: ``1.50 GiB``, ``96.0 MiB``, ``512 B``; ``-`` for None."""
    if n is None:
        return "-"
    size = float(n)
    if abs(size) >= GIB:
        return f"{size / GIB:.2f} GiB"
    if abs(size) >= MIB:
        return f"{size / MIB:.1f} MiB"
    if abs(size) >= KIB:
        return f"{size / KIB:.1f} KiB"
    return f"{int(size)} B"
