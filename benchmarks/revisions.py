"""A benchmark's ratios at two revisions, side by side in one run (a refactor must not move them).

    python -m benchmarks.revisions --base 0497e99 same_host --sizes 256 --subscribers 2
    python -m benchmarks.revisions --base 0497e99 push_vs_broadcast --sizes 256 --subscribers 2
    .venv-vllm/bin/python -m benchmarks.revisions --base 0497e99 delta --layers 2 --lrs 1e-6 --steps 2 --planes group

The base revision is checked out in a temporary git worktree; the benchmark runs there and in
this checkout in turns (base, this, base, this: ``--rounds``), each in its own process with its
own tree first on the path, so machine drift lands on both. Each run's JSON gives ratios (the
same-host benchmark: shared memory's time to all over the group's; push_vs_broadcast: stall and
time to all over the packed broadcast); they are printed per round, with this checkout's median
over the base's. Writes ``revisions-<benchmark>.json`` and a plot.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.report import pyplot, write_json

REPO = Path(__file__).resolve().parent.parent


class Comparison(msgspec.Struct):
    benchmark: str
    args: list[str]
    base: str
    head: str
    rounds: int
    base_ratios: dict[str, list[float]]
    head_ratios: dict[str, list[float]]
    head_over_base: dict[str, float]  # median of this checkout's / median of the base's


def ratios(name: str, report: dict[str, Any]) -> dict[str, float]:
    """The ratios a run's JSON says, by what they compare."""
    out: dict[str, float] = {}
    if name == "same_host":
        points = {(p["transport"], p["checksum"], p["mib"], p["subscribers"], p.get("pipeline", False)): p
                  for p in report["points"]}
        for (transport, check, mib, n, pipe), p in points.items():
            group = points.get(("group", check, mib, n, pipe))
            if transport == "shm" and group and group["to_all_ms"] > 0:
                key = f"shm/group to-all, {mib:.0f} MiB x {n}, checksums {'on' if check else 'off'}"
                out[key] = p["to_all_ms"] / group["to_all_ms"]
        out["memcpy GB/s (ceiling)"] = report["memcpy_gbps"]
    elif name == "push_vs_broadcast":
        naive = {(r["mib"], r["subscribers"]): r for r in report["rows"] if r["mode"] == "naive"}
        for r in report["rows"]:
            if r["mode"] != "packed" and r["stall_vs_packed"] > 0:
                where = f"{r['mode']}, {r['mib']:.0f} MiB x {r['subscribers']}"
                out[f"stall/packed {where}"] = r["stall_vs_packed"]
                out[f"to-all/packed {where}"] = r["to_all_vs_packed"]
                base = naive.get((r["mib"], r["subscribers"]))
                if r["mode"] != "naive" and base and base["to_all_ms"] > 0:  # the other baseline, same run
                    out[f"to-all/naive {where}"] = r["to_all_ms"] / base["to_all_ms"]
    elif name == "delta":
        pushes = report["pushes"]
        for p in pushes:
            if p["encoding"] != "auto":
                continue
            full = next((q for q in pushes if q["encoding"] == "full" and q["transport"] == p["transport"]
                         and q["lr"] == p["lr"] and q["step"] == p["step"]), None)
            if full and full["to_both_ms"] > 0 and p["nbytes"] > 0:
                where = f"{p['transport']}, lr {p['lr']:g}, step {p['step']}"
                out[f"auto/full to both, {where}"] = p["to_both_ms"] / full["to_both_ms"]
                out[f"wire/full bytes, {where}"] = p["wire_bytes"] / (2 * p["nbytes"])
    else:
        raise SystemExit(f"no ratios known for benchmark {name!r}")
    return out


JSON = {"same_host": "same_host.json", "push_vs_broadcast": "bench.json", "delta": "delta.json"}


def run(tree: Path, name: str, args: list[str], out: Path) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args, "--out", str(out)], cwd=tree, env=env,
                          timeout=3600)
    if done.returncode not in (0, 1):  # 1: the benchmark's own targets missed; its ratios still count
        raise SystemExit(f"benchmarks.{name} at {tree} exited {done.returncode}")
    return ratios(name, msgspec.json.decode((out / JSON[name]).read_bytes()))


def revision(rev: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the revision to compare this checkout with")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("benchmark", choices=("same_host", "push_vs_broadcast", "delta"))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    base, head = revision(args.base), revision("HEAD")
    got: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
    with tempfile.TemporaryDirectory(prefix="ws-rev-") as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(tree), base], cwd=REPO, check=True)
        try:
            for i in range(args.rounds):
                for side, where in (("base", tree), ("head", REPO)):
                    print(f"round {i + 1}/{args.rounds}: {args.benchmark} at {base if side == 'base' else head} "
                          f"({side})", flush=True)
                    for key, value in run(where, args.benchmark, args.args, Path(tmp) / f"{side}-{i}").items():
                        got[side].setdefault(key, []).append(value)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
    keys = [k for k in got["head"] if k in got["base"]]
    over = {k: statistics.median(got["head"][k]) / statistics.median(got["base"][k]) for k in keys
            if statistics.median(got["base"][k]) > 0}
    print(f"\n{'ratio':<58} {'base ' + base:>16} {'this ' + head:>16} {'this/base':>9}")
    for k in keys:
        b = " ".join(f"{v:.3f}" for v in got["base"][k])
        h = " ".join(f"{v:.3f}" for v in got["head"][k])
        print(f"{k:<58} {b:>16} {h:>16} {over.get(k, float('nan')):9.3f}")
    report = Comparison(args.benchmark, args.args, base, head, args.rounds, got["base"], got["head"], over)
    path = write_json(args.out, f"revisions-{args.benchmark}", report)
    plt = pyplot()
    if plt is not None and keys:
        fig, ax = plt.subplots(figsize=(9, 0.45 * len(keys) + 1.5))
        ax.barh(range(len(keys)), [over[k] for k in keys], color="#4c72b0")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_yticks(range(len(keys)), keys, fontsize=7)
        ax.set_xlabel(f"this checkout ({head}) / base ({base}), median of {args.rounds} rounds each")
        ax.set_title(f"benchmarks.{args.benchmark}: ratios before and after")
        fig.tight_layout()
        fig.savefig(Path(args.out) / f"revisions-{args.benchmark}.png", dpi=120)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
