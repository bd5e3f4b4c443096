"""The RL examples in their short mode: they run end to end, leave what they promise, and the
GRPO loop survives a killed generator without the trainer stopping. Learning itself is checked by
the full demo (`make demo`, which exits 1 if the policy did not improve), not here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=280, cwd=REPO)


def test_cartpole_demo_short_mode(tmp_path: Path) -> None:
    out = run("-m", "weightsync.cli", "demo", "--steps", "8", "--log-every", "4", "--no-check", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = msgspec.json.decode((tmp_path / "cartpole.json").read_bytes())
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(r["staleness"] >= 0 and r["push_stall_ms"] >= 0 and r["mean_return"] >= 1 for r in rows)
    assert {r["generator"] for r in rows} <= {"gen0", "gen1", "gen2"}
    assert (tmp_path / "cartpole.png").stat().st_size > 10_000
    dumps = sorted(p.name.split("-")[0] for p in (tmp_path / "flight-recorder").glob("*.wsfr"))
    assert dumps == ["gen0", "gen1", "gen2", "publisher"]  # every process left its recorder
    assert "return" in out.stdout and "flight recorder: 4 dumps" in out.stdout
    # the generators stop only once the last version reached them: none of them left while it was
    # on the wire, which failed it for the leaver and re-sent it to the others
    assert "final policy: version 8 reached 3 of 3 generators (gen0, gen1, gen2)" in out.stdout, out.stdout[-3000:]
    assert "version 8 failed for" not in out.stderr, out.stderr[-3000:]


def test_grpo_survives_a_killed_generator(tmp_path: Path) -> None:
    out = run("-m", "rl_examples.grpo", "--steps", "12", "--kill-generator-at", "4", "--log-every", "4",
              "--prompts", "8", "--no-check", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = msgspec.json.decode((tmp_path / "grpo.json").read_bytes())
    events = [e["what"] for e in report["events"]]
    assert events[0].startswith("killed generator gen0")
    assert any("dropped gen0 (dead)" in e for e in events), events
    assert any(e.startswith("gen-r1 joined") for e in events), events
    steps = report["steps"]
    gaps = [b["seconds"] - a["seconds"] for a, b in zip(steps, steps[1:], strict=False)]
    assert max(gaps) < 10  # the trainer never stopped (liveness bound; typically well under a second)
    assert "gen-r1" in steps[-1]["members"] and "gen0" not in steps[-1]["members"]
    assert (tmp_path / "grpo.png").stat().st_size > 10_000
    assert "killed generator gen0" in out.stdout and "gen-r1 joined" in out.stdout
    assert re.search(r"final policy: version \d+ reached (\d) of \1 generators", out.stdout), out.stdout[-3000:]


def test_minimal_push_ends_bit_exact_on_every_generator() -> None:
    out = run("-m", "rl_examples.minimal_push", "--steps", "4", "--generators", "2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("[gen")]
    assert len(lines) == 2 and all("matches the trainer bit for bit" in line for line in lines), out.stdout
