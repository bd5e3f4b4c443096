"""Test workers forked from a process that has already imported torch and weightsync.

A worker started as ``python -m tests.workers SPEC`` spends about 1.5-2 s of CPU importing torch
and weightsync before it does anything (measured on the 2-core CI machine), and the suite starts
a few hundred of them per pass. ``python -m tests.forkserver`` imports everything once and then
forks one child per request; each child is a worker like any other (its own session and process
group, its log as stdout and stderr, the environment and directory it was given), killed with -9
or frozen with SIGSTOP by pid as before. Only the import is shared.

The server is started by the test process (``tests/conftest.py``'s ``Procs``) and talks msgspec
JSON lines: requests on its stdin (``Fork``), answers on its stdout (``Forked`` with the child's
pid, ``Exited`` with its exit status as ``subprocess`` reports it). It has no threads, so a fork
copies no lock held by a thread that does not exist in the child. It exits when its stdin closes
(the test process ended); its children are killed by their tests, never by it.

Workers that need a different process image stay exec'd: an ``LD_PRELOAD`` shim, a network
namespace (``ip netns exec``), a replacement an orchestrator starts.
"""

from __future__ import annotations

import io
import os
import select
import signal
import sys
import traceback

import msgspec


class Fork(msgspec.Struct, tag=True):
    """Start a worker: ``python -m tests.workers argv[0]`` with this environment and directory."""

    id: int
    argv: list[str]
    env: dict[str, str]
    cwd: str
    log: str


class Forked(msgspec.Struct, tag=True):
    id: int
    pid: int


class Exited(msgspec.Struct, tag=True):
    pid: int
    returncode: int  # negative: killed by that signal (as subprocess reports it)


Answer = Forked | Exited


def _child(req: Fork, server_fds: tuple[int, ...], ready: int) -> int:
    """In the forked child: become the worker ``req`` describes and run it; its exit status.
    Closing ``ready`` tells the server the child has its session and its log."""
    os.setsid()
    log = os.open(req.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the server's stdin (its requests) is not the worker's
    os.dup2(log, 1)
    os.dup2(log, 2)
    for fd in (log, null, *server_fds, ready):
        if fd > 2:
            os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdin, never closed
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    os.chdir(req.cwd)
    os.environ.clear()
    os.environ.update(req.env)
    sys.argv = ["tests/workers.py", *req.argv]
    from tests import workers

    try:
        return workers.run(req.argv[0])
    except SystemExit as err:
        code = err.code
        if isinstance(code, str):
            print(code, file=sys.stderr)
            return 1
        return int(code or 0)
    except BaseException:  # the worker's own failure: printed, as an exec'd interpreter prints it
        traceback.print_exc()
        return 1


def serve() -> int:
    """Answer requests until stdin closes; in a forked child, the worker's exit status."""
    # what every worker imports, imported once here (the point of this process)
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    import weightsync  # noqa: F401
    import weightsync.transport.publisher  # noqa: F401
    import weightsync.transport.subscriber  # noqa: F401
    from tests import workers  # noqa: F401

    listen = sys.stdin.fileno()
    out = sys.stdout.buffer
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below through the fd
    signal.set_wakeup_fd(wake_w)
    decoder = msgspec.json.Decoder(Fork)
    encoder = msgspec.json.Encoder()
    pending = b""
    while True:
        ready, _, _ = select.select([listen, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        while True:  # every child that ended, in any order
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            out.write(encoder.encode(Exited(pid, os.waitstatus_to_exitcode(status))) + b"\n")
            out.flush()
        if listen not in ready:
            continue
        chunk = os.read(listen, 1 << 16)
        if not chunk:
            return 0  # the test process is gone
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            req = decoder.decode(line)
            out.flush()
            ready_r, ready_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(ready_r)
                return _child(req, (wake_r, wake_w), ready_w)
            # answered once the child has its own session and its log (as Popen returns once the
            # child exec'd): a test may signal its group or read its log at once
            os.close(ready_w)
            os.read(ready_r, 1)
            os.close(ready_r)
            out.write(encoder.encode(Forked(req.id, pid)) + b"\n")
            out.flush()


if __name__ == "__main__":
    sys.exit(serve())
