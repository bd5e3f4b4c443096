"""Starting and collecting the generator processes of the benchmarks (msgspec JSON results)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec

# where the k-th worker runs: (k, argv, env) -> its process (an emulated host's popen, benchmarks.netns)
Launch = Callable[[int, list[str], dict[str, str]], "subprocess.Popen[bytes]"]


class Workers:
    def __init__(self, tmp: Path, launch: Launch | None = None) -> None:
        self.tmp = tmp
        self.launch = launch
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def spawn(self, **spec: object) -> None:
        # unique to this set of workers: two sets in one directory (a bench's baseline receivers and its
        # subscribers) wrote the same w0.json, and one's result was read as the other's (2026-12-04)
        out = self.tmp / f"w{id(self):x}-{len(self.procs)}.json"
        env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR")
        argv = [sys.executable, "-m", "benchmarks.workers", msgspec.json.encode({**spec, "result": str(out)}).decode()]
        if self.launch is not None:
            env.pop("GLOO_SOCKET_IFNAME", None)
            env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
            proc = self.launch(len(self.procs), argv, env)
        else:
            proc = subprocess.Popen(argv, env=env)
        self.procs.append((proc, out))

    def results(self, timeout: float) -> list[dict]:
        results = []
        for proc, out in self.procs:
            proc.wait(timeout=timeout)
            result = msgspec.json.decode(out.read_bytes()) if out.exists() else {"error": f"exit {proc.returncode}"}
            if result.get("error"):
                raise RuntimeError(f"a generator process failed: {result['error']}")
            results.append(result)
        self.procs = []
        return results

    def kill(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


