"""DedicatedGroup: one generation of a channel's data-plane process group.

Built standalone from a Store under a fresh prefix (``ws/<channel>/gen/<g>/pg``), never
through ``init_process_group``: the user's default group is untouched and any number of
channels can live in one process. Exactly one backend object, hence one communicator.

Lifecycle, and who calls what:

1. every member (the publisher is rank 0) calls :meth:`DedicatedGroup.build` in a worker
   thread; the backend's rendezvous runs there, bounded by ``timeout``;
2. the publisher calls :meth:`broadcast_buckets` with its slices, each subscriber with its
   receive slices, each bucket bounded by its own deadline;
3. on a membership change or a failure every member calls :meth:`abort`; a new generation is
   built under a new prefix. An aborted group is never used again.

Where torch can re-form a backend in place (2.14+, gloo), each member instead keeps one
:class:`Reconfigurable` backend for its whole membership, and a generation is entered with
:meth:`Reconfigurable.enter`: the publisher's ``Go`` carries a fresh uuid and every member's
handle, and the same backend is re-formed with them (tens of milliseconds, no new sockets to
the store). The generation's :class:`DedicatedGroup` then only borrows the backend.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from weightsync.pg import _torch_compat as compat
from weightsync.pg.recorder import FlightRecorder

ALIVE, ABORTED = "alive", "aborted"
WAIT_SLICE = 0.25


class Cancelled(RuntimeError):
    """A data-plane wait was given up because the generation it belongs to has ended."""


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"auto"`` -> ``"nccl"`` for CUDA devices with NCCL, else ``"gloo"``; validates names."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if backend == "auto":
        return "nccl" if device.type == "cuda" and compat.nccl_available() else "gloo"
    if backend == "nccl" and not compat.nccl_available():
        raise ValueError("backend='nccl' needs a CUDA device and a torch built with NCCL")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"backend='nccl' needs a CUDA device, got device={device}")
    if not compat.gloo_available():
        raise ValueError("this torch build has no gloo backend")
    return backend


def bucket_deadline(nbytes: int, floor: float, min_bandwidth: float) -> float:
    """Seconds allowed for one bucket: a floor plus its bytes at the slowest acceptable rate."""
    return floor + nbytes / min_bandwidth


class DedicatedGroup:
    """A standalone process group for one generation of one channel."""

    def __init__(self, pg: Any, *, channel: str, member: str, generation: int, rank: int, size: int,
                 backend: str, device: torch.device, recorder: FlightRecorder) -> None:
        self._pg = pg
        self.channel, self.member, self.generation = channel, member, generation
        self.rank, self.size, self.backend, self.device = rank, size, backend, device
        self._recorder = recorder
        self._store: Any = None
        self._borrowed = False  # the backend belongs to a Reconfigurable: never torn down here
        self.state = ALIVE

    @classmethod
    def build(cls, store: Any, *, channel: str, member: str, generation: int, rank: int, size: int,
              backend: str, device: torch.device, timeout: float, recorder: FlightRecorder,
              peers: Sequence[str] = (), max_ctas: int = 4) -> DedicatedGroup:
        """Rendezvous with the other ``size - 1`` members; blocks at most ``timeout`` seconds.

        ``store`` is a connection owned by the calling thread; it is cloned, never shared.
        """
        entry = recorder.record("rebuild", channel=channel, member=member, generation=generation,
                                peers=tuple(peers)).start()
        own = None
        try:
            if size == 1 and backend == "gloo":
                pg = None  # a publisher alone needs no communicator
            else:
                # the backend keeps using its store (rendezvous, lazily connected pairs) from
                # its own threads: it gets a connection of its own, never one we wait on
                own = compat.clone_store(store, timeout)
                prefixed = compat.prefix_store(f"ws/{channel}/gen/{generation}/pg", own)
                if backend == "nccl":
                    pg = compat.make_nccl(prefixed, rank, size, timeout, device, max_ctas)
                else:
                    pg = compat.make_gloo(prefixed, rank, size, timeout)
        except Exception as err:
            entry.fail(err)
            raise
        entry.complete()
        group = cls(pg, channel=channel, member=member, generation=generation, rank=rank, size=size,
                    backend=backend, device=device, recorder=recorder)
        group._store = own
        return group

    def broadcast_buckets(self, slices: Sequence[torch.Tensor], *, version: int, deadline: Callable[[int], float],
                          op: str, before: Callable[[int], None] | None = None,
                          after: Callable[[int], None] | None = None, depth: int = 2,
                          cancelled: Callable[[], bool] | None = None) -> float:
        """Broadcast each slice from rank 0, keeping up to ``depth`` buckets in flight.

        ``before(i)`` runs before bucket i is issued (the publisher packs it there when it has
        no snapshot), ``after(i)`` once it completed. Raises TimeoutError when a bucket misses
        ``deadline(nbytes)``, RuntimeError when the backend fails; the group is then unusable.
        With ``cancelled``, waits run in short slices and :class:`Cancelled` is raised as soon
        as it returns True (a receiver whose publisher already moved to a new generation).
        Returns the seconds spent waiting on the collective (the rest was this member's own).
        """
        if self.state != ALIVE:
            raise RuntimeError(f"generation {self.generation} of {self.channel!r} was aborted")
        if self._pg is None:
            return 0.0
        pending: list[tuple[int, Any, Any, float]] = []  # (bucket, work, recorder entry, deadline)
        waited = [0.0]
        try:
            for i, tensor in enumerate(slices):
                if len(pending) >= depth:
                    self._finish_oldest(pending, cancelled, after, waited)
                if before is not None:
                    before(i)
                limit = deadline(tensor.numel())
                entry = self._recorder.record(op, channel=self.channel, member=self.member,
                                              generation=self.generation, version=version, bucket=i,
                                              nbytes=tensor.numel()).start()
                pending.append((i, None, entry, time.monotonic() + limit))
                work = compat.broadcast(self._pg, tensor, 0, limit)
                pending[-1] = (i, work, entry, time.monotonic() + limit)
            while pending:
                self._finish_oldest(pending, cancelled, after, waited)
        except BaseException as err:
            for _, _, entry, _ in pending:  # buckets still in flight will never complete
                entry.fail(f"abandoned: {err}", aborted=True)
            raise
        return waited[0]

    def _finish_oldest(self, pending: list[tuple[int, Any, Any, float]], cancelled: Callable[[], bool] | None,
                       after: Callable[[int], None] | None, waited: list[float]) -> None:
        i, work, entry, limit = pending.pop(0)
        t0 = time.monotonic()
        try:
            self._wait(work, limit, cancelled)
        except BaseException as err:
            entry.fail(err)
            raise
        finally:
            waited[0] += time.monotonic() - t0
        entry.complete()
        if after is not None:
            after(i)

    @staticmethod
    def _wait(work: Any, limit: float, cancelled: Callable[[], bool] | None) -> None:
        if cancelled is None:
            compat.wait_work(work, max(limit - time.monotonic(), 0.001))
            return
        while True:
            left = limit - time.monotonic()
            try:
                compat.wait_work(work, max(min(left, WAIT_SLICE), 0.001))
                return
            except TimeoutError:
                if left <= WAIT_SLICE:
                    raise
            if cancelled():
                raise Cancelled("the publisher moved on to a new generation")

    def abort(self, reason: str = "") -> None:
        """End this generation; safe to call twice and from error paths."""
        if self.state == ABORTED:
            return
        self.state = ABORTED
        entry = self._recorder.record("abort", channel=self.channel, member=self.member, generation=self.generation,
                                      error=reason).start()
        pg, self._pg, store, self._store = self._pg, None, self._store, None
        if pg is None or self._borrowed:
            entry.complete()  # a borrowed backend is re-formed by the next reconfigure
        else:
            _reaper.retire(pg, store, entry)


def reconfigure_enabled(backend: str) -> bool:
    """True when generations re-form one backend in place (gloo on torch 2.14+).

    ``WEIGHTSYNC_RECONFIGURE=0`` forces the rebuild path (a fresh group per generation).
    NCCL always rebuilds: nccl2's in-place reconfigure is not verified on a GPU yet.
    """
    if os.environ.get("WEIGHTSYNC_RECONFIGURE", "1") == "0":
        return False
    return backend == "gloo" and compat.gloo_options_reconfigurable()


class Reconfigurable:
    """One member's gloo backend for its whole membership, re-formed in place every generation."""

    def __init__(self, store: Any, *, channel: str, member: str, slot: int, timeout: float,
                 recorder: FlightRecorder) -> None:
        self.channel, self.member, self.slot = channel, member, slot
        self._recorder = recorder
        self._store = compat.clone_store(store, timeout)
        # every member's backend shares this prefix: the rendezvous keys live under the uuid
        self._pg = compat.make_gloo_reconfigurable(compat.prefix_store(f"ws/{channel}/rc", self._store), slot,
                                                   timeout)

    def handle(self) -> str:
        return compat.reconfigure_handle(self._pg)

    def enter(self, *, generation: int, uuid: int, handles: Sequence[str], rank: int, peers: Sequence[str],
              timeout: float, device: torch.device) -> DedicatedGroup:
        """Re-form the backend with ``handles`` (rank = position) as generation ``generation``."""
        entry = self._recorder.record("reconfigure", channel=self.channel, member=self.member,
                                      generation=generation, peers=tuple(peers)).start()
        try:
            compat.reconfigure(self._pg, uuid, handles, timeout)
        except Exception as err:
            entry.fail(err)
            raise
        entry.complete()
        group = DedicatedGroup(self._pg, channel=self.channel, member=self.member, generation=generation, rank=rank,
                               size=len(handles), backend="gloo", device=device, recorder=self._recorder)
        group._borrowed = True
        return group

    def close(self) -> None:
        """Tear the backend down (off this thread); the object is not used again."""
        if self._pg is None:
            return
        entry = self._recorder.record("abort", channel=self.channel, member=self.member, error="closed").start()
        pg, self._pg, store, self._store = self._pg, None, self._store, None
        _reaper.retire(pg, store, entry)


class _Reaper:
    """Aborts retired backends off the caller's thread.

    Measured on torch 2.13: gloo's ``abort()`` of a group whose peer is frozen (SIGSTOP)
    blocked 6.8 s, long enough for that member to miss the next generation's rendezvous.
    Nothing is sent on a retired group again (the publisher abandoned it first), so tearing it
    down can wait; the recorder entry completes when it is really gone.
    """

    IDLE_EXIT = 30.0

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, Any, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._busy = False
        self._idle = threading.Condition()

    def retire(self, pg: Any, store: Any, entry: Any) -> None:
        self._queue.put((pg, store, entry))
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ws-group-reaper", daemon=True)
                self._thread.start()

    def drain(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until every retired backend is torn down.

        Called by ``aclose``: a backend still being torn down when the interpreter exits
        takes the process down with it (``terminate called without an active exception``).
        """
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                thread = self._thread
                busy = thread is not None and (not self._queue.empty() or self._busy)
            if not busy:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._idle:
                self._idle.wait(min(left, 0.5))

    def _run(self) -> None:
        while True:
            try:
                pg, store, entry = self._queue.get(timeout=self.IDLE_EXIT)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            self._busy = True
            compat.abort(pg)
            del pg, store  # the backend's destructor runs here, not on a weightsync thread
            entry.complete()
            with self._idle:
                self._busy = self._queue.qsize() > 0
                self._idle.notify_all()


_reaper = _Reaper()


def drain_retired(timeout: float) -> bool:
    """Wait until retired groups are torn down (see :class:`_Reaper`); False on timeout."""
    return _reaper.drain(timeout)
