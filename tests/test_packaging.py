"""The wheel is the product: it holds only ``weightsync``, installs into an environment with just
torch and the declared dependencies, and its CLI works from any directory, writing nothing
into site-packages."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

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
