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
"""

from __future__ import annotations

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
                          cancelled: Callable[[], bool] | None = None) -> None:
        """Broadcast each slice from rank 0, keeping up to ``depth`` buckets in flight.

        ``before(i)`` runs before bucket i is issued (the publisher packs it there when it has
        no snapshot), ``after(i)`` once it completed. Raises TimeoutError when a bucket misses
        ``deadline(nbytes)``, RuntimeError when the backend fails; the group is then unusable.
        With ``cancelled``, waits run in short slices and :class:`Cancelled` is raised as soon
        as it returns True (a receiver whose publisher already moved to a new generation).
        """
        if self.state != ALIVE:
            raise RuntimeError(f"generation {self.generation} of {self.channel!r} was aborted")
        if self._pg is None:
            return
        pending: list[tuple[int, Any, Any, float]] = []

        def finish_one() -> None:
            i, work, entry, limit = pending.pop(0)
            try:
                self._wait(work, limit, cancelled)
            except BaseException as err:
                entry.fail(err)
                raise
            entry.complete()
            if after is not None:
                after(i)

        for i, tensor in enumerate(slices):
            if len(pending) >= depth:
                finish_one()
            if before is not None:
                before(i)
            nbytes = tensor.numel()
            entry = self._recorder.record(op, channel=self.channel, member=self.member, generation=self.generation,
                                          version=version, bucket=i, nbytes=nbytes).start()
            limit = deadline(nbytes)
            try:
                work = compat.broadcast(self._pg, tensor, 0, limit)
            except BaseException as err:
                entry.fail(err)
                raise
            pending.append((i, work, entry, time.monotonic() + limit))
        while pending:
            finish_one()

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
        self._recorder.record("abort", channel=self.channel, member=self.member, generation=self.generation,
                              error=reason).complete()
        if self._pg is not None:
            compat.abort(self._pg)
            self._pg = None
        self._store = None
