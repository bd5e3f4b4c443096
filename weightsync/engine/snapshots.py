"""The put path's copy: a version's tensors into staging, then handed to the sender.

``put(copy=True)`` copies the caller's tensors into a staging buffer (:mod:`staging`): on CUDA a
stream-ordered device copy (the host does not wait), on the host a copy on this end's snapshot
thread, which with enough cores is pipelined with the send (the version is committed first and
bucket i goes out as soon as its bytes are in). ``put(copy=False)`` stages nothing: the sender
reads the caller's tensors until the handle's ``released()``. Either way the version is then
committed, which may displace a pending one (its handle resolves as superseded).

Threads: ``ws-<channel>-snapshot`` (one), also lent to the control server's start. It copies a
host snapshot's plain tensors with ``memmove`` (the copy glibc's non-temporal threshold applies
to: docs/api.md): with one torch thread all of them, pipelined or not; with more, its share
beside ``ws-<channel>-copy`` (:class:`Copier`: up to three, started with the first host
snapshot), except pipelined, where torch's copy splits each tensor between torch's threads.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from weightsync import _wire, testing
from weightsync.engine.staging import Job, Progress, Staging, cuda_snapshot, pack_progressively, superseded_report
from weightsync.errors import WeightSyncError
from weightsync.format import layout
from weightsync.options import usable_cpus
from weightsync.planes.shm import plane as shm
from weightsync.statistics import PublisherTally

PIPELINE_CPUS = 4  # usable CPUs from which a host snapshot is sent while it is taken
SPILL_CHUNK = 4 << 20  # a spill ahead copies this much at a time: what a caller or the sender may wait for
log = logging.getLogger("weightsync.publisher")


def _spill_ahead(channel: str, job: Job) -> None:
    try:
        job.spill_ahead(SPILL_CHUNK)
    except Exception:  # the sender packs what was not spilled from the tensors, as without a spill
        log.exception("channel %r: version %d's spill ahead failed", channel, job.version)


def default_pipeline() -> bool:
    """Pipelined where this process may use at least PIPELINE_CPUS CPUs (its affinity, where the
    OS has one): with fewer, the send's copies compete with the snapshot's (docs/benchmarks.md).
    A test run may decide instead (``weightsync.testing.set_default_pipeline``)."""
    chosen = testing.default_pipeline()
    if chosen is not None:
        return chosen
    return usable_cpus() >= PIPELINE_CPUS


class Snapshots:
    """Takes each version's snapshot and commits it (see the module docstring).

    Args:
        channel: for thread names and errors.
        staging: the staging buffers (and the pending version the sender takes next).
        segments: the shared-memory pool staging lives in (same-host members), or None.
        slot_device: where staging lives (the publisher's device with NCCL, else the host).
        pipeline: send a host snapshot while it is taken.
        committed: tells the sender a version was committed (any thread).
        tally: counts superseded versions.
        spill_ahead: copy each copy=False version into a spill from its end, on a thread of its
            own (``ws-<channel>-spill``), while the sender sends it (``Job.spill_ahead``).
    """

    def __init__(self, channel: str, *, staging: Staging, segments: shm.SegmentPool | None,
                 slot_device: torch.device, pipeline: bool, committed: Callable[[int], None],
                 tally: PublisherTally, spill_ahead: bool = False) -> None:
        self.channel, self.pipeline, self.spill_ahead = channel, pipeline, spill_ahead
        self._spiller: ThreadPoolExecutor | None = None
        self._staging, self._segments, self._slot_device = staging, segments, slot_device
        self._committed, self._tally = committed, tally
        self.executor: ThreadPoolExecutor | None = None
        self._copy_stream: Any = None
        self._copy: Copier | None = None  # the snapshot's helper threads, made at the first host snapshot

    def open(self) -> ThreadPoolExecutor:
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"ws-{self.channel}-snapshot")
        return self.executor

    async def take(self, job: Job, items: list[tuple[str, torch.Tensor]], *, copy: bool, entry: Any) -> None:
        """Snapshot (``copy``) or hold ``items`` for ``job``, and commit it; returns once the
        snapshot is taken. A failed snapshot raises, and a version it displaced fails with it."""
        displaced: Job | None = None
        if copy:
            pin = self._slot_device.type == "cpu" and torch.cuda.is_available()
            buf, displaced = self._staging.acquire(job.manifest.total_bytes, self._slot_device, pin=pin)
            if self.pipeline and not any(t.is_cuda for _, t in items):
                return await self._pipelined(job, buf, displaced, items, entry)
            try:
                job.flat, job.ready = await self._snapshot(buf, job.manifest, items)
            except BaseException as err:
                self._staging.give_back(buf)
                self._fail_displaced(displaced, job.version, err)
                raise
        else:
            job.items, job.device, job.spills = items, self._slot_device, self._staging.spills
        displaced = self._staging.commit(job) or displaced
        self._committed(job.version)
        if not copy and self.spill_ahead:
            self._spill(job)
        self._done(entry, displaced)

    def _spill(self, job: Job) -> None:
        """Start ``job``'s spill ahead (one at a time: the next waits for this one to end)."""
        if self._spiller is None:
            self._spiller = ThreadPoolExecutor(1, thread_name_prefix=f"ws-{self.channel}-spill")
        self._spiller.submit(_spill_ahead, self.channel, job)

    def close(self) -> None:
        """The spill thread goes once it is idle (a spill ahead stops when its version is done with)."""
        if self._spiller is not None:
            self._spiller.shutdown(wait=False)
        if self._copy is not None:
            self._copy.close()

    async def _pipelined(self, job: Job, buf: torch.Tensor, displaced: Job | None,
                         items: list[tuple[str, torch.Tensor]], entry: Any) -> None:
        """A host snapshot, sent while it is taken: the version is committed first, and bucket i
        goes out (to the group, or to same-host members through the segment header) as soon as
        its bytes are copied. Returns, as every put, once the whole snapshot is taken."""
        flat = buf[: job.manifest.total_bytes]
        mark = self._segments.marker(flat) if self._segments is not None else (lambda _n: None)
        job.flat, job.progress = flat, Progress(job.manifest.total_bytes, mark)
        displaced = self._staging.commit(job) or displaced
        self._committed(job.version)
        try:
            # one torch thread: memmove, tensor by tensor (see the module docstring); more: torch's
            # copy, whose threads split each tensor (memmove threads stalled it 2x: docs/benchmarks.md)
            copy = _memmove_all if _copy_threads() == 1 else None
            await asyncio.get_running_loop().run_in_executor(self.executor, pack_progressively, flat, job.manifest,
                                                             items, job.progress, copy)
        except BaseException as err:
            # the sender gives the version up when its wait fails: the handle fails from there
            job.progress.fail(err)
            entry.fail(err)
            self._fail_displaced(displaced, job.version, err)
            raise
        self._done(entry, displaced)

    def _done(self, entry: Any, displaced: Job | None) -> None:
        entry.complete()
        if displaced is not None:
            self._tally.count("versions_superseded")
            displaced.handle.resolve_threadsafe(superseded_report(displaced))

    def _fail_displaced(self, displaced: Job | None, version: int, err: BaseException) -> None:
        if displaced is not None:  # its buffer may be half overwritten: it cannot go out
            displaced.handle.resolve_threadsafe(error=WeightSyncError(
                f"version {displaced.version} was displaced by version {version}, whose snapshot "
                f"failed: {err}", channel=self.channel, version=displaced.version))

    async def _snapshot(self, buf: torch.Tensor, manifest: _wire.Manifest,
                        items: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, Any]:
        flat = buf[: manifest.total_bytes]
        if any(t.is_cuda for _, t in items):
            device = next(t.device for _, t in items if t.is_cuda)
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(device)
            return flat, cuda_snapshot(flat, manifest, items, self._copy_stream)
        await asyncio.get_running_loop().run_in_executor(self.executor, layout.pack_into, flat, manifest, items,
                                                         self._copier().copy)
        return flat, None

    def _copier(self) -> Copier:
        if self._copy is None:
            self._copy = Copier(_copy_threads(), f"ws-{self.channel}-copy")
        return self._copy


def _copy_threads() -> int:
    """Threads that take a host snapshot: torch's intra-op count (what the user gave the process's
    copies), at most 4; one more than two rarely adds memory bandwidth on a host."""
    return max(1, min(torch.get_num_threads(), 4))


class Copier:
    """Copies address ranges with ``memmove`` on ``threads`` threads at once: the caller's and
    ``threads - 1`` helpers, each a run of (nearly) equal bytes (``layout.split_ranges``).

    One pass over the bytes at the memory's speed. torch's own copy splits each tensor between
    its threads and joins them again per tensor; for a state dict of many tensors of a few MiB
    that took 50 ms at 496 MiB where this takes 41 on 2 cores (docs/benchmarks.md). ``memmove``
    drops the GIL, so the helpers run while the caller copies its own run.
    """

    def __init__(self, threads: int, name: str) -> None:
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix=name) if threads > 1 else None

    def copy(self, ranges: layout.Ranges) -> None:
        if self._pool is None:
            _memmove_all(ranges)
            return
        runs = layout.split_ranges(ranges, self.threads)
        mine, helped = list(runs[0]), []
        for run in runs[1:]:
            try:
                helped.append(self._pool.submit(_memmove_all, run))
            except RuntimeError:  # shut down (the publisher closing while a put is taken): copied here
                mine += run
        try:
            _memmove_all(mine)
        finally:
            for future in helped:  # every run is done (or failed) before the snapshot counts as taken
                future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def _memmove_all(ranges: layout.Ranges) -> None:
    for dst, src, n in ranges:
        ctypes.memmove(dst, src, n)
