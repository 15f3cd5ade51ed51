"""Plain-text tables and human-readable quantities for ``describe()`` and the CLI."""

from __future__ import annotations

from collections.abc import Sequence

__all__: list[str] = []


def _human(value: float, unit: str) -> str:
    """``1.5 GiB`` for bytes, ``12.3M`` for element counts, plain numbers otherwise."""
    if unit == "bytes":
        v = float(value)
        for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(v) < 1024 or suffix == "TiB":
                return f"{v:.0f} {suffix}" if suffix == "B" else f"{v:.2f} {suffix}"
            v /= 1024
    if unit == "elements":
        v = float(value)
        for suffix in ("", "K", "M", "G", "T"):
            if abs(v) < 1000 or suffix == "T":
                return f"{v:.0f}" if suffix == "" else f"{v:.2f}{suffix}"
            v /= 1000
    if float(value).is_integer():
        return f"{int(value)}"
    return f"{value:.4g}"


def _table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[int] = ()
) -> str:
    """Columns right-aligned (numbers), except the indices in ``left`` (names, text)."""
    widths = [len(h) for h in headers]
    for row in rows:
        for j, cell in enumerate(row):
            widths[j] = max(widths[j], len(cell))
    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if j in left else c.rjust(w)
            for j, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    lines = [fmt(headers), "  ".join("-" * w for w in widths)]
    lines.extend(fmt(row) for row in rows)
    return "\n".join(lines)


def _imbalance(loads: Sequence[float]) -> float:
    """max / mean; 1.0 when everything costs nothing (no rank is worse than another)."""
    total = sum(loads)
    if total <= 0:
        return 1.0
    return max(loads) * len(loads) / total
