"""Publisher staging: latest wins, in at most ``max_snapshots`` buffers; how snapshots are taken.

Three roles a put can hold, and the buffers they pin::

    pending    taken, not yet sent           (a newer put supersedes it and reuses its buffer)
    in_flight  being sent by the sender thread
    retained   the newest version sent; re-sent to newcomers and after a failed generation

The sender moves pending -> in_flight -> retained; starting to send a newer version frees the
previous retained buffer, so at most two buffers exist however many puts come and however slow the
subscribers are. ``copy=False`` puts pin no buffer (they borrow the caller's tensors) and are not retained.

With deltas (``keep_base``) the retained buffer is kept while the next version is in flight, as
``base``: the version a delta is relative to. It is freed once that version is retained (or
becomes retained again if it failed), so at most three buffers exist: pending, in flight, base.

Same-host members read a snapshot in place (``planes.shm``): a buffer whose version such a
member still reads (``held``, the Sender's word: the version each one acknowledged last) is
*parked* when staging lets go of it, never written again while held, and reused once nobody
holds it. Parking is bounded: past ``max_snapshots + 2`` buffers (one more with ``keep_base``),
the oldest parked buffer is taken back and its holders are named to ``overdue`` (the Sender
evicts them, as a frozen reader is), so latest-wins never waits for a reader and memory never
grows with a slow one.

Thread-safety: every method takes the lock; the snapshot copy itself runs outside it, into a
buffer the staging handed out and nobody else can see until :meth:`commit`.

Also here: :func:`cuda_snapshot` (the stream-ordered device copy behind ``put`` on CUDA) and
:func:`bucket_slices` (what the sender broadcasts: snapshot slices, or two bucket buffers that a
``copy=False`` send packs into in turn).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync._errors import LocalFailure
from weightsync._wire import Manifest
from weightsync.engine.handles import DeliveryReport, PutHandle
from weightsync.format import layout


class Progress:
    """How far a snapshot's copy has come: the version is sent while it is being taken.

    ``put`` commits the version before copying it and advances this after each tensor; the
    sender sends bucket i to the group only once its bytes are in (``wait``), and same-host
    members read the same count from the segment's header (``mark``). A failed copy fails it:
    whoever waits gives the version up.
    """

    def __init__(self, total: int, mark: Callable[[int], None] = lambda _n: None) -> None:
        self.total = total
        self.done = 0
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._mark = mark

    def advance(self, done: int) -> None:
        with self._cond:
            self.done = done
            self._cond.notify_all()
        self._mark(done)

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self.error = error
            self._cond.notify_all()
        self._mark(-1)

    def wait(self, nbytes: int, timeout: float) -> None:
        """Until the first ``nbytes`` are copied; LocalFailure if the copy failed or stalled."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.done < nbytes and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LocalFailure(f"the snapshot did not reach byte {nbytes} within {timeout:.3g}s")
                self._cond.wait(left)
            if self.error is not None:
                raise LocalFailure(f"the snapshot failed: {self.error}")


def pack_progressively(flat: torch.Tensor, manifest: Manifest, items: list[tuple[str, torch.Tensor]],
                       progress: Progress, copy_ranges: Callable[[layout.Ranges], None] | None = None) -> None:
    """``layout.pack_into`` (its plain copies handed to ``copy_ranges``), telling ``progress`` after
    each tensor (and failing it on an error)."""
    if not manifest.tensors:  # a rank with nothing of its own to send (an HSDP replica): complete at once
        progress.advance(manifest.total_bytes)
        return
    try:
        for spec, item, end in zip(manifest.tensors, items, [*(t.offset for t in manifest.tensors[1:]),
                                                               manifest.total_bytes], strict=True):
            layout.pack_into(flat, Manifest(tensors=(spec,), total_bytes=end), [item], copy_ranges)
            progress.advance(end)
    except BaseException as err:
        progress.fail(err)
        raise


class Spills:
    """The buffer ``released(spill=True)`` copies into, kept for the next spill (any thread).

    A spill is on the trainer's critical path: its copy is all the stall there is. Into fresh
    memory every page faults on first touch, and that, not the copy, was most of the stall (300
    MiB on one thread of a 2-core EPYC: 188-217 ms fresh, 34-42 ms into a buffer written before).
    So the last spill's buffer is kept while the publisher runs (one, at most the size of the
    largest spill so far) and reused by the next one that fits; ``clear`` lets it go."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: torch.Tensor | None = None

    def take(self, nbytes: int, device: torch.device | None) -> torch.Tensor:
        """A buffer of at least ``nbytes``, its first ``nbytes`` returned: the kept one if it fits."""
        want = torch.device(device or "cpu")
        with self._lock:
            buf, self._kept = self._kept, None  # taken: nothing else spills into it until given back
        fits = buf is not None and buf.numel() >= nbytes and buf.device.type == want.type and (
            want.index is None or buf.device.index == want.index)
        if buf is None or not fits:
            del buf  # a smaller one goes before the new one is made: never two kept at once
            return torch.empty(nbytes, dtype=torch.uint8, device=want)
        return buf[:nbytes]

    def give(self, view: torch.Tensor) -> None:
        """``view`` (from ``take``) is not read any more: its buffer is kept, the larger of two."""
        buf = view._base if view._base is not None else view  # noqa: SLF001
        with self._lock:
            if self._kept is None or self._kept.numel() < buf.numel():
                self._kept = buf

    def clear(self) -> None:
        with self._lock:
            self._kept = None


@dataclass(eq=False)
class Job:
    """One put on its way to the subscribers."""

    version: int
    manifest: Manifest
    handle: PutHandle
    flat: torch.Tensor | None = None  # the snapshot (copy=True)
    items: list[tuple[str, torch.Tensor]] | None = None  # borrowed tensors (copy=False)
    ready: Any = None  # a CUDA event the snapshot completes on, or None
    progress: Progress | None = None  # a host snapshot still being taken (see Progress)
    assembly: Any = None  # a sharded put: this rank's lane of the full version (``_wire.Assembly``)
    resends: int = 0
    started: float = 0.0  # monotonic time of the first send attempt
    members_done: set[str] = field(default_factory=set)
    encoding: str = ""  # put(encoding=): this version's, else the publisher's
    digests: tuple[int, ...] = ()  # its staged buckets' checksums, once sent with them (a delta's base names them)
    # per member reached: the encoding it got, and the bytes sent to it (the last attempt that reached it)
    forms: dict[str, tuple[str, int]] = field(default_factory=dict)
    base: int = -1  # the version its deltas were against
    committed_at: float = 0.0  # activation "all": time.time() when the publisher committed it
    exposure_spread: float = 0.0  # seconds between the first and the last member's word that it is readable
    encode_seconds: float = 0.0  # making them (every attempt)
    # copy=False: set by the sender thread once the caller's tensors are packed for the last
    # time; the sender reads it (never the asyncio future) to decide whether it may re-send
    released: threading.Event = field(default_factory=threading.Event)
    # copy=False, ``released(spill=True)``: the caller wants its tensors back before the transfer is
    # done. What is not packed yet is copied at once into ``spill`` and the tensors are released;
    # later buckets are packed from that copy. ``spill`` holds the version's bytes from
    # ``spill_base``, of which those from ``spill_at`` are copied: a spill ahead (``spill_ahead``)
    # copies from the end down to byte 0 while the sender packs from the start up
    device: torch.device | None = None  # where the buckets are packed
    spill: torch.Tensor | None = None
    spill_at: int = 0
    spill_base: int = 0
    spills: Spills | None = None  # where spill_rest takes its buffer from and gives it back to
    _spilled: torch.Tensor | None = None  # the spill drawn from ``spills`` (not a kept delta base)
    packed: int = 0  # the bytes packed from the caller's tensors so far
    pack_lock: threading.Lock = field(default_factory=threading.Lock)  # packing, and spilling, one at a time
    # a spill ahead lets anyone else waiting for ``pack_lock`` have it first (a lock is not fair: the
    # spill thread, taking it again at once, starved the sender's packing and released(spill=True))
    _waiting: int = 0
    _turns: threading.Condition = field(default_factory=threading.Condition)
    _ahead: bool = False  # a spill ahead is running (under ``_turns``)
    _cut: bool = False  # released(spill=True) asked it to finish at its next chunk (under ``_turns``)

    def __post_init__(self) -> None:
        # the handle's released(spill=True), weakly: the Job holds the handle (no cycle to collect)
        self.handle._spill = weakref.WeakMethod(self.spill_rest)  # noqa: SLF001

    def wait_ready(self, device: torch.device) -> None:
        """Before the sender reads it: a device snapshot's copy ordered before the sender's stream
        (``device``: the bucket buffers'), and finished where gloo reads it from host memory."""
        if self.ready is None:
            return
        torch.cuda.current_stream(device if device.type == "cuda" else None).wait_event(self.ready)
        if device.type != "cuda":
            self.ready.synchronize()  # gloo reads host memory: the device->host copy must be done

    def release(self) -> None:
        """Sender thread: the caller may change its tensors again (resolves ``handle.released``)."""
        self.released.set()
        self.handle.release_threadsafe()

    def _open_spill(self, whole: bool = False) -> bool:
        """Under ``pack_lock``: a spill buffer for everything not packed yet (``whole``: for the
        whole version), nothing copied into it yet; False when there is nothing to spill
        (released, or a spill already open)."""
        if self.released.is_set() or self.spill is not None or self.items is None:
            return False
        end, base = self.manifest.total_bytes, 0 if whole else self.packed
        spill = (self.spills or Spills()).take(end - base, self.device)
        self.spill, self.spill_base, self.spill_at, self._spilled = spill, base, end, spill
        return True

    def _spill_down_to(self, lo: int) -> None:
        """Under ``pack_lock``, a spill open: copy the bytes ``[lo, spill_at)`` into it."""
        assert self.spill is not None and self.items is not None
        if lo < self.spill_at:
            out = self.spill[lo - self.spill_base : self.spill_at - self.spill_base]
            layout.pack_range(out, lo, self.spill_at, self.manifest, self.items)
            self.spill_at = lo

    @contextmanager
    def _turn(self) -> Iterator[None]:
        """``pack_lock`` for the sender or a caller, ahead of a spill thread's next chunk."""
        with self._turns:
            self._waiting += 1
        self.pack_lock.acquire()
        try:
            with self._turns:
                self._waiting -= 1
                self._turns.notify_all()
            yield
        finally:
            self.pack_lock.release()

    def whole_spill(self) -> bool:
        """Whether every byte of the version is in the spill (a spill ahead that finished): it can
        be sent again from there, its tensors released or not."""
        return self.spill is not None and self.spill_base == 0 and self.spill_at == 0

    def spill_rest(self) -> None:
        """Any thread (``handle.released(spill=True)``): copy what is not packed yet (nor spilled
        ahead) out of the caller's tensors, then release them. Nothing when they were released
        already. While a spill ahead runs, it is told to do this at its next chunk instead (the
        caller then waits for that chunk, not for a lock the sender may hold)."""
        with self._turns:
            if self._ahead:
                self._cut = True
                return
        with self._turn():
            if self.released.is_set() or self.items is None:
                return
            if self.spill is None:
                self._open_spill()
            self._spill_down_to(self.packed)
            self.release()

    def spill_ahead(self, chunk: int) -> None:
        """The spill thread (``Publisher(spill_ahead=True)``), right after a copy=False put: copy
        the whole version into a spill from its end down, ``chunk`` bytes at a time, while the
        sender packs it from the start (bytes it reaches first it packs from the tensors), then
        release the tensors: the caller waits for no copy, and the version can still be sent
        again, from the spill, if a member fails. ``released(spill=True)`` before the copy ends
        has it copy only what neither side took yet, and release (then a re-send of the earlier
        bytes is not possible, as for any spill). Stops once the tensors are released or the
        version is done with (sent, superseded, failed)."""
        with self.pack_lock:
            if self.handle.resolved() or not self._open_spill(whole=True):
                return
            spill = self.spill
            with self._turns:
                self._ahead = True
                self._turns.notify_all()
        try:
            while True:
                with self._turns:  # the sender's packing, or the caller's released(spill=True), first
                    self._turns.wait_for(lambda: self._waiting == 0, timeout=0.1)
                with self.pack_lock:
                    if self.spill is not spill or self.released.is_set() or self.handle.resolved():
                        return  # done with, or failed
                    if self._cut:  # released(spill=True): what neither side took yet, then let go
                        self._spill_down_to(self.packed)
                        self.release()
                        return
                    self._spill_down_to(max(0, self.spill_at - chunk))
                    if self.spill_at == 0:
                        self.release()
                        return
        finally:
            with self._turns:
                self._ahead = False
                cut = self._cut and not self.released.is_set()
            if cut:  # asked while this thread was leaving without releasing: done here
                self.spill_rest()

    def drop_spill(self) -> None:
        """The version is done with (``Staging.finish``): its spill goes back for the next one."""
        with self._turn():
            spilled, self._spilled, self.spill = self._spilled, None, None
            if spilled is not None and self.spills is not None:
                self.spills.give(spilled)

    def pack(self, out: torch.Tensor, lo: int, hi: int) -> None:
        """Sender thread: bytes ``[lo, hi)`` of a copy=False version into ``out``, from the caller's
        tensors, or from the spilled copy once they were let go."""
        spilled: torch.Tensor | None = None
        with self._turn():
            if self.spill is not None and lo >= self.spill_at:
                spilled = self.spill[lo - self.spill_base : hi - self.spill_base]
            else:
                if self.released.is_set():  # a re-send raced a spill: those bytes are the caller's again
                    raise LocalFailure(f"version {self.version}: its tensors were released (spilled from byte "
                                       f"{self.spill_at}); bytes {lo}-{hi} can no longer be sent")
                assert self.items is not None
                layout.pack_range(out, lo, hi, self.manifest, self.items)
                self.packed = hi
            if hi >= self.manifest.total_bytes and not self.released.is_set():
                self.release()  # the last bucket (a spill stays until the version is done: ``drop_spill``)
        if spilled is not None:  # outside the lock: spilled bytes never change, and the spill stays
            out[: hi - lo].copy_(spilled)  # until the version is done with, so nobody waits for this copy


Allocate = Callable[[int, torch.device, bool], torch.Tensor]


def _empty(nbytes: int, device: torch.device, pin: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)


class Staging:
    """Args: ``allocate(nbytes, device, pin)`` makes a buffer (shared memory on a CPU publisher);
    ``drop(buf)`` is told of every buffer staging lets go of, ``reuse(buf)`` of every buffer it
    hands out again, before anything writes it."""

    def __init__(self, max_snapshots: int = 2, allocate: Allocate = _empty,
                 drop: Callable[[torch.Tensor], None] = lambda _b: None,
                 reuse: Callable[[torch.Tensor], None] = lambda _b: None, keep_base: bool = False) -> None:
        if max_snapshots < 2:
            raise ValueError(f"max_snapshots must be >= 2 (one in flight, one pending), got {max_snapshots}")
        self.max_snapshots, self.lock = max_snapshots, threading.Condition()
        self.pending: Job | None = None
        self.in_flight: Job | None = None
        self.retained: Job | None = None
        self.keep_base = keep_base
        self.base: Job | None = None  # keep_base: the retained version while the next one is in flight
        self.published: tuple[int, Manifest] | None = None  # the newest version taken: number, full layout
        self._free: list[torch.Tensor] = []
        self.parked: list[Job] = []  # let go of, but a same-host member still reads it in place
        self.peak_buffers = 0
        self.spills = Spills()  # copy=False versions' spills (private memory: members never read them)
        self._allocate, self._drop, self._reuse = allocate, drop, reuse
        # set by the Publisher once its Sender exists (any thread may call them, under this lock):
        # the versions same-host members read in place now, and whom to evict for one taken back
        self.held: Callable[[], frozenset[int]] = frozenset
        self.overdue: Callable[[int], None] = lambda _v: None

    def buffers_in_use(self) -> int:
        return self._pinned() + len(self._free)

    def _pinned(self) -> int:
        """The buffers a version holds: pending, in flight, retained, base, parked."""
        jobs = {id(j): j for j in (self.pending, self.in_flight, self.retained, self.base) if j is not None}
        return sum(1 for j in jobs.values() if j.flat is not None) + len(self.parked)

    def _room(self) -> int:
        """Under the lock: how many spare buffers fit beside the pinned ones within
        ``max_snapshots`` (one more with ``keep_base``)."""
        return self.max_snapshots + (1 if self.keep_base else 0) - self._pinned()

    def limit(self) -> int:
        """The most buffers staging holds at once, parked ones included: two parked at most (the
        version same-host members read, and the older one a reader of theirs still holds)."""
        return self.max_snapshots + 2 + (1 if self.keep_base else 0)

    def _unpark(self) -> list[torch.Tensor]:
        """Under the lock: the parked buffers nobody reads any more, no longer parked."""
        if not self.parked:
            return []
        held = self.held()
        free = [j for j in self.parked if j.version not in held]
        self.parked = [j for j in self.parked if j.version in held]
        bufs = [j.flat for j in free if j.flat is not None]
        for job in free:
            job.flat = None
        return bufs

    def acquire(self, nbytes: int, device: torch.device, pin: bool) -> tuple[torch.Tensor, Job | None]:
        """A buffer of at least ``nbytes`` for a new snapshot, and the pending job it displaced.

        The displaced job (if any) is no longer pending; the caller resolves its handle as
        superseded once the new snapshot is committed.
        """
        with self.lock:
            displaced, self.pending = self.pending, None
            candidates = list(self._free) + self._unpark()
            if displaced is not None and displaced.flat is not None:
                candidates.insert(0, displaced.flat)
            self._free = []
            buf = next((b for b in candidates if b.numel() >= nbytes and b.device == device), None)
            # what we do not reuse stays spare while, with the buffer handed out, no more than
            # max_snapshots exist (a put after copy=False ones, which pin none, finds both again:
            # a new buffer costs its page faults in put); while same-host members read in place,
            # one stays spare within the wider bound: a buffer parked again soon needs another
            others = sorted((b for b in candidates if b is not buf),  # those that fit kept first
                            key=lambda b: not (b.numel() >= nbytes and b.device == device))
            spare = sum(1 for b in others[:max(self._room() - 1, 0)] if b.numel() >= nbytes and b.device == device)
            if self.held() and self.buffers_in_use() + 2 <= self.limit():
                spare = max(spare, 1)
            self._free, others = others[:spare], others[spare:]
            for other in others:
                self._drop(other)
            if buf is None and self.parked and self.buffers_in_use() + 1 > self.limit():
                buf = self._take_back(nbytes, device)
            if buf is None:
                buf = self._allocate(nbytes, device, pin)
            else:
                self._reuse(buf)
            self.peak_buffers = max(self.peak_buffers, self.buffers_in_use() + 1)
            return buf, displaced

    def _take_back(self, nbytes: int, device: torch.device) -> torch.Tensor | None:
        """Under the lock, over the bound: the oldest parked buffer, its holders named to ``overdue``
        (they are evicted; the epoch bumped by ``reuse`` stops any read of it still under way)."""
        oldest = self.parked.pop(0)
        buf, oldest.flat = oldest.flat, None
        self.overdue(oldest.version)
        if buf is not None and buf.numel() >= nbytes and buf.device == device:
            return buf
        if buf is not None:
            self._drop(buf)
        return None

    def give_back(self, buf: torch.Tensor) -> None:
        with self.lock:
            self._free.append(buf)

    def commit(self, job: Job) -> Job | None:
        """Make ``job`` the pending one; returns a pending job it displaced (copy=False puts)."""
        with self.lock:
            displaced, self.pending = self.pending, job
            self.lock.notify_all()
            return displaced

    def take(self) -> Job | None:
        """Sender: the pending job becomes in flight; the older retained buffer is freed."""
        with self.lock:
            job, self.pending = self.pending, None
            if job is None:
                return None
            self.in_flight = job
            self.published = (job.version, job.manifest if job.assembly is None else job.assembly.manifest)
            old, self.retained = self.retained, None
            if self.keep_base and old is not None and old.flat is not None:
                earlier, self.base = self.base, old  # a delta of the job is against it: kept until the job is done
                self._let_go(earlier)
            else:
                self._let_go(old)
            return job

    def _let_go(self, job: Job | None) -> None:
        """Under the lock: ``job``'s buffer becomes the one spare (the next put reuses it)."""
        if job is not None and job.flat is not None and all(
                job is not other for other in (self.pending, self.in_flight, self.retained)):
            if job.version in self.held():  # a same-host member reads it in place: not written while it does
                if all(job is not other for other in self.parked):
                    self.parked.append(job)
                return
            self._free.append(job.flat)
            keep = max(1, self._room())  # the newest spare always; more while no more than max_snapshots exist
            for other in self._free[:-keep]:
                self._drop(other)
            self._free = self._free[-keep:]

    def finish(self, job: Job, retain: bool = True) -> None:
        """Sender: the in-flight job is done; a snapshot stays retained for newcomers (unless it failed)."""
        if job.flat is None:
            job.drop_spill()  # copy=False: a spill is not sent again past here
        with self.lock:
            if self.in_flight is job:
                self.in_flight = None
            if job is self.retained:
                return  # the retained version sent again (to newcomers): it stays retained
            base, self.base = self.base, None
            if job.flat is not None and retain:
                self.retained = job
                self._let_go(base)
            elif job.flat is not None:
                self.retained = base  # still what the members hold (None without keep_base): the next base
                self._let_go(job)
            else:  # copy=False: the members now hold bytes no buffer keeps
                self._let_go(base)

    def clear(self) -> None:
        """Close: let go of every buffer (their memory, shared or not, goes with the last view)."""
        with self.lock:
            for job in (self.pending, self.in_flight, self.retained, self.base):
                if job is not None:
                    job.flat = None
            for buf in self._free + [j.flat for j in self.parked if j.flat is not None]:
                self._drop(buf)
            for job in self.parked:
                job.flat = None
            self.pending = self.in_flight = self.retained = self.base = None
            self._free, self.parked = [], []
        self.spills.clear()

    def drain(self) -> list[Job]:
        """Close: every job not yet sent (not the one in flight), removed from staging."""
        with self.lock:
            jobs = [j for j in (self.pending,) if j is not None]
            self.pending = None
            self.lock.notify_all()
            return jobs


def cuda_snapshot(flat: torch.Tensor, manifest: Manifest, items: list[tuple[str, torch.Tensor]],
                  stream: Any) -> Any:
    """Enqueue the snapshot copies on ``stream``, ordered after the caller's work; no host sync.

    Returns the CUDA event the snapshot completes on; the sender waits on it (stream-ordered
    for NCCL, on the host for gloo) before the first bucket goes out.
    """
    device = next(t.device for _, t in items if t.is_cuda)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        layout.pack_into(flat, manifest, items)
    for _, tensor in items:
        if tensor.is_cuda:
            tensor.record_stream(stream)  # the caller may free it; the copy still reads it
    event = torch.cuda.Event()
    event.record(stream)
    return event


class BucketBuffers:
    """The two bucket buffers a ``copy=False`` send packs into, in turn (kept between sends).

    With ``allocate`` and ``drop`` (a CPU publisher's shared-memory pool) both live in one
    segment, back to back: same-host members copy each bucket out of it as it is packed (the
    ring), so a ``copy=False`` version costs two buckets whoever receives it.
    """

    def __init__(self, device: torch.device, allocate: Callable[..., torch.Tensor] | None = None,
                 drop: Callable[[torch.Tensor], None] | None = None) -> None:
        self.device = device
        self._allocate, self._drop = allocate, drop
        self._bufs: list[torch.Tensor] = []
        self._whole: torch.Tensor | None = None

    def get(self, size: int) -> list[torch.Tensor]:
        if not self._bufs or self._bufs[0].numel() < size:
            if self._allocate is not None and self.device.type == "cpu":
                if self._whole is not None and self._drop is not None:
                    self._drop(self._whole)
                self._whole = self._allocate(2 * size, self.device, False)
                self._bufs = [self._whole[:size], self._whole[size:2 * size]]
            else:
                self._bufs = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        return self._bufs


def bucket_slices(job: Job, ranges: list[tuple[int, int]], buffers: BucketBuffers, bucket_bytes: int,
                  deadline: Callable[[int], float]) -> tuple[list[torch.Tensor], Callable[[int], None] | None]:
    """What the sender broadcasts for ``job``, and what to run before each bucket.

    With a snapshot: slices of it, and nothing to run, or, while a pipelined snapshot is still
    being taken, a wait (bounded by ``deadline(nbytes)``) until bucket i's bytes are in. With
    ``copy=False``: two bucket buffers taking turns, bucket i+1 packed while bucket i is on the
    wire; the caller's tensors are released once the last bucket is packed.
    """
    if job.flat is not None:
        slices = [job.flat[lo:hi] for lo, hi in ranges]
        progress = job.progress
        if progress is None or progress.done >= progress.total:
            return slices, None

        def copied(i: int) -> None:
            lo, hi = ranges[i]
            progress.wait(hi, deadline(hi - lo))

        return slices, copied
    bufs = buffers.get(min(bucket_bytes, job.manifest.total_bytes))
    assert job.items is not None or job.spill is not None

    def pack(i: int) -> None:  # the same buffers whatever the source (same-host rings read them)
        lo, hi = ranges[i]
        job.pack(bufs[i % 2], lo, hi)

    return [bufs[i % 2][: hi - lo] for i, (lo, hi) in enumerate(ranges)], pack


def superseded_report(job: Job) -> DeliveryReport:
    return DeliveryReport(version=job.version, members=(), nbytes=0, seconds=0.0, superseded=True)
