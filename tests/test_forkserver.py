"""The test workers' fork server (tests/forkserver.py): a forked worker is a process like an exec'd one."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import Forked, Procs, fork_server

pytestmark = pytest.mark.skipif(os.environ.get("WS_TEST_EXEC_WORKERS") == "1", reason="workers are exec'd in this run")


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_forked_worker_fails_runs_stops_and_dies_as_an_execd_one_does(procs: Procs, tmp_path: Path) -> None:
    bad = procs.spawn("no_such_role")
    assert isinstance(procs.procs[bad][0], Forked)
    with pytest.raises(AssertionError, match="exited 1"):
        await procs.result(bad, 30)
    assert "unknown role 'no_such_role'" in procs.log(bad)  # its stderr is its log

    silent = socket.create_server(("127.0.0.1", 0))  # listens, never answers: the worker waits in its join
    try:
        port = silent.getsockname()[1]
        w = procs.spawn("subscriber", channel="c", address=f"127.0.0.1:{port}", member="m", timeout=50, deadline=50)
        pid = procs.pid(w)
        assert os.getsid(pid) == pid  # a session and process group of its own: killpg reaches it alone
        server = fork_server()
        assert server is not None
        with open(f"/proc/{pid}/stat") as fh:
            assert int(fh.read().rsplit(")", 1)[1].split()[1]) == server.proc.pid  # forked, not exec'd by us
        with pytest.raises(subprocess.TimeoutExpired):
            procs.procs[w][0].wait(0.5)  # still running (its join waits up to 50 s)
        procs.signal(w, signal.SIGSTOP)
        deadline = time.monotonic() + 20
        while _state(pid) != "T":
            assert time.monotonic() < deadline, _state(pid)
            await asyncio.sleep(0.02)  # polling the kernel's view of the process, not synchronisation
        assert procs.procs[w][0].poll() is None  # stopped is not ended
        procs.signal(w, signal.SIGKILL)
        code = await asyncio.get_running_loop().run_in_executor(None, procs.procs[w][0].wait, 20)
        assert code == -signal.SIGKILL
    finally:
        silent.close()
