"""The same-host data path: snapshots in shared memory that same-host members copy from.

On a CPU publisher every staging buffer is a *segment*: an anonymous ``memfd`` (never a name
in ``/dev/shm``), mapped by the publisher read-write. A member on the same host opens it
read-only through ``/proc/<publisher pid>/fd/<fd>``, maps it, and copies each bucket into its
own receive slot; the bytes never cross a socket. The memory belongs to the kernel's count
of open descriptors and mappings, so nothing can leak: when the publisher drops a buffer (or
dies, even by ``kill -9``) and the members unmap it (or die), it is gone. There is no name to
unlink.

How a member knows it is on the same host: the publisher's first frame (``Challenge``) names
its *door*, a one-page segment holding a random token. A member that can open the door and
read that token is on the same host, in the same pid namespace, with the rights to map the
publisher's segments; it then joins with ``transport="shm"``. Every segment starts with its own
random token, checked at each mapping, so a descriptor number reused for another file is
never read as a snapshot.

What keeps it safe (the group path's guarantees, here):

- a version is readable only after its buckets match the publisher's per-bucket digests (the
  Seal), checked on the member's own copy, so a torn read of a buffer the publisher reused
  (a frozen member that resumed late) is caught, never published; with checksums off, each
  segment's *epoch* (bumped by the publisher before it writes a buffer again, read by the
  member before each bucket and after the last) catches the same;
- the publisher never waits for a member's mapping: buffers are reused by the staging rules
  alone (latest wins, at most ``max_snapshots``), and a member that does not acknowledge in
  time is evicted as on the group path;
- members map at most :data:`MAPPED` segments and unmap the rest, so a member holds at most
  that many of the publisher's buffers alive (in steady state, the very two it stages in);
  a member unmaps everything when it stops (evicted, closed, or the publisher gone).

Reads in place (protocol 13). A snapshot (not a ``copy=False`` ring, not a sharded lane's part)
is not copied at all: the member's receiving slot becomes a read-only view of the segment
(:meth:`ShmPlane.view`), its buckets are digested where they lie, and that view is the readable
version ``get``/``get_into`` copy from and ``stream``/``load`` hand out. What keeps the bytes
still: the publisher's staging does not write a buffer again while a member's last acknowledged
version lives in it (it parks the buffer and takes another, within a bound; past the bound it
evicts the holder, as a frozen reader). Nobody else can write it: every segment is sealed
(``F_SEAL_FUTURE_WRITE``) once the publisher has mapped it, so another process, a member that
lies included, can open it through /proc but neither map it writable nor ``write()`` it (on a
kernel without that seal the Announce says ``sealed=False`` and members copy, as before). What
proves the publisher did not write it again: the segment's epoch, bumped before any rewrite;
every read of an in-place version checks it at its end and is refused if it moved. A mapping
is never closed under a view: it goes when the last tensor on it does.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import secrets
import struct
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from weightsync import _wire
from weightsync._errors import Cancelled, LocalFailure, PeerFailure, ProtocolError
from weightsync.planes.dataplane import GenerationSpec, Transfer
from weightsync.recorder.recorder import RecorderScope

HEADER = 4096  # a segment's first page: magic, token, data bytes; the data starts page-aligned
MAGIC = b"WSSHM001"
_HEAD = struct.Struct("<8s16sQ")  # magic, token, data bytes
_EPOCH = struct.Struct("<q")  # at EPOCH_AT: bumped before the publisher writes the data again
EPOCH_AT = 64
READY_AT = 72  # bytes of the data copied in so far (-1: the copy failed); members wait on it
MAPPED = 2  # segments a member keeps mapped: the publisher's two staging buffers, in turn
CHUNK = 32 << 20  # a member checks for cancellation between copies of at most this many bytes
POLL_MIN, POLL_MAX = 50e-6, 2e-3  # seconds between looks at a snapshot still being taken


def available() -> bool:
    """True where the same-host path can work: Linux memfds and a /proc to open them through."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def huge_pages() -> str:
    """The kernel's transparent-huge-page mode for shared memory (``never`` makes snapshots slower)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as fh:
            modes = fh.read().split()
    except OSError:
        return "unknown"
    return next((m.strip("[]") for m in modes if m.startswith("[")), "unknown")


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1+ (not in Python's fcntl): no new writable mapping, no write()


def _create(name: str, nbytes: int, token: bytes) -> tuple[int, torch.Tensor, bool]:
    """A new memfd segment of ``nbytes`` data bytes: its descriptor, the whole mapping, and whether
    it is sealed (only this mapping can write it: a same-host member, honest or not, that opens
    it through /proc, even read-write, can neither map it writable nor write it)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0))
    try:
        os.ftruncate(fd, HEADER + nbytes)
        whole = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=HEADER + nbytes, dtype=torch.uint8)
    except BaseException:
        os.close(fd)
        raise
    whole[: _HEAD.size] = torch.frombuffer(bytearray(_HEAD.pack(MAGIC, token, nbytes)), dtype=torch.uint8)
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        sealed = True
    except (OSError, AttributeError):  # an older kernel: members copy out of it instead
        sealed = False
    return fd, whole, sealed


class ShmRef(msgspec.Struct, frozen=True):
    """Where an announced version's bytes lie: segment ``fd`` of the publisher, from ``offset``."""

    fd: int
    token: bytes  # the segment's own random token (its first page), checked at each mapping
    offset: int
    nbytes: int  # the segment's data bytes
    epoch: int = 0  # the segment's write count when announced: a member that reads another stops
    # a copy=False version through two bucket slots of ``ring`` bytes: bucket i is at (i % 2) * ring,
    # written once every same-host member said it copied bucket i - 2 (``Copied``)
    ring: int = 0
    # sealed against writes by anyone but the publisher's own mapping (F_SEAL_FUTURE_WRITE): only
    # then may a member read it in place (no other process can change what it verified)
    sealed: bool = False


class ShmFields(msgspec.Struct, frozen=True):
    """The ``"shm"`` plane's own fields of an Announce (``Announce.plane``): the segment to read."""

    segment: ShmRef


def announced(ref: ShmRef) -> bytes:
    """``Announce.plane`` for a same-host member reading ``ref``."""
    return msgspec.msgpack.encode(ShmFields(segment=ref))


def segment_of(announce: Any) -> ShmRef:
    """The segment ``announce`` names (``Announce.plane``); ProtocolError when it names none."""
    try:
        return msgspec.msgpack.decode(announce.plane, type=ShmFields).segment
    except (msgspec.DecodeError, AttributeError) as err:
        raise ProtocolError(f"version {announce.version} was announced without a segment to read: {err}") from None


class SegmentPool:
    """The publisher's segments: the door, and one per staging buffer (``allocate``/``drop``)."""

    def __init__(self, channel: str) -> None:
        self.channel = channel
        self._lock = threading.Lock()
        # data pointer -> fd, token, whole, sealed
        self._segments: dict[int, tuple[int, bytes, torch.Tensor, bool]] = {}
        self._door_token = secrets.token_bytes(16)
        self._door_fd = -1
        self._door: torch.Tensor | None = None
        self._boot_id = ""
        self._turns: dict[int, Any] = {}  # data pointer -> the turn ``reuse`` last bumped its epoch for
        self._dropped: list[Callable[[torch.Tensor], None]] = []  # told each segment staging drops

    def open(self) -> None:
        """Create the door (the publisher starts); nothing is created before."""
        self._door_fd, self._door, _ = _create(f"weightsync-{self.channel}-door", 0, self._door_token)
        self._boot_id = boot_id()

    def offer(self) -> _wire.ShmOffer | None:
        """What the Challenge tells connecting members (how to find the door); None once closed."""
        if self._door_fd < 0:
            return None
        return _wire.ShmOffer(pid=os.getpid(), fd=self._door_fd, token=self._door_token, boot_id=self._boot_id)

    def allocate(self, nbytes: int, device: torch.device, pin: bool) -> torch.Tensor:
        """Staging's allocator: a buffer of ``nbytes`` in a fresh segment (host memory only)."""
        if device.type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        token = secrets.token_bytes(16)
        fd, whole, sealed = _create(f"weightsync-{self.channel}", nbytes, token)
        data = whole[HEADER:]
        with self._lock:
            self._segments[data.data_ptr()] = (fd, token, whole, sealed)
        return data

    def ref(self, buf: torch.Tensor) -> ShmRef | None:
        """Where a member finds ``buf`` (a staging buffer, or its first bytes), or None if not ours."""
        with self._lock:
            found = self._segments.get(buf.data_ptr())
        if found is None:
            return None
        fd, token, whole, sealed = found
        epoch = int(whole[EPOCH_AT:EPOCH_AT + 8].view(torch.int64)[0])
        return ShmRef(fd=fd, token=token, offset=0, nbytes=whole.numel() - HEADER, epoch=epoch, sealed=sealed)

    def whole(self, buf: torch.Tensor) -> torch.Tensor | None:
        """The whole segment ``buf`` is the data of (its header page first), or None if not ours."""
        with self._lock:
            found = self._segments.get(buf.data_ptr())
        return None if found is None else found[2]

    def on_drop(self, told: Callable[[torch.Tensor], None]) -> None:
        """Have ``told(whole)`` called for each segment staging drops from now on (before it goes)."""
        with self._lock:
            self._dropped.append(told)

    def reuse(self, buf: torch.Tensor, turn: Any = None) -> None:
        """Staging is about to write ``buf`` again: bump its epoch first, so a member still copying
        the previous contents (one frozen mid-copy, say) sees the change and publishes nothing.
        With ``turn``: once per turn (the parts that serve one version's ring each ask)."""
        with self._lock:
            found = self._segments.get(buf.data_ptr())
            if turn is not None:
                if self._turns.get(buf.data_ptr()) == turn:
                    return
                self._turns[buf.data_ptr()] = turn
        if found is not None:
            header = found[2][EPOCH_AT:READY_AT + 8].view(torch.int64)
            header[0] += 1
            header[1] = 0

    def marker(self, buf: torch.Tensor) -> Callable[[int], None]:
        """Tells same-host members how much of ``buf`` is copied (a snapshot in progress)."""
        with self._lock:
            found = self._segments.get(buf.data_ptr())
        if found is None:
            return lambda _n: None
        ready = found[2][READY_AT:READY_AT + 8].view(torch.int64)

        def mark(nbytes: int) -> None:
            ready[0] = nbytes  # after the bytes it counts: a reader that sees it sees them

        return mark

    def drop(self, buf: torch.Tensor) -> None:
        """Staging no longer holds ``buf``: close its descriptor (the mapping goes with the tensor)."""
        with self._lock:
            found = self._segments.pop(buf.data_ptr(), None)
            self._turns.pop(buf.data_ptr(), None)
            told = list(self._dropped)
        if found is not None:
            for tell in told:
                tell(found[2])
            os.close(found[0])

    def close(self) -> None:
        with self._lock:
            fds = [fd for fd, _, _, _ in self._segments.values()] + [self._door_fd]
            self._segments.clear()
            self._door_fd, self._door = -1, None
        for fd in fds:
            if fd >= 0:
                os.close(fd)


def _map(pid: int, fd: int, token: bytes) -> tuple[mmap.mmap, int, int]:
    """Map another process's segment read-only: (mapping, address of its data, data bytes)."""
    try:
        handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise ProtocolError(f"cannot open the publisher's segment (pid {pid}, fd {fd}): {err}") from err
    try:
        size = os.fstat(handle).st_size
        if size < HEADER:
            raise ProtocolError(f"the publisher's segment (fd {fd}) is {size} bytes, not a segment")
        # pre-faulted: the kernel maps every page at once instead of one fault per page later
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapping = mmap.mmap(handle, size, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(handle)
    magic, found, nbytes = _HEAD.unpack_from(mapping, 0)
    if magic != MAGIC or found != token or nbytes + HEADER > size:
        mapping.close()
        raise ProtocolError(f"fd {fd} of pid {pid} is not the announced segment")
    with warnings.catch_warnings():  # a read-only buffer: torch warns that it must not be written
        warnings.simplefilter("ignore")
        address = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
    return mapping, address + HEADER, nbytes


def door_problem(offer: _wire.ShmOffer | None) -> str | None:
    """Why this process cannot read the publisher's segments (None: it can)."""
    if offer is None:
        return "the publisher offers no shared memory (it stages on a GPU, or runs where memfds do not exist)"
    if not available():
        return "this process has no memfd and /proc"
    if offer.boot_id and offer.boot_id != boot_id():
        return "the publisher runs on another host"
    try:
        mapping, _, _ = _map(offer.pid, offer.fd, offer.token)
    except ProtocolError as err:
        return f"the publisher's shared memory is out of reach ({err})"
    mapping.close()
    return None


_HEADER_WORDS = struct.Struct("<qq")  # a segment's epoch and ready count, at EPOCH_AT and READY_AT


def await_ready(look: Callable[[], tuple[int, int]], epoch: int, end: int, transfer: Transfer) -> int:
    """Until a snapshot being taken has copied the first ``end`` bytes of its buffer (``look()``: the
    buffer's epoch and ready count now); returns the ready count. Cancelled when the buffer was
    written again (its epoch moved), the snapshot failed or the transfer was cancelled; PeerFailure
    when it stopped short for longer than those bytes' deadline."""
    deadline = None
    pause = POLL_MIN
    while True:
        now_epoch, ready = look()
        if now_epoch != epoch:
            raise Cancelled(f"version {transfer.version}'s buffer was reused while this member read it")
        if ready >= end:
            return int(ready)
        if ready < 0:
            raise Cancelled(f"the publisher's snapshot of version {transfer.version} failed")
        if transfer.cancelled is not None and transfer.cancelled():
            raise Cancelled("the publisher gave up on this version")
        now = time.monotonic()
        if deadline is None:
            deadline = now + transfer.deadline(end - max(ready, 0))
        elif now > deadline:
            raise PeerFailure(f"the publisher's snapshot of version {transfer.version} stopped at byte {ready}")
        time.sleep(pause)  # a snapshot copies about a bucket per few ms: a short poll is enough
        pause = min(pause * 2, POLL_MAX)


class ShmPlane:
    """A same-host member's data plane: ``move`` copies each bucket out of the announced segment.

    It joins no group (``offer``/``enter``/``leave`` do nothing); the publisher sends nothing to
    it on the wire but the Announce naming the segment and the Seal. Owned by the receiver
    thread.
    """

    in_group, moves_alone = False, True

    def __init__(self, pid: int, recorder: RecorderScope | None = None, member: str = "",
                 tell: Callable[[Any], None] | None = None) -> None:
        self.pid = pid
        self._rec = recorder
        self._member, self._tell = member, tell  # a ring's slot freed is told to the publisher
        self._mapped: OrderedDict[bytes, tuple[mmap.mmap, int, int]] = OrderedDict()

    def offer(self) -> str:
        return ""

    def rendezvous_prefixes(self, spec: GenerationSpec) -> tuple[str, ...]:
        return ()  # nothing to rendezvous about

    def broadcast_parent(self, rank: int) -> int | None:
        return None  # every member reads the segment itself

    def enter(self, spec: GenerationSpec) -> None:
        return None

    def leave(self, reason: str, *, failed: bool = False) -> None:
        return None

    def _segment(self, ref: ShmRef) -> tuple[int, int]:
        found = self._mapped.get(ref.token)
        if found is None:
            found = _map(self.pid, ref.fd, ref.token)
            self._mapped[ref.token] = found
            while len(self._mapped) > MAPPED:
                self._unmap(next(iter(self._mapped)))
        self._mapped.move_to_end(ref.token)
        return found[1], found[2]

    def _unmap(self, token: bytes) -> None:
        # never closed here: a slot or a reader may hold a view of it (torch keeps the mapping
        # object alive, not its pages); it is unmapped when the last reference goes
        self._mapped.pop(token)

    def view_of(self, announce: Any) -> tuple[torch.Tensor, Callable[[], bool]] | None:
        """A sealed snapshot ``announce`` names, read where it lies (its view and guard); None for
        what is copied out instead (a ``copy=False`` ring, an unsealed segment, an encoded version)."""
        ref = segment_of(announce)
        if ref.ring or not ref.sealed or announce.coding.name != "full":
            return None
        return self.view(ref, announce.manifest.total_bytes)

    def view(self, ref: ShmRef, nbytes: int) -> tuple[torch.Tensor, Callable[[], bool]]:
        """The announced snapshot's ``nbytes`` as a read-only tensor on the segment, and a guard:
        True while the segment's epoch is still the announced one (nothing rewrote it)."""
        if ref.ring:
            raise ProtocolError("a copy=False ring is copied out bucket by bucket, never read in place")
        _, size = self._segment(ref)
        if ref.offset < 0 or ref.offset + nbytes > size:
            raise ProtocolError(f"{nbytes} bytes at {ref.offset} overrun the {size}-byte segment")
        mapping = self._mapped[ref.token][0]
        if nbytes == 0:
            flat = torch.empty(0, dtype=torch.uint8)
        else:
            with warnings.catch_warnings():  # read-only: torch warns that it must not be written
                warnings.simplefilter("ignore")
                flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=HEADER + ref.offset)
        epoch = ref.epoch

        def unchanged() -> bool:
            return _EPOCH.unpack_from(mapping, EPOCH_AT)[0] == epoch

        return flat, unchanged

    def move(self, transfer: Transfer) -> None:
        announce = transfer.announce
        ref = segment_of(announce)
        base, size = self._segment(ref)
        total = sum(b.numel() for b in transfer.buckets)
        ring = ref.ring  # copy=False: bucket i in slot i % 2 of two (written once we said we copied i - 2)
        if ring:
            if ref.offset != 0 or 2 * ring > size or any(b.numel() > ring for b in transfer.buckets):
                raise ProtocolError(f"version {transfer.version}: a ring of {ring}-byte slots does not fit")
        elif ref.offset < 0 or ref.offset + total > size:
            raise ProtocolError(f"version {transfer.version}: {total} bytes at {ref.offset} overrun the segment")
        src = base + ref.offset
        done = 0  # the version's bytes copied so far
        for i, bucket in enumerate(transfer.buckets):
            if ring:
                src = base + (i % 2) * ring
            # each copy is a "bucket_recv" in the flight recorder, as on the group path, so the
            # analyzer names the bucket a frozen same-host member stopped in
            entry = None if self._rec is None else self._rec.record(
                "bucket_recv", version=transfer.version, bucket=i, nbytes=bucket.numel()).start()
            try:
                self._await_ready(ref, ref.offset + done + bucket.numel(), transfer)
                self._check_epoch(ref, transfer.version)
                if bucket.numel() and bucket.data_ptr() != src:  # else read in place: nothing to copy
                    _copy(bucket, src, transfer.cancelled)
            except BaseException as err:
                if entry is not None:
                    entry.fail(err)
                raise
            if entry is not None:
                entry.complete()
            src += bucket.numel()
            done += bucket.numel()
            try:
                if ring and self._tell is not None:  # its ring slot is free for bucket i + 2: say so first
                    self._tell(_wire.Copied(announce.generation, announce.seq, self._member, i))
                if transfer.after is not None:
                    transfer.after(i)
            except Exception as err:  # noqa: BLE001 - this end's own failure, as the DataPlane says
                raise LocalFailure(f"after bucket {i}: {err}") from err
        # read after the copies: a publisher that started writing meanwhile bumped it first
        self._check_epoch(ref, transfer.version)

    def _await_ready(self, ref: ShmRef, end: int, transfer: Transfer) -> None:
        """Until the publisher's snapshot has copied the first ``end`` bytes of the segment."""
        mapping = self._mapped[ref.token][0]
        await_ready(lambda: _HEADER_WORDS.unpack_from(mapping, EPOCH_AT), ref.epoch, end, transfer)

    def _check_epoch(self, ref: ShmRef, version: int) -> None:
        mapping = self._mapped[ref.token][0]
        (epoch,) = _EPOCH.unpack_from(mapping, EPOCH_AT)
        if epoch != ref.epoch:
            raise Cancelled(f"version {version}'s segment was reused while this member copied it")

    def close(self) -> None:
        for token in list(self._mapped):
            self._unmap(token)


def _copy(dest: torch.Tensor, src: int, cancelled: Callable[[], bool] | None) -> None:
    """Copy ``dest.numel()`` bytes from address ``src`` in chunks (ctypes.memmove drops the GIL)."""
    out, n = dest.data_ptr(), dest.numel()
    for lo in range(0, n, CHUNK):
        if cancelled is not None and cancelled():
            raise Cancelled("the publisher gave up on this version")
        ctypes.memmove(out + lo, src + lo, min(CHUNK, n - lo))


def mapped_segments() -> int:
    """Memfd mappings of this process (tests count them before and after)."""
    with open("/proc/self/maps") as fh:
        return sum(1 for line in fh if "/memfd:weightsync" in line)


def open_segments(pid: int | None = None) -> int:
    """Memfd descriptors of process ``pid`` (default: this one) that are weightsync segments."""
    base = f"/proc/{pid or os.getpid()}/fd"
    count = 0
    for name in os.listdir(base):
        try:
            if os.readlink(f"{base}/{name}").startswith("/memfd:weightsync"):
                count += 1
        except OSError:
            continue
    return count
