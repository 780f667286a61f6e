"""How every benchmark reports: a table on stdout and, on request, the same figures as JSON."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    """Print rows (dicts with the same keys) as an aligned table under a title."""
    print(f"\n{title}")
    if not rows:
        print("  (no rows)")
        return
    columns = list(rows[0])
    cells = [[_format(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  " + "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    print("  " + "  ".join("-" * w for w in widths))
    for r in cells:
        print("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))


def machine() -> dict[str, Any]:
    """What the figures were measured on, recorded beside them."""
    import os

    info: dict[str, Any] = {"cpu_cores": os.cpu_count(), "platform": platform.platform()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return info


def write_json(path: str | Path, figures: dict[str, Any]) -> None:
    """Write the figures (plus the machine they came from) as JSON."""
    payload = {**figures, "machine": figures.get("machine", machine())}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    print(f"\nwrote {path}")


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return "" if value is None else str(value)
