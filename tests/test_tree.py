"""The tree says where things live: packages import one way, and examples and benchmarks use only
what the library exports (docs/architecture.md, "Modules")."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: lower layers never import higher ones (7: the public surface and programs on top)
LAYERS = {
    "_wire": 0, "_errors": 0, "errors": 0, "testing": 0, "statistics": 0, "options": 0, "_torch_compat": 0,
    "format": 0, "recorder": 1, "planes": 2, "pg": 3, "control": 4, "membership": 5, "orchestrator": 5,
    "transport": 6,
}
PUBLIC = ("weightsync", "weightsync.fr", "weightsync.testing", "weightsync.prometheus", "weightsync.integrations",
          "weightsync.bench", "weightsync.demo")
#: benchmarks that measure an internal itself, and why
INTERNAL_OK = {"benchmarks/control_plane.py": "it measures the control frames' format (an outsider speaking it)",
               "benchmarks/lanes.py": "it turns the lanes' relay rotation off, to measure what the rotation buys",
               "benchmarks/checksums.py": "it measures the digest functions and says which one a publisher picks",
               "benchmarks/cost_model.py": "it models the lanes' relay orders with the library's own function",
               "benchmarks/delta.py": "--no-overlap turns off sending delta buckets as they are made, to measure it",
               "benchmarks/gpu_delta.py": "it measures the delta codec itself, on the device and on the host",
               "benchmarks/gloo_wire.py": "it measures gloo's wire alone, its backend made as the group plane's",
               "benchmarks/floor.py": "it times the group path's bare operations: the snapshot's own copier, the "
                                      "digest a publisher picks, gloo made as the group plane makes it"}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "weightsync" or len(parts) < 2:
        return None
    return LAYERS.get(parts[1], 7)


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("weightsync"):
            found += [node.module] if node.module != "weightsync" else [f"weightsync.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("weightsync")]
    return found


def test_packages_import_one_way() -> None:
    upward = []
    for path in sorted((REPO / "weightsync").rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        mine = _layer(module)
        if mine is None or mine == 7:
            continue
        upward += [f"{module} -> {t}" for t in _imports(path) if (_layer(t) or 0) > mine and _layer(t) != 7 or
                   _layer(t) == 7 and t.split(".")[1] in ("blocking", "cli", "bench", "demo", "integrations")]
    assert not upward, upward


def test_examples_and_benchmarks_use_only_exported_names() -> None:
    private = []
    for folder in ("rl_examples", "benchmarks"):
        for path in sorted((REPO / folder).glob("*.py")):
            rel = str(path.relative_to(REPO))
            for module in _imports(path):
                public = module in PUBLIC or any(module.startswith(p + ".") for p in PUBLIC[4:])
                if module.startswith("weightsync") and not public and rel not in INTERNAL_OK:
                    private.append(f"{rel}: {module}")
    assert not private, private
