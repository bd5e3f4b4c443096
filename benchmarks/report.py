"""What every benchmark program ends with: its JSON, and a figure when matplotlib is there."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``): figures that depend on it say which one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def write_json(out: str | Path, name: str, data: Any) -> Path:
    """``data`` as formatted JSON in ``out/name.json`` (the directory is made); its path."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_bytes(msgspec.json.format(msgspec.json.encode(data)))
    return path


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or None (with a hint) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install 'weightsync[plot]')")
        return None
    return plt


def save(fig: Any, out: str | Path, name: str, json_path: Path) -> None:
    """Save ``fig`` as ``out/name.png`` and say where both files went."""
    fig.tight_layout()
    png = Path(out) / f"{name}.png"
    fig.savefig(png, dpi=120)
    print(f"wrote {json_path} and {png}")


def replot(json_path: str | Path, out: str | Path, kind: type, plot: Callable[[Any, str | Path, Path], None]) -> int:
    """``--plot-from``: draw the figure of an earlier run's JSON (decoded as ``kind``) into
    ``out``. A device machine without matplotlib brings its JSON back; the figure is drawn here."""
    path = Path(json_path)
    Path(out).mkdir(parents=True, exist_ok=True)
    plot(msgspec.json.decode(path.read_bytes(), type=kind), out, path)
    return 0


def verdict(targets: dict[str, bool]) -> int:
    """Print each target as PASS or FAIL; the program's exit status (1 when one missed)."""
    for name, ok in targets.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    return 0 if all(targets.values()) else 1
