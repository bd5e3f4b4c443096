"""The docs' snippets run as written: every code block marked ``<!-- file: NAME -->`` in the README
and docs/ is saved under that name and run, in the orders users run them (the generator first)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MARKED = re.compile(r"<!-- file: (\S+?)(?: [^>]*)? -->\n```python\n(.*?)```", re.S)


def snippets() -> dict[str, str]:
    found: dict[str, str] = {}
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for name, code in MARKED.findall(doc.read_text()):
            assert name not in found, f"{name} is marked twice"
            found[name] = code
    return found


@pytest.fixture
def scripts(tmp_path: Path) -> Path:
    for name, code in snippets().items():
        (tmp_path / name).write_text(code)
    return tmp_path


def env_for(port: int | None = None) -> dict[str, str]:
    env = dict(os.environ, WEIGHTSYNC_TOKEN="docs-test-secret", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)  # as a user runs them: the installed weightsync, from their own folder
    if port is not None:
        env["TRAINER_ADDRESS"] = f"127.0.0.1:{port}"
    return env


def start(path: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, path.name], cwd=path.parent, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
        raise AssertionError(f"{proc.args} still running after {timeout}s:\n{out[-3000:]}") from None
    assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}:\n{out[-3000:]}"
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_marked_snippet_is_run_by_this_module() -> None:
    assert set(snippets()) == {"trainer.py", "generator.py", "sync_trainer.py", "replace.py", "ft_replace.py",
                               "ray_replace.py", "quantized.py", "lora.py"}


@pytest.mark.vllm  # peft and transformers are installed where vLLM is (make test-vllm)
def test_the_lora_snippet_trains_and_pushes_only_the_adapter(scripts: Path, run_transport: str) -> None:
    if run_transport != "auto":  # the snippet picks its own transport: once per make test-vllm
        pytest.skip("runs once, in the --transport auto pass (make test-vllm runs both)")
    pytest.importorskip("peft")
    out = finish(start(scripts / "lora.py", env_for()), 180)
    steps = re.findall(r"step (\d): loss ([\d.]+), sent (\d+) bytes \(([\d.]+)% of the model\), generator holds "
                       r"math \(([\d, ]*)\)", out)
    assert [s[0] for s in steps] == ["1", "2", "3"], out
    assert [s[4].rstrip(",") for s in steps] == ["1", "1, 2", "2, 3"], out
    assert all(float(s[3]) < 10 for s in steps), out  # the adapter only


def test_the_quantization_snippet_sends_half_the_bytes_of_bf16_bit_exact(scripts: Path) -> None:
    out = finish(start(scripts / "quantized.py", env_for()), 120)
    assert "'model.layers.0.self_attn.q_proj.weight': ('torch.float8_e4m3fn', (256, 256))" in out, out
    assert "'model.layers.0.self_attn.q_proj.weight_scale_inv': ('torch.float32', (2, 2))" in out, out
    sent, bf16 = map(int, re.search(r"(\d+) bytes, bf16 would be (\d+)", out).groups())  # type: ignore[union-attr]
    assert sent < 0.6 * bf16, out  # the embeddings, the head and the norm stay bf16


@pytest.mark.parametrize("trainer", ["trainer.py", "sync_trainer.py"])
def test_the_generator_started_before_the_trainer_gets_every_last_version(scripts: Path, trainer: str) -> None:
    env = env_for(free_port())
    generator = start(scripts / "generator.py", env)
    try:
        try:
            trained = finish(start(scripts / trainer, env))
        except AssertionError as err:  # the generator's side of it too: why it never joined
            os.killpg(generator.pid, signal.SIGKILL)
            raise AssertionError(f"{err}\n--- generator.py:\n{generator.communicate(timeout=10)[0][-3000:]}") from None
        served = finish(generator, 60)
    finally:
        if generator.poll() is None:
            os.killpg(generator.pid, signal.SIGKILL)
    assert "delivered to" in trained or "DeliveryReport(version=19" in trained, trained
    assert "serving version 19" in served, served


@pytest.mark.parametrize("script", ["replace.py", "ft_replace.py"])
def test_the_orchestrator_snippets_replace_a_killed_generator(scripts: Path, script: str) -> None:
    out = finish(start(scripts / script, env_for()), 180)
    # the message whole: print's pieces were once interleaved with a generator's own line, and under
    # PYTHONUNBUFFERED a print's text and its newline are two writes, so only the text is held whole
    assert re.search(r"(replaced \S+ with|members now) \('[^'\n]+',\)", out), out


def test_the_ray_recipe_runs_as_written(scripts: Path) -> None:
    """fault-tolerance.md's Ray recipe once left the generator actor, its readiness call and the
    secret to the reader; it runs whole here, on a local Ray cluster of its own."""
    pytest.importorskip("ray", reason="Ray is not installed here (the test extra installs it)")
    temp = tempfile.mkdtemp(prefix="wsray-")  # short: Ray's socket paths must stay under the Unix limit
    try:
        out = finish(start(scripts / "ray_replace.py", dict(env_for(), RAY_TMPDIR=temp)), 240)
    finally:
        for pid in subprocess.run(["pgrep", "-f", temp], capture_output=True, text=True).stdout.split():
            try:  # anything of the script's cluster that outlived it
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp, ignore_errors=True)
    assert re.search(r"members now \('gen0', 'repl-1'\)", out) and re.search(r"repl-1 serves version \d+", out), out


def test_the_module_table_in_architecture_md_names_every_module_and_only_modules_that_exist() -> None:
    """The table under "## Modules" went stale once (new modules, no rows): it is held to the tree."""
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    named: set[str] = set()
    for row in table.splitlines():
        if not row.startswith("| `"):
            continue
        folder = ""
        for cell in re.findall(r"`([^`]+)`", row.split(" | ")[0]):
            path = cell.removeprefix("weightsync/")
            if "/" in path.rstrip("/"):
                folder = path.rsplit("/", 1)[0] + "/"
            elif path.endswith("/"):
                folder = ""
            else:
                path = folder + path
            named.add(path)
    package = REPO / "weightsync"
    on_disk = {str(p.relative_to(package)) for p in package.rglob("*.py") if "integrations/vllm" not in str(p)}
    on_disk.add("integrations/vllm/")
    assert sorted(on_disk - named) == [], "modules missing from docs/architecture.md's module table"
    assert sorted(named - on_disk) == [], "rows naming modules that do not exist"


def test_the_thread_table_in_architecture_md_names_every_thread_the_library_starts() -> None:
    """Every thread the library names (``ws-...``: a Thread's name, a pool's prefix, a launched
    role) has its row in "## Components and their threads", so a stack dump's thread names can
    be looked up there."""
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text.split("\n## Components and their threads\n", 1)[1].split("\n## ", 1)[0]
    rows = "\n".join(r for r in table.splitlines() if r.startswith("| "))
    names: set[str] = set()
    for path in sorted((REPO / "weightsync").rglob("*.py")):
        source = path.read_text()
        for literal in re.findall(r'(?:name|thread_name_prefix)=f?"(ws-[^"]+)"', source):
            names.add(re.sub(r"\{[^}]*\}", "<channel>", literal))
        for line in (line for line in source.splitlines() if "lifecycle.launch(" in line):
            names |= {f"ws-<channel>-{role}" for role in re.findall(r'\(\w+(?:\.\w+)*, "(\w+)"\)', line)}
    assert len(names) >= 10, names  # the search above still finds what it looks for
    missing = sorted(n for n in names if f"`{n}`" not in rows and n.removeprefix("ws-<channel>-") not in
                     re.findall(r"^\| [^|]+ \| (\w[\w-]*) \(", rows, re.M))
    assert missing == [], f"threads without a row in docs/architecture.md's thread table: {missing}"
