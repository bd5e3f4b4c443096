"""Starting and collecting the generator processes of the benchmarks (msgspec JSON results)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec


class Workers:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def spawn(self, **spec: object) -> None:
        out = self.tmp / f"w{len(self.procs)}.json"
        env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR")
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.workers",
                                 msgspec.json.encode({**spec, "result": str(out)}).decode()], env=env)
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


