"""Flight recorder: the ring, dumps, the analyzer and the timeline, down to a real frozen member."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch

import weightsync as ws
from tests.conftest import LOOPS, Procs, loop_policy
from tests.statedicts import digests
from weightsync.cli import main as cli
from weightsync.recorder.recorder import FlightRecorder, load_dump
from weightsync.testing import Faults, inject

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(params=LOOPS)
def event_loop_policy(request: pytest.FixtureRequest):
    return loop_policy(request.param)


def analyze_json(directory: Path) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, "-m", "weightsync.cli", "fr", "analyze", str(directory), "--json"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    return out.returncode, (msgspec.json.decode(out.stdout) if out.stdout.strip() else {})


def test_ring_wraps_and_keeps_the_newest() -> None:
    rec = FlightRecorder(capacity=5)
    for i in range(12):
        rec.record("bucket_send", channel="c", member="publisher", bucket=i).start().complete()
    entries = rec.snapshot()
    assert [e.bucket for e in entries] == [7, 8, 9, 10, 11]
    assert [e.seq for e in entries] == sorted(e.seq for e in entries)
    assert all(e.state == "completed" and e.duration >= 0 for e in entries)
    off = FlightRecorder(capacity=0)
    off.record("put", channel="c", member="p")
    assert off.snapshot() == [] and not off.enabled
    with pytest.raises(ValueError, match="capacity"):
        FlightRecorder(capacity=-1)


def test_an_unfinished_entry_outlives_the_ring_wrapping() -> None:
    """A failure (or an operation still in flight) pushed out by later entries is kept aside: the
    death at version 3 still reads in a dump written hundreds of versions later."""
    rec = FlightRecorder(capacity=8)
    rec.record("heartbeat", channel="c", member="publisher", peers=("gen1",)).start().fail("connection closed")
    hung = rec.record("bucket_send", channel="c", member="publisher", version=4).start()
    for i in range(40):
        rec.record("put", channel="c", member="publisher", version=5 + i).start().complete()
    entries = rec.snapshot()
    assert [e.op for e in entries[:2]] == ["heartbeat", "bucket_send"]
    assert entries[0].state == "failed" and entries[1].state == "started"
    assert len(entries) == 10 and [e.seq for e in entries] == sorted(e.seq for e in entries)
    hung.complete()  # ended after it was pushed out: the dump shows how it ended
    assert rec.snapshot()[1].state == "completed"
    for i in range(40):  # completed ones are not kept
        rec.record("put", channel="c", member="publisher", version=50 + i).start().complete()
    assert [e.op for e in rec.snapshot()] == ["heartbeat", "bucket_send"] + ["put"] * 8
    for i in range(10):  # the side list is bounded too (a quarter of the capacity)
        rec.record("receive", channel="c", member="gen0", version=i).start().fail("late")
        rec.record("put", channel="c", member="publisher", version=100 + i).start().complete()
    assert len(rec.snapshot()) == 8 + 2


def test_dump_round_trip_and_states(tmp_path: Path) -> None:
    rec = FlightRecorder(capacity=10, directory=tmp_path, label="gen7")
    rec.record("receive", channel="c", member="gen7", version=3).start().fail(TimeoutError("late"))
    rec.record("publish", channel="c", member="gen7", version=2).complete()
    path = rec.dump()
    assert path.parent == tmp_path and path.name.startswith("gen7-") and path.suffix == ".wsfr"
    dump = load_dump(path)
    assert dump.format_version == 1 and dump.label == "gen7" and dump.pid == os.getpid()
    assert [(e.op, e.state, e.error) for e in dump.entries] == [("receive", "failed", "late"),
                                                                ("publish", "completed", "")]


def test_dumps_from_many_threads_at_once_all_land_and_leave_no_temporary_files(tmp_path: Path) -> None:
    """A sender thread dumping on trouble while the loop dumps at its end (CI saw one rename fail)."""
    threads, rounds = 6, 40
    rec = FlightRecorder(capacity=threads * rounds, directory=tmp_path, label="pub")
    start = threading.Barrier(threads, timeout=60)
    errors: list[BaseException] = []

    def dump_repeatedly(index: int) -> None:
        start.wait()
        for round_ in range(rounds):
            rec.record("publish", channel="c", member="pub", version=index * rounds + round_).complete()
            try:
                rec.dump(reason=f"thread {index}")
            except BaseException as err:  # noqa: BLE001 - collected for the assertion below
                errors.append(err)

    workers = [threading.Thread(target=dump_repeatedly, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert not any(worker.is_alive() for worker in workers)
    assert errors == []
    # the dump, and torch's own trace beside it where this torch keeps one (CI's does)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".json") == [f"pub-{os.getpid()}.wsfr"]
    dump = load_dump(tmp_path / f"pub-{os.getpid()}.wsfr")
    # the file renamed last was read last: it holds every entry recorded before any dump began
    assert sorted(e.version for e in dump.entries) == list(range(threads * rounds))


@pytest.mark.parametrize("content", [b"", b"\x93\x01\x02", b'{"format": "something-else"}', b"\x80\x04K\x01."])
def test_unreadable_dumps_exit_2_with_a_message(tmp_path: Path, content: bytes, capsys) -> None:
    good = FlightRecorder(capacity=4, directory=tmp_path, label="ok")
    good.record("put", channel="c", member="publisher").complete()
    data = good.dump().read_bytes()
    (tmp_path / "bad-1.wsfr").write_bytes(content or data[: len(data) // 2])  # empty: a truncated dump
    assert cli(["fr", "analyze", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "bad-1.wsfr" in err and "Traceback" not in err


def test_hostile_dumps_never_block_never_read_without_bound_never_reach_the_terminal(tmp_path: Path) -> None:
    """A FIFO named like a dump blocked `fr analyze` forever; a symlink to /dev/zero or a 4 GiB file
    was read whole (MemoryError); nested msgpack raised RecursionError; a member id with escape codes
    reached the operator's terminal raw. Each is now a clear exit 2, or escaped text."""
    def run(folder: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "weightsync.cli", "fr", "analyze", str(folder)],
                              capture_output=True, text=True, timeout=60, cwd=REPO)

    cases = {"fifo": lambda p: os.mkfifo(p), "zero": lambda p: p.symlink_to("/dev/zero"),
             "huge": lambda p: os.truncate(p.open("wb").name, 4 << 30),
             "nested": lambda p: p.write_bytes(b"\x91" * 200_000 + b"\x00"),
             "nested-map": lambda p: p.write_bytes(b"\x81\xa6format" + b"\x91" * 200_000 + b"\x00")}
    for name, make in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        make(folder / f"bad-{name}.wsfr")
        out = run(folder)
        assert out.returncode == 2 and f"bad-{name}.wsfr" in out.stderr and "Traceback" not in out.stderr, out

    evil = "gen0\n\x1b[2J\x1b[31mgen1 evicted (dead)\x07"
    rec = FlightRecorder(capacity=10, directory=tmp_path / "escapes", label=evil)
    rec.record("announce", channel="ch\x1b]0;title\x07", member="publisher", version=1, generation=1,
               peers=(evil,)).start()
    rec.record("heartbeat", channel="ch", member="publisher", peers=(evil,)).fail("silent\x1b[1m for 9 s")
    rec.record("bucket_recv", channel="ch", member=evil, version=1, generation=1, bucket=0).start()
    rec.dump()
    for args in (["analyze", "--details"], ["analyze", "--json"]):
        out = subprocess.run([sys.executable, "-m", "weightsync.cli", "fr", args[0], str(tmp_path / "escapes"),
                              *args[1:]], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert out.returncode == 1 and "\x1b" not in out.stdout + out.stderr and "\x07" not in out.stdout, out
        assert "\ngen1 evicted" not in out.stdout and "gen0\\n" in out.stdout.replace("\\\\", "\\"), out.stdout
    assert "\x1b" not in str(load_dump(next((tmp_path / "escapes").glob("*.wsfr"))))


def test_two_hundred_thousand_entries_analyze_and_draw_within_a_minute(tmp_path: Path) -> None:
    """`fr timeline` on 200k entries ran past 120 s (every version scanned every entry; one bar drawn
    per call). A generous liveness bound: seconds here."""
    pytest.importorskip("matplotlib")
    pub = FlightRecorder(capacity=130_000, directory=tmp_path, label="publisher")
    gen = FlightRecorder(capacity=80_000, directory=tmp_path, label="gen0")
    for v in range(40_000):
        for op in ("announce", "bucket_send", "ack"):
            pub.record(op, channel="ch", member="publisher", version=v, generation=v // 100,
                       peers=("gen0",)).start().complete()
        for b in range(2):
            gen.record("bucket_recv", channel="ch", member="gen0", version=v, generation=v // 100,
                       bucket=b).start().complete()
    pub.record("announce", channel="ch", member="publisher", version=40_000, generation=400, peers=("gen0",)).start()
    pub.dump()
    gen.dump()
    for command in (["analyze"], ["timeline", "-o", str(tmp_path / "t.png")]):
        out = subprocess.run([sys.executable, "-m", "weightsync.cli", "fr", command[0], str(tmp_path), *command[1:]],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
        assert out.returncode in (0, 1) and "Traceback" not in out.stderr, out.stderr
    assert (tmp_path / "t.png").stat().st_size > 0


def test_a_bad_entry_never_poisons_the_recorder_and_folders_keep_a_bound(tmp_path: Path) -> None:
    """`get(min_version=2**70)` recorded a version msgpack cannot hold: every later dump raised
    OverflowError out of `dump_on_trouble` ("never raises") and killed the receiver thread. Dumps of
    many runs in one folder grew without bound."""
    from weightsync.recorder.recorder import MAX_DUMPS_PER_FOLDER, prune_dumps

    rec = FlightRecorder(capacity=10, directory=tmp_path / "run", label="gen")
    rec.record("get", channel="c", member="gen", version=2**70).start()
    rec.record("receive", channel="c", member="gen", version=3).start().fail("late")
    path = rec.dump_on_trouble("a deadline", force=True)
    assert path is not None and [e.version for e in load_dump(path).entries] == [3]

    folder = tmp_path / "shared"
    folder.mkdir()
    for i in range(MAX_DUMPS_PER_FOLDER + 10):
        (folder / f"old-{i}.wsfr").write_bytes(b"")
        os.utime(folder / f"old-{i}.wsfr", (1_000_000 + i, 1_000_000 + i))
    mine = FlightRecorder(capacity=4, directory=folder, label="new").dump()
    left = set(p.name for p in folder.glob("*.wsfr"))
    assert len(left) == MAX_DUMPS_PER_FOLDER and mine.name in left and "old-0.wsfr" not in left
    assert prune_dumps(folder) == 0


def test_empty_or_missing_directory_exits_2(tmp_path: Path, capsys) -> None:
    assert cli(["fr", "analyze", str(tmp_path)]) == 2
    assert "no flight-recorder dumps" in capsys.readouterr().err
    assert cli(["fr", "analyze", str(tmp_path / "nope")]) == 2


@pytest.mark.asyncio
@pytest.mark.timeout(240)
async def test_clean_run_analyzes_clean(procs: Procs, tmp_path: Path) -> None:
    rec = FlightRecorder(directory=tmp_path, label="publisher")  # this test's history only
    async with ws.Publisher("clean", timeout=10, heartbeat_interval=0.25, recorder=rec) as pub:
        workers = [procs.spawn("subscriber", channel="clean", address=pub.address, member=f"gen{i}",
                               until_version=1, deadline=120, fr_dir=str(tmp_path), dump_at_end=True)
                   for i in range(2)]
        await pub.wait_subscribers(2, timeout=60)
        for v in range(2):
            await (await pub.put({"w": torch.full((1000,), float(v))}, version=v)).delivered(timeout=60)
        for w in workers:
            await procs.result(w, timeout=60)
    rec.dump(reason="test finished")
    code, report = analyze_json(tmp_path)
    assert code == 0, (report["failures"], report["culprits"], report["missing_dumps"])
    assert report["ok"] and report["culprits"] == [] and {"gen0", "gen1", "publisher"} <= set(report["ranks"])


@pytest.mark.asyncio
@pytest.mark.timeout(300)
async def test_frozen_member_is_named_with_version_and_bucket(procs: Procs, tmp_path: Path) -> None:
    """SIGSTOP one of three subscribers mid-transfer: deadline fires, dumps, analyzer names it."""
    timeout = 3.0
    rec = FlightRecorder(directory=tmp_path, label="publisher")  # this test's history only
    async with ws.Publisher("frozen", timeout=timeout, heartbeat_interval=0.25, bucket_bytes=1 << 20,
                            recorder=rec) as pub:
        workers = [procs.spawn("subscriber", channel="frozen", address=pub.address, member=f"gen{i}",
                               until_version=2, deadline=120, mode="updates", fr_dir=str(tmp_path),
                               dump_at_end=True) for i in range(3)]
        await pub.wait_subscribers(3, timeout=60)
        body = torch.empty(16 << 20)  # 64 MiB in 1 MiB buckets: the transfer takes a while
        body.fill_(0)
        await (await pub.put({"body": body}, version=0)).delivered(timeout=60)
        body.fill_(1)
        handle = await pub.put({"body": body}, version=1)
        while not any(e.op == "bucket_send" and e.version == 1 for e in rec.snapshot()):
            await asyncio.sleep(0.005)  # until the recorder shows version 1 on the wire
        procs.signal(workers[2], signal.SIGSTOP)  # frozen while version 1 is on the wire
        t0 = time.monotonic()
        report = await handle.delivered(timeout=120)
        assert time.monotonic() - t0 < timeout * 4 + 10  # the deadline fired; nobody waited forever
        assert set(report.members) == {"gen0", "gen1"}  # healthy members lost nothing
        assert [(m.member_id, m.reason) for m in pub.evicted] == [("gen2", "dead")]
        assert [(e.peers, e.error) for e in rec.snapshot() if e.op == "evict"] == [(("gen2",), "dead")]
        body.fill_(2)
        await (await pub.put({"body": body}, version=2)).delivered(timeout=60)
        results = [await procs.result(w, timeout=60) for w in workers[:2]]
    for result in results:  # the survivors read exactly what was put, the re-sent version 1 included
        for version, seen in result["digests"].items():
            assert seen == digests({"body": torch.full((16 << 20,), float(version))}), (result["member"], version)
    stalled = min(e.bucket for e in rec.snapshot() if e.op == "bucket_send" and e.version == 1
                  and e.generation == report_generation(rec) and e.state != "completed")
    names = sorted(p.name.split("-")[0] for p in tmp_path.glob("*.wsfr"))
    assert names == ["gen0", "gen1", "publisher"]  # every live rank left a dump; the frozen one cannot
    code, analysis = analyze_json(tmp_path)
    assert code == 1
    culprits = analysis["culprits"]
    assert [(c["member"], c["version"]) for c in culprits] == [("gen2", 1)]
    assert culprits[0]["bucket"] == stalled  # where the publisher's own send of version 1 stopped
    assert analysis["missing_dumps"] == ["gen2"]
    text = subprocess.run([sys.executable, "-m", "weightsync.cli", "fr", "analyze", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO).stdout
    assert f"LIKELY CULPRIT: gen2 at frozen v1 bucket {culprits[0]['bucket']}" in text
    png = tmp_path / "timeline.png"
    assert cli(["fr", "timeline", str(tmp_path), "-o", str(png)]) == 0  # written: 0 (the stall is analyze's 1)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    html = tmp_path / "timeline.html"
    assert cli(["fr", "timeline", str(tmp_path), "-o", str(html)]) == 0
    assert "LIKELY CULPRIT: gen2" in html.read_text()




def report_generation(rec: FlightRecorder) -> int:
    """The generation version 1 was first announced in (the one the frozen member spoiled)."""
    return min(e.generation for e in rec.snapshot() if e.op == "announce" and e.version == 1)


def test_sigusr1_dumps_when_the_application_installed_the_handler(tmp_path: Path) -> None:
    code = ("import os, signal, sys, time, weightsync as ws\n"
            "from weightsync.recorder.recorder import install_signal_handler\n"
            "rec = ws.FlightRecorder(capacity=10, directory=sys.argv[1], label='app')\n"
            "rec.record('put', channel='c', member='publisher', version=1).complete()\n"
            "assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # importing installed nothing\n"
            "install_signal_handler(rec)\n"
            "os.kill(os.getpid(), signal.SIGUSR1)\n"
            "deadline = time.monotonic() + 10\n"
            "while rec.last_dump_path is None and time.monotonic() < deadline:\n"
            "    time.sleep(0.01)  # the handler runs between bytecodes of the main thread\n"
            "print(rec.last_dump_path)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    dump = load_dump(out.stdout.strip())
    assert dump.reason == "signal SIGUSR1" and [e.op for e in dump.entries] == ["put"]


def test_automatic_dumps_are_rate_limited_per_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from weightsync.recorder import recorder as recorder_module

    clock = [1000.0]
    fake = types.SimpleNamespace(monotonic=lambda: clock[0], time=time.time)
    monkeypatch.setattr(recorder_module, "time", fake)  # this module's clock only
    rec = FlightRecorder(directory=tmp_path, label="p")
    rec.record("put", channel="c", member="p").fail("first trouble")
    assert rec.dump_on_trouble("one") is not None
    clock[0] += 0.4  # within 0.5 s of the last automatic dump: skipped
    assert rec.dump_on_trouble("two") is None
    assert rec.dump_on_trouble("forced", force=True) is not None  # a forced one is not limited
    clock[0] += 0.6
    path = rec.dump_on_trouble("three")
    assert path is not None and load_dump(path).reason == "three"


def test_dumps_go_where_the_docs_say(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    monkeypatch.delenv("WEIGHTSYNC_FR_DIR", raising=False)
    default = FlightRecorder()
    default.configure(label="gen0", default_directory="chan-host-1234")
    assert default.directory == Path(tempfile.gettempdir()) / "weightsync-fr" / "chan-host-1234"
    monkeypatch.setenv("WEIGHTSYNC_FR_DIR", str(tmp_path / "env"))
    from_env = FlightRecorder()
    from_env.configure(default_directory="chan-host-1234")  # the environment beats the default
    assert from_env.directory == tmp_path / "env"
    explicit = FlightRecorder()
    explicit.configure(directory=tmp_path / "mine", default_directory="chan-host-1234")
    explicit.configure(default_directory="other")  # the first explicit setting stays
    assert explicit.directory == tmp_path / "mine"
    explicit.configure(label="first")
    explicit.configure(label="second")
    assert explicit.label == "first"
    path = explicit.dump()
    assert path == tmp_path / "mine" / f"first-{os.getpid()}.wsfr" and load_dump(path).label == "first"


def test_torchs_own_trace_is_written_beside_a_dump_when_there_is_one(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from weightsync import _torch_compat as compat

    rec = FlightRecorder(directory=tmp_path, label="pub")
    monkeypatch.setattr(compat, "torch_flight_recorder_json", lambda: b"")
    empty = rec.dump()
    assert not empty.with_suffix(".torch.json").exists()  # nothing of torch's to write
    monkeypatch.setattr(compat, "torch_flight_recorder_json", lambda: b'{"version": "2.10", "entries": []}')
    path = rec.dump()
    assert path.with_suffix(".torch.json").read_bytes() == b'{"version": "2.10", "entries": []}'


@pytest.mark.asyncio
async def test_aclose_after_trouble_dumps_the_whole_story_and_a_quiet_channel_dumps_nothing(tmp_path: Path) -> None:
    """flight-recorder.md: a dump "again at aclose() if there was trouble, so the file has the
    whole story". A corrupted version is trouble (an automatic dump); what happens after it (a
    later put) is in the file once the publisher closes. A channel without trouble writes no
    file at all."""
    quiet_dir, trouble_dir = tmp_path / "quiet", tmp_path / "trouble"
    quiet = FlightRecorder(capacity=1000, directory=quiet_dir, label="pub")
    async with ws.Publisher("quiet", timeout=5, heartbeat_interval=0.25, recorder=quiet) as pub:
        async with ws.Subscriber("quiet", address=pub.address, timeout=5, recorder=FlightRecorder(capacity=0)):
            await pub.wait_subscribers(1, timeout=10)
            await (await pub.put({"x": torch.ones(8)}, version=0)).delivered(timeout=10)
    assert not quiet_dir.exists() or not list(quiet_dir.iterdir())

    rec = FlightRecorder(capacity=1000, directory=trouble_dir, label="pub")
    async with ws.Publisher("trouble", timeout=5, heartbeat_interval=0.25, recorder=rec) as pub:
        sub = ws.Subscriber("trouble", address=pub.address, member_id="m", timeout=5,
                            recorder=FlightRecorder(capacity=0))
        inject(sub, Faults(corrupt={0}))  # version 0 arrives corrupted once: nacked, dumped, re-sent
        async with sub:
            await pub.wait_subscribers(1, timeout=10)
            await (await pub.put({"x": torch.ones(8)}, version=0)).delivered(timeout=10)
            assert rec.last_dump_path is not None
            first = load_dump(rec.last_dump_path)
            assert not any(e.op == "put" and e.version == 1 for e in first.entries)
            await (await pub.put({"x": torch.ones(8)}, version=1)).delivered(timeout=10)  # after the dump
    final = load_dump(trouble_dir / f"pub-{os.getpid()}.wsfr")
    assert final.reason == "closed after trouble"
    assert any(e.op == "put" and e.version == 1 and e.state == "completed" for e in final.entries)


def test_piped_into_head_the_cli_ends_quietly_and_fr_list_finds_folders_without_the_port(tmp_path: Path) -> None:
    """`fr analyze --json | head` ended in a BrokenPipe traceback; `fr list` names the folders under
    the default directory (newest first), so nobody needs the publisher's port to find theirs; old
    folders are pruned to a bound, never the one in use."""
    from weightsync.recorder.recorder import dump_folders, prune_dump_folders

    rec = FlightRecorder(capacity=5000, directory=tmp_path / "run", label="publisher")
    for v in range(3000):  # far more output than a pipe holds
        rec.record("announce", channel="ch", member="publisher", version=v, generation=1, peers=("a",)).start()
    rec.dump()
    for flag in ("--json", "--details"):
        command = f"{sys.executable} -m weightsync.cli fr analyze {tmp_path / 'run'} {flag} | head -c 100"
        out = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120, cwd=REPO)
        assert len(out.stdout) == 100 and "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr

    root = tmp_path / "tmp" / "weightsync-fr"
    for i in range(40):
        folder = root / f"chan-127.0.0.1-{5000 + i}"
        folder.mkdir(parents=True)
        (folder / f"publisher-{i}.wsfr").write_bytes(b"")
        os.utime(folder, (1_000_000 + i, 1_000_000 + i))
    listed = subprocess.run([sys.executable, "-m", "weightsync.cli", "fr", "list"], capture_output=True, text=True,
                            timeout=120, cwd=REPO, env=dict(os.environ, TMPDIR=str(tmp_path / "tmp"))).stdout
    rows = [line for line in listed.splitlines() if "weightsync-fr/chan-" in line]
    assert len(rows) == 40 and rows[0].endswith("chan-127.0.0.1-5039") and "1 dumps" in rows[0]
    keep = root / "chan-127.0.0.1-5000"  # the oldest, but in use by this process
    assert prune_dump_folders(keep=keep, limit=32, root=root) == 7
    left = [f for f, _n, _t in dump_folders(root)]
    assert len(left) == 33 and keep in left and root / "chan-127.0.0.1-5039" in left
    assert root / "chan-127.0.0.1-5001" not in left  # the oldest ones went


@pytest.mark.asyncio
async def test_a_quiet_channel_dumps_at_close_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """$WEIGHTSYNC_FR_DUMP=close: a healthy run leaves its story too, to compare a bad night with."""
    monkeypatch.setenv("WEIGHTSYNC_FR_DUMP", "close")
    rec = FlightRecorder(capacity=1000, directory=tmp_path, label="pub")
    assert rec.dump_at_close
    async with ws.Publisher("asked", timeout=5, heartbeat_interval=0.25, recorder=rec) as pub:
        async with ws.Subscriber("asked", address=pub.address, timeout=5, recorder=FlightRecorder(capacity=0)):
            await pub.wait_subscribers(1, timeout=10)
            await (await pub.put({"x": torch.ones(8)}, version=0)).delivered(timeout=10)
    final = load_dump(tmp_path / f"pub-{os.getpid()}.wsfr")
    assert final.reason == "closed" and any(e.op == "put" and e.state == "completed" for e in final.entries)


@pytest.mark.asyncio
@pytest.mark.timeout(240)
async def test_a_real_kill_and_replace_run_reads_as_it_happened(procs: Procs, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Two followers, one killed with -9 and replaced by the orchestrator; every process that lives
    dumps at its close. The analyzer names the killed member once, with the cause the publisher saw,
    never the healthy replacement; its text is a summary; the timeline is written (exit 0), with
    the death marked and an incident panel."""
    from tests.test_stragglers import close_then_reap, orchestrator, put_checked
    from weightsync.recorder.analyze import analyze, load_dir
    from weightsync.recorder.timeline import _incidents

    monkeypatch.setenv("WEIGHTSYNC_FR_DUMP", "close")  # this process's recorder and every child's
    numel = 64 << 10
    rec = FlightRecorder(directory=tmp_path, label="publisher")
    async with ws.Publisher("frk", timeout=4.0, heartbeat_interval=0.25, bucket_bytes=1 << 18, recorder=rec) as pub:
        async with orchestrator(tmp_path, "frk", pub.address) as orch:
            pub.orchestrator = orch
            workers = [procs.spawn("subscriber", channel="frk", address=pub.address, member=f"gen{i}",
                                   mode="follow", deadline=180, fr_dir=str(tmp_path)) for i in range(2)]
            await pub.wait_subscribers(2, timeout=60)
            for v in range(3):
                await (await put_checked(pub, v, numel)).delivered(timeout=60)
            procs.signal(workers[1], signal.SIGKILL)
            version = 3
            # a liveness bound in time, not in puts: on busy cores a replacement takes seconds to start
            # while a put of 256 KiB takes milliseconds (2000 puts once passed before it joined)
            deadline = asyncio.get_running_loop().time() + 120
            while "repl-1" not in pub.members:
                await (await put_checked(pub, version, numel)).delivered(timeout=60)
                version += 1
                assert asyncio.get_running_loop().time() < deadline, "the replacement never joined within 120 s"
            for _ in range(3):
                report = await (await put_checked(pub, version, numel)).delivered(timeout=60)
                version += 1
            assert set(report.members) == {"gen0", "repl-1"}
            await close_then_reap(pub, orch)
    await procs.result(workers[0], timeout=60)
    code, analysis = analyze_json(tmp_path)
    assert code == 1  # a member died: not a clean run
    # killed between two versions it is a death; killed while one was on the wire, also that
    # version's culprit (and a member without a dump that did not acknowledge it)
    assert [d["member"] for d in analysis["deaths"]] == ["gen1"]
    assert analysis["deaths"][0]["cause"] == "its connection closed (it exited or was killed)"
    assert [c["member"] for c in analysis["culprits"]] in ([], ["gen1"])
    assert all("its connection closed" in c["reason"] for c in analysis["culprits"])
    assert analysis["missing_dumps"] in ([], ["gen1"])
    after = [v for v in analysis["versions"] if "repl-1" in v["members"]]
    assert after and all(v["members"]["repl-1"] == "published" for v in after)
    assert not any(words == "no dump" for v in analysis["versions"] for m, words in v["members"].items()
                   if m != "gen1")
    text = subprocess.run([sys.executable, "-m", "weightsync.cli", "fr", "analyze", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO).stdout
    assert "died: gen1 (frk): its connection closed" in text and len(text.splitlines()) < 40, text
    png = tmp_path / "timeline.png"
    assert cli(["fr", "timeline", str(tmp_path), "-o", str(png)]) == 0 and png.stat().st_size > 10_000
    dumps = load_dir(tmp_path)
    assert ("gen1", "died") in [(m, label.split(":")[0]) for _t, m, label in _incidents(dumps, analyze(dumps))]
