"""The wheel is the product: it holds only ``weightsync``, installs into an environment with just
torch and the declared dependencies, and its CLI works from any directory, writing nothing
into site-packages."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import msgspec
import pytest
import torch

from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def sh(*argv: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    out = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, f"{argv} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", out, REPO)
    (path,) = out.glob("weightsync-*.whl")
    return path


def test_the_wheel_holds_only_weightsync(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"weightsync"}, top
    assert "weightsync/py.typed" in names


@pytest.mark.skipif(torch.__version__.split("+")[0] != "2.13.0",
                    reason="the fresh environment takes torch 2.13.0 from this machine's disk; CI's 2.13 run has it")
def test_installed_without_editable_mode_it_imports_and_its_cli_writes_nothing_there(wheel: Path,
                                                                                    tmp_path: Path) -> None:
    """Also: `weightsync bench` and `weightsync demo` run from that install in empty directories."""
    venv = tmp_path / "venv"
    sh(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    sh(python, "-m", "pip", "install", "--quiet", "torch==2.13.0", wheel)
    site = Path(sh(python, "-c", "import weightsync, os; print(os.path.dirname(weightsync.__file__))").strip())
    before = sorted(p.relative_to(site) for p in site.rglob("*"))
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # numpy is not a dependency of weightsync (nor of torch): the import must not need it
    code = ("import importlib.util as u; assert u.find_spec('numpy') is None; import weightsync; "
            "assert u.find_spec('benchmarks') is None and u.find_spec('rl_examples') is None; "
            # vLLM finds the backend through this entry point; without vLLM the module still imports
            "from importlib.metadata import entry_points as e; "
            "assert [p.value for p in e(group='vllm.general_plugins')] == ['weightsync.integrations.vllm:register']; "
            "import weightsync.integrations.vllm; "
            "print(weightsync.__version__)")
    sh(python, "-c", code, cwd=empty, env=env)
    doctor = sh(venv / "bin" / "weightsync", "doctor", cwd=empty, env=env)
    assert "gloo" in doctor
    out = subprocess.run([str(venv / "bin" / "weightsync"), "fr", "analyze", str(empty)], cwd=empty, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no flight-recorder dumps" in out.stderr
    assert sorted(p.relative_to(site) for p in site.rglob("*") if "__pycache__" not in p.parts) == [
        p for p in before if "__pycache__" not in p.parts]
    assert list(empty.iterdir()) == []
    # the two programs a new user runs first, from the installed CLI, in a directory of their own:
    # the side-by-side comparison (torchrun launched by the CLI: 1 trainer, 1 generator) ...
    bench_dir, demo_dir = tmp_path / "bench-here", tmp_path / "demo-here"
    bench_dir.mkdir()
    demo_dir.mkdir()
    out = sh(venv / "bin" / "weightsync", "bench", "--sizes", "2,8", "--subscribers", "1", "--reps", "1",
             "--step-ms", "20", cwd=bench_dir, env=env)
    assert "verdict: at 8 MiB to 1 generator, put stalls the trainer" in out and "bit-exact" in out, out
    report = msgspec.json.decode((bench_dir / "weightsync-bench" / "bench.json").read_bytes())
    assert sorted({(r["mode"], round(r["mib"])) for r in report["rows"]}) == sorted(
        (m, s) for m in ("naive", "packed", "put", "put_nocopy") for s in (2, 8))
    assert all(r["exact"] and r["stall_ms"] > 0 and r["to_all_ms"] > 0 for r in report["rows"]) and report["ok"]
    assert not (bench_dir / "weightsync-bench" / "bench.png").exists()  # no matplotlib there: said, not failed
    assert "matplotlib is not installed" in out
    # ... and the demo, writing under ./runs/
    out = sh(venv / "bin" / "weightsync", "demo", "--steps", "3", "--log-every", "1", "--no-check",
             cwd=demo_dir, env=env)
    (run,) = (demo_dir / "runs").iterdir()
    steps = msgspec.json.decode((run / "cartpole.json").read_bytes())
    assert [r["step"] for r in steps] == [1, 2, 3], out
    assert len(list((run / "flight-recorder").glob("*.wsfr"))) == 4
    assert sorted(p.relative_to(site) for p in site.rglob("*") if "__pycache__" not in p.parts) == [
        p for p in before if "__pycache__" not in p.parts]
