"""Shared fixtures: both event loops, spawned worker processes that are always killed."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import functools
import inspect
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency; keep collection working without it
    uvloop = None

LOOPS = ["asyncio", "uvloop"] if uvloop is not None else ["asyncio"]

REPO = Path(__file__).resolve().parent.parent


def pytest_addoption(parser: pytest.Parser) -> None:
    # Most tests are about the process group (broadcasts, buckets on the wire, link probes,
    # generations) and run their generators on this host, where "auto" would take shared memory:
    # they ask for the group unless the run says otherwise. tests/test_shm.py asks for each
    # transport explicitly, and `make test` runs the end-to-end modules again with
    # --transport auto (the default users get).
    parser.addoption("--transport", default="group", choices=("group", "auto"),
                     help="the transport subscribers take when a test names none (default: group)")
    # publishers pipeline their host snapshots by default where a process may use 4 CPUs or
    # more, as users' machines do and this suite's 2-core machines do not: `make test` runs the
    # end-to-end modules again with --pipeline on (a rank with nothing to send failed every
    # pipelined put, and only a 16-core machine showed it)
    parser.addoption("--pipeline", default="cpus", choices=("cpus", "on"),
                     help="whether publishers that name no pipeline= pipeline their snapshots: by the CPUs "
                          "(default, as users get) or always")


@pytest.fixture(scope="session", autouse=True)
def run_transport(request: pytest.FixtureRequest) -> Iterator[str]:
    """The run's transport for subscribers that name none, in this process and in the processes
    tests start (``WS_TEST_TRANSPORT``, read by tests/workers.py and tests/vllm_driver.py; the
    library reads no such variable)."""
    from weightsync.testing import set_default_transport

    name = request.config.getoption("--transport")
    previous = set_default_transport(name)
    os.environ["WS_TEST_TRANSPORT"] = name
    yield name
    set_default_transport(previous)


@pytest.fixture(scope="session", autouse=True)
def run_pipeline(request: pytest.FixtureRequest) -> Iterator[bool | None]:
    """The run's ``--pipeline``, here and in the processes tests start (``WS_TEST_PIPELINE``, read
    by tests/workers.py; the library reads no such variable)."""
    from weightsync.testing import set_default_pipeline

    on = True if request.config.getoption("--pipeline") == "on" else None
    previous = set_default_pipeline(on)
    os.environ["WS_TEST_PIPELINE"] = "on" if on else "cpus"
    yield on
    set_default_pipeline(previous)


def loop_policy(name: str) -> asyncio.AbstractEventLoopPolicy:
    return uvloop.EventLoopPolicy() if name == "uvloop" else asyncio.DefaultEventLoopPolicy()


class Forked:
    """A worker forked by tests/forkserver.py: the part of ``subprocess.Popen`` the tests use."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        return self._server.returncode(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self._server.wait(self.pid, timeout)


class ForkServer:
    """tests/forkserver.py, started on first use and shared by every test of this process."""

    def __init__(self) -> None:
        self._log = tempfile.TemporaryFile(prefix="ws-forkserver-")  # noqa: SIM115 - lives as long as the server
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver"], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log)
        self._cond = threading.Condition()
        self._pids: dict[int, int] = {}  # request -> the child's pid
        self._codes: dict[int, int] = {}  # pid -> exit status (negative: the signal)
        self._ids = itertools.count()
        self._reader = threading.Thread(target=self._read, name="ws-test-forkserver", daemon=True)
        self._reader.start()

    def fork(self, argv: list[str], env: dict[str, str], log: Path, timeout: float = 60.0) -> Forked:
        from tests.forkserver import Fork

        rid = next(self._ids)
        assert self.proc.stdin is not None
        with self._cond:
            self.proc.stdin.write(msgspec.json.encode(Fork(rid, argv, env, str(REPO), str(log))) + b"\n")
            self.proc.stdin.flush()
            if not self._cond.wait_for(lambda: rid in self._pids or not self._reader.is_alive(), timeout):
                raise RuntimeError(f"the fork server did not start a worker in {timeout} s")
            if rid not in self._pids:
                raise RuntimeError(f"the fork server is gone: {self.stderr()}")
            return Forked(self, self._pids.pop(rid))

    def returncode(self, pid: int) -> int | None:
        with self._cond:
            return self._codes.get(pid)

    def wait(self, pid: int, timeout: float | None) -> int:
        with self._cond:
            if not self._cond.wait_for(lambda: pid in self._codes or not self._reader.is_alive(), timeout):
                raise subprocess.TimeoutExpired(f"worker {pid}", timeout or 0.0)
            if pid not in self._codes:
                raise RuntimeError(f"the fork server is gone, worker {pid}'s exit is unknown: {self.stderr()}")
            return self._codes[pid]

    def alive(self) -> bool:
        return self.proc.poll() is None and self._reader.is_alive()

    def stderr(self) -> str:
        self._log.seek(0)
        return self._log.read()[-2000:].decode(errors="replace")

    def _read(self) -> None:
        from tests.forkserver import Answer, Exited

        decoder = msgspec.json.Decoder(Answer)
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                answer = decoder.decode(line)
                with self._cond:
                    if isinstance(answer, Exited):
                        self._codes[answer.pid] = answer.returncode
                    else:
                        self._pids[answer.id] = answer.pid
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._cond.notify_all()


_fork_server: ForkServer | None = None
_fork_lock = threading.Lock()


def fork_server() -> ForkServer | None:
    """The shared fork server, or None where workers are exec'd (``WS_TEST_EXEC_WORKERS=1``, or
    a server that died: said once on stderr)."""
    global _fork_server
    if os.environ.get("WS_TEST_EXEC_WORKERS") == "1":
        return None
    with _fork_lock:
        if _fork_server is None:
            _fork_server = ForkServer()
        if not _fork_server.alive():
            print(f"the test fork server is gone; workers are exec'd from here on: {_fork_server.stderr()}",
                  file=sys.stderr)
            os.environ["WS_TEST_EXEC_WORKERS"] = "1"
            return None
        return _fork_server


class Procs:
    """Worker processes started by one test: msgspec JSON results, killed at teardown.

    A worker with no environment of its own is forked from tests/forkserver.py (torch already
    imported); one with ``env`` (an ``LD_PRELOAD`` shim, a variable read at import) is exec'd."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[tuple[subprocess.Popen[bytes] | Forked, Path, Path]] = []

    def spawn(self, role: str, env: dict[str, str] | None = None, **args: object) -> int:
        """Start ``python -m tests.workers ROLE`` with ``args`` (and ``env``); returns its index."""
        index = len(self.procs)
        out = self.tmp / f"{role}-{index}.json"
        log = self.tmp / f"{role}-{index}.log"
        spec = msgspec.json.encode({"role": role, "result": str(out), **args})
        server = None if env else fork_server()
        env = dict(os.environ, **(env or {}), PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        proc: subprocess.Popen[bytes] | Forked
        if server is not None:
            log.touch()  # readable at once, as the exec'd worker's (the child opens it once forked)
            proc = server.fork([spec.decode()], env, log)
        else:
            with open(log, "wb") as fh:
                proc = subprocess.Popen([sys.executable, "-m", "tests.workers", spec.decode()], cwd=REPO, env=env,
                                        stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((proc, out, log))
        return index

    def pid(self, index: int) -> int:
        return self.procs[index][0].pid

    def signal(self, index: int, sig: int) -> None:
        """Send ``sig`` to worker ``index``. One that already exited has nothing left to signal: a
        slow member the publisher evicted, which then ended on its own before the test's kill
        reached it (seen once under CI's load, in test_shm's kill test)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.procs[index][0].pid, sig)

    async def result(self, index: int, timeout: float) -> dict:
        """Wait (without blocking the loop) for worker ``index`` to exit; its decoded result."""
        proc, out, log = self.procs[index]
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                self.kill_all()
                raise AssertionError(f"worker {index} still running after {timeout}s; log:\n{self.log(index)}")
            await asyncio.sleep(0.05)  # polling a child's exit status, not synchronisation
        if proc.returncode != 0 or not out.exists():
            raise AssertionError(f"worker {index} exited {proc.returncode}; log:\n{self.log(index)}")
        return msgspec.json.decode(out.read_bytes())

    def log(self, index: int) -> str:
        return self.procs[index][2].read_text(errors="replace")[-4000:]

    def native_stacks(self, extra: list[int] = ()) -> str:  # type: ignore[assignment]
        """py-spy's native view of every live worker (and ``extra`` pids), where py-spy is installed."""
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if not Path(spy).exists():
            return "(py-spy not installed)"
        out = []
        for pid in [p.pid for p, _, _ in self.procs if p.poll() is None] + list(extra):
            res = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                                 timeout=60)
            out.append(f"--- pid {pid} ---\n{res.stdout[-8000:]}{res.stderr[-500:]}")
        return "\n".join(out)

    def stacks(self) -> str:
        """Every live worker's thread stacks (they print them on SIGUSR2, see tests/workers.py)."""
        live = [i for i, (proc, _, _) in enumerate(self.procs) if proc.poll() is None]
        for i in live:
            try:
                os.kill(self.procs[i][0].pid, signal.SIGUSR2)
            except ProcessLookupError:
                pass
        if live:
            time.sleep(0.5)  # let them write their stacks to their logs
        return "\n".join(f"--- worker {i} ---\n{self.log(i)}" for i in live)

    def kill_all(self) -> None:
        for proc, _, _ in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)


@pytest.fixture
def cpu_hog() -> Iterator[subprocess.Popen[bytes]]:
    """A busy-loop process beside the test for its whole run: decisions about who is dead or late
    are made on a loaded machine, as they are in production."""
    # it spins only while the test process lives: one killed or aborted (a timeout, a crash) left
    # its hog running for hours, loading every later run on the machine
    spin = f"import os\nwhile os.getppid() == {os.getpid()}:\n    for _ in range(100000): pass"
    hog = subprocess.Popen([sys.executable, "-c", spin])
    try:
        yield hog
    finally:
        hog.kill()
        hog.wait(timeout=10)


@pytest.hookimpl(optionalhook=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A module whose async tests run on both event loops (``params=LOOPS``) parametrizes its plain
    tests too; the uvloop copy of a plain test that never touches an event loop (no ``asyncio`` in
    its source) runs the same code twice, and is deselected (12 s of the suite here)."""
    twins = []
    for item in items:
        fn = getattr(item, "function", None)
        if "[uvloop" in item.nodeid and fn is not None and not inspect.iscoroutinefunction(fn) \
                and "asyncio" not in inspect.getsource(fn):
            twins.append(item)
    if twins:
        gone = set(map(id, twins))
        items[:] = [item for item in items if id(item) not in gone]
        config.hook.pytest_deselected(items=twins)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` (``make test-vllm``): the vLLM tests read reports that one driver run
    (its engines) writes once per module, so the tests that share a report, directly or through a
    test reading two, go to one worker as one unit, and no engine starts twice. (xdist's own
    ``xdist_group`` marks do nothing under pytest 9.2, whose node ids xdist can no longer suffix.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByReport(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path, _, rest = nodeid.partition("::")
            name, _, params = rest.partition("[")
            group = _report_groups(path).get(name)
            return nodeid if group is None else f"{path}::{group}[{params}"

    return ByReport(config, log)


@functools.cache
def _report_groups(path: str) -> dict[str, str]:
    """Test function name to the report fixture its group is named by, in the module at ``path``
    (read, not imported: the controller runs no tests)."""
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent.setdefault(name, name) != name:
            name = parent[name]
        return name

    file = REPO / path
    tests = {} if file.suffix != ".py" or not file.exists() else {
        node.name: [a.arg for a in node.args.args if a.arg.endswith("report")]
        for node in ast.parse(file.read_text()).body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")}
    for names in tests.values():
        for name in names[1:]:
            parent[root(name)] = root(names[0])
    return {test: root(names[0]) for test, names in tests.items() if names}


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without workers)
        session.config.stash[_RENDEZVOUS] = vllm_rendezvous_files()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """vLLM engines leave a rendezvous file in the temporary directory (``vllm_dist_*``) when they
    are killed, not shut down. The controller removes the ones this run left once every worker
    is done: a worker removing them while the other worker's engine starts would break it."""
    before = session.config.stash.get(_RENDEZVOUS, None)
    if before is not None:
        for left in vllm_rendezvous_files() - before:
            left.unlink(missing_ok=True)


_RENDEZVOUS = pytest.StashKey[set[Path]]()


def vllm_rendezvous_files() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("vllm_dist_*"))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Keeps each phase's report on the test, so fixtures can tell at teardown that it failed."""
    report = yield
    setattr(item, f"ws_report_{report.when}", report)
    return report


@pytest.fixture
def procs(request: pytest.FixtureRequest) -> Iterator[Procs]:
    with tempfile.TemporaryDirectory(prefix="ws-test-") as tmp:
        p = Procs(Path(tmp))
        try:
            yield p
        finally:
            p.kill_all()
            report = getattr(request.node, "ws_report_call", None)
            if report is not None and report.failed:
                # every worker's own account of a failure the test saw from outside (pytest shows
                # a failed test's captured teardown output)
                for i in range(len(p.procs)):
                    print(f"--- worker {i} ({p.procs[i][2].name}), exit {p.procs[i][0].returncode} ---\n{p.log(i)}")
