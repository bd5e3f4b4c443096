"""The tree says where things live: packages import one way, and examples and benchmarks use only
what the library exports (docs/architecture.md, "Modules")."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: lower layers never import higher ones (8, TOP: the public surface and programs on top). The order, from
#: the bottom: the byte layout and the shared leaves; the recorder; the encodings; the planes (the
#: interface, then one folder per plane with both of its ends); the control plane; membership; the
#: engine that drives a version (Sender, Receiver and what they own); the asyncio API users call
LAYERS = {
    "_wire": 0, "_errors": 0, "errors": 0, "testing": 0, "statistics": 0, "options": 0, "_torch_compat": 0,
    "format": 0, "recorder": 1, "encodings": 2, "planes": 3, "control": 4, "membership": 5, "orchestrator": 5,
    "engine": 6, "transport": 7,
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
               "benchmarks/codec.py": "it measures the delta codec itself, both implementations, on the host",
               "benchmarks/gloo_wire.py": "it measures gloo's wire alone, its backend made as the group plane's",
               "benchmarks/floor.py": "it times the group path's bare operations: the snapshot's own copier, the "
                                      "digest a publisher picks, gloo made as the group plane makes it"}


TOP = 8


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "weightsync" or len(parts) < 2:
        return None
    return LAYERS.get(parts[1], TOP)


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
        if mine is None or mine == TOP:
            continue
        upward += [f"{module} -> {t}" for t in _imports(path) if (_layer(t) or 0) > mine and _layer(t) != TOP or
                   _layer(t) == TOP and t.split(".")[1] in ("blocking", "cli", "bench", "demo", "integrations")]
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


#: the size budget (issue 53): a module at most this many lines, a function at most this many
MODULE_LINES, FUNCTION_LINES = 600, 80
#: functions over the budget today, each at most its length here. The list only shrinks: an entry
#: whose function came within the budget (or is gone) fails the test until it is taken out
OVER_BUDGET = {
    "weightsync/bench/run.py::spmd": 87,  # one torchrun rank's whole benchmark, its modes in order
    "weightsync/recorder/analyze.py::analyze": 93,  # the analyzer's one pass over every dump's entries
    "weightsync/transport/publisher.py::Publisher.__init__": 95,  # the options checked, then the parts composed
}


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    modules, functions = {}, {}
    for path in sorted((REPO / "weightsync").rglob("*.py")):
        rel, source = str(path.relative_to(REPO)), path.read_text()
        modules[rel] = source.count("\n")
        tree = ast.parse(source)
        for top in tree.body:
            inner = top.body if isinstance(top, ast.ClassDef) else [top]
            for node in inner:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    name = f"{top.name}.{node.name}" if isinstance(top, ast.ClassDef) else node.name
                    functions[f"{rel}::{name}"] = node.end_lineno - node.lineno + 1  # type: ignore[operator]
    return modules, functions


def test_modules_and_functions_keep_to_the_size_budget() -> None:
    modules, functions = _sizes()
    assert not {m: n for m, n in modules.items() if n > MODULE_LINES}, f"modules over {MODULE_LINES} lines"
    over = {f: n for f, n in functions.items() if n > FUNCTION_LINES}
    grew = {f: (n, OVER_BUDGET.get(f)) for f, n in over.items() if n > OVER_BUDGET.get(f, FUNCTION_LINES)}
    assert not grew, f"functions over {FUNCTION_LINES} lines (now, allowed): {grew}"
    shrunk = sorted(set(OVER_BUDGET) - set(over))
    assert not shrunk, f"within the budget now (or gone): take them out of OVER_BUDGET: {shrunk}"


def _graph() -> dict[str, set[str]]:
    """Module -> the weightsync modules it imports, at its top or inside a function."""
    paths = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
             for p in sorted((REPO / "weightsync").rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("weightsync"):
                # "from weightsync.encodings import delta" imports the module weightsync.encodings.delta
                names = {f"{node.module}.{a.name}" for a in node.names} & set(paths)
                found |= names or {node.module}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("weightsync")}
        graph[module] = {t for t in found if t in paths and t != module}
    return graph


def test_no_module_imports_itself_back_through_others() -> None:
    """An import circle (planes.encoding and planes.delta once imported each other) means two
    modules that are one concern, or a seam in the wrong place."""
    graph, circles = _graph(), []
    for start in graph:
        seen, todo = set(), [(start, (start,))]
        while todo:
            module, path = todo.pop()
            for nxt in graph[module]:
                if nxt == start:
                    circles.append(" -> ".join((*path, start)))
                elif nxt not in seen:
                    seen.add(nxt)
                    todo.append((nxt, (*path, nxt)))
    assert not circles, circles


def test_a_plane_and_an_encoding_written_outside_import_only_the_public_seams() -> None:
    """tests/mailbox_plane.py and tests/xor_encoding.py are what an author outside the library
    writes: every weightsync name they use comes from weightsync.extend."""
    private = [f"{name}: {module}" for name in ("mailbox_plane", "xor_encoding")
               for module in _imports(REPO / "tests" / f"{name}.py") if module != "weightsync.extend"]
    assert not private, private
