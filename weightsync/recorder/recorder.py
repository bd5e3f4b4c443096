"""Flight recorder: a bounded ring of every transport and group operation in this process.

Why: when a weight push stalls, a generic timeout says nothing about *who* stopped *where*.
Each process keeps its last ``capacity`` operations (put, announce, bucket send/receive,
ack, publish, abort, rebuild, evict, admit) with their state transitions and timestamps;
dumps of all ranks, merged by ``weightsync fr analyze``, name the member, version and bucket
where progress stopped.

Recording is a few attribute writes under no lock (a ``deque`` append is atomic), so it stays
on by default. ``capacity=0`` turns it off: ``record`` then returns a shared inert entry.

An entry the ring pushes out before it completed (a failure, an abort, an operation still in
flight) is kept aside, up to ``capacity // 4`` of them: a death at version 3 still reads in a
dump written 400 versions later, when the ring holds only the last few hundred versions.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import msgspec

SCHEDULED, STARTED, COMPLETED, FAILED, ABORTED = "scheduled", "started", "completed", "failed", "aborted"
DEFAULT_CAPACITY = 2000
DUMP_FORMAT = "weightsync-fr"
DUMP_FORMAT_VERSION = 1
DUMP_SUFFIX = ".wsfr"
DIR_ENV = "WEIGHTSYNC_FR_DIR"
DUMP_ENV = "WEIGHTSYNC_FR_DUMP"  # "close": also dump at every clean close (a healthy run to compare with)
_MIN_AUTO_DUMP_INTERVAL = 0.5
log = logging.getLogger("weightsync.recorder")


class Entry(msgspec.Struct, kw_only=True):
    """One operation. Times are ``time.time()`` seconds, comparable across ranks on one host."""

    seq: int
    op: str
    channel: str
    member: str
    generation: int = -1
    version: int = -1
    bucket: int = -1
    nbytes: int = 0
    peers: tuple[str, ...] = ()
    encoding: str = ""  # a version's buckets: how they went on the wire, and the base a delta was against
    base: int = -1
    digest: str = ""  # an announce: the function of its Seal's digests ("" when it has none)
    state: str = SCHEDULED
    t_scheduled: float = 0.0
    t_started: float = 0.0
    t_ended: float = 0.0
    duration: float = 0.0
    error: str = ""

    def start(self) -> Entry:
        self.t_started = time.time()
        self.state = STARTED
        return self

    def complete(self) -> Entry:
        return self._end(COMPLETED, self.error)

    def fail(self, error: BaseException | str, *, aborted: bool = False) -> Entry:
        return self._end(ABORTED if aborted else FAILED, str(error)[:500])

    def _end(self, state: str, error: str) -> Entry:
        self.t_ended = time.time()
        self.duration = self.t_ended - (self.t_started or self.t_scheduled)
        self.state = state
        self.error = error
        return self


def _check_capacity(capacity: object) -> None:
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise TypeError(f"capacity must be an int (0 turns recording off), got {type(capacity).__name__} "
                        f"{capacity!r:.40}")
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0 (0 turns recording off), got {capacity}")


class Dump(msgspec.Struct, kw_only=True):
    """One process's recorder dump, as written to ``<label>-<pid>.wsfr`` (msgpack)."""

    format: str = DUMP_FORMAT
    format_version: int = DUMP_FORMAT_VERSION
    label: str
    pid: int
    host: str
    time: float
    reason: str
    torch_version: str
    capacity: int
    entries: list[Entry]


class FlightRecorder:
    """A ring buffer of :class:`Entry`, one per process (see :func:`process_recorder`).

    Example::

        rec = FlightRecorder(capacity=100)
        entry = rec.record("bucket_send", channel="policy", member="publisher", version=3, bucket=0)
        entry.start()
        ...
        entry.complete()
        rec.snapshot()[-1].state  # "completed"
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY, *, directory: str | os.PathLike[str] | None = None,
                 label: str | None = None) -> None:
        _check_capacity(capacity)
        self.capacity = capacity
        self._ring: deque[Entry] = deque(maxlen=capacity or 1)
        self._kept: deque[Entry] = deque(maxlen=max(1, capacity // 4))  # pushed out unfinished
        self._seq = itertools.count()
        self._lock = threading.Lock()
        # dumps come from the loop, from sender threads and from a signal handler at once: they take
        # turns (reentrant: a SIGUSR1 dump may interrupt one in the same thread, so each still
        # writes a temporary file of its own)
        self._dump_lock = threading.RLock()
        self._dump_seq = itertools.count()
        self._directory = Path(directory) if directory is not None else None
        self.label = label
        self._last_auto_dump = 0.0
        self._announced_dir = False
        self._said_where = False
        self.last_dump_path: Path | None = None
        #: also dump at a clean close, not only after trouble (default: ``$WEIGHTSYNC_FR_DUMP=close``)
        self.dump_at_close = os.environ.get(DUMP_ENV, "").strip().lower() == "close"

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def record(self, op: str, *, channel: str, member: str, **fields: Any) -> Entry:
        """Add an entry in state ``scheduled`` and return it for the caller to advance."""
        entry = Entry(seq=next(self._seq), op=op, channel=channel, member=member, t_scheduled=time.time(), **fields)
        if self.capacity:
            ring = self._ring
            if len(ring) == ring.maxlen:
                try:
                    oldest = ring[0]
                except IndexError:  # emptied by a resize meanwhile
                    pass
                else:
                    if oldest.state != COMPLETED:
                        self._kept.append(oldest)
            ring.append(entry)
        return entry

    def scope(self, channel: str, member: str) -> RecorderScope:
        """This recorder as seen by one channel end: ``scope.record(op, ...)`` fills in both."""
        return RecorderScope(self, channel, member)

    def snapshot(self) -> list[Entry]:
        """A copy of the ring, oldest first (entries still in flight keep their state), after the
        unfinished entries the ring pushed out (each once, in ``seq`` order)."""
        with self._lock:
            ring = list(self._ring)
            first = ring[0].seq if ring else None
            kept = {e.seq: e for e in list(self._kept) if first is None or e.seq < first}
            return [msgspec.structs.replace(e) for e in [*sorted(kept.values(), key=lambda e: e.seq), *ring]]

    # where dumps go --------------------------------------------------------------------------
    def configure(self, *, directory: str | os.PathLike[str] | None = None, label: str | None = None,
                  default_directory: str | None = None) -> None:
        """Set where dumps go (first explicit setting wins) and this process's label."""
        if directory is not None:
            self._directory = Path(directory)
        elif self._directory is None:
            env = os.environ.get(DIR_ENV)
            if env:
                self._directory = Path(env)
            elif default_directory is not None:
                self._directory = dump_root() / default_directory
                prune_dump_folders(keep=self._directory)
        if label is not None and self.label is None:
            self.label = label

    def say_where(self) -> None:
        """Log, once per recorder, where its dumps will go (an end calls it when it starts)."""
        if self.capacity and not self._said_where:
            self._said_where = True
            log.info("flight recorder: dumps go to %s (on trouble, on demand%s; weightsync fr list)",
                     self.directory, ", at close" if self.dump_at_close else "")

    @property
    def directory(self) -> Path:
        if self._directory is None:
            self.configure()
        return self._directory or dump_root() / f"pid-{os.getpid()}"

    def dump(self, path: str | os.PathLike[str] | None = None, *, reason: str = "on demand") -> Path:
        """Write the ring to ``path`` (default ``<directory>/<label>-<pid>.wsfr``); returns the path.

        The file is replaced atomically, so a later dump of the same process supersedes an
        earlier one. torch's own recorder dump is written beside it when this torch has one.
        """
        import torch  # noqa: PLC0415 - only needed when a dump is written

        from weightsync import _torch_compat as compat  # noqa: PLC0415 - it imports torch: only for a dump

        label = (self.label or "process").replace("/", "_")
        target = Path(path) if path is not None else self.directory / f"{label}-{os.getpid()}{DUMP_SUFFIX}"
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.{next(self._dump_seq)}.tmp")
        with self._dump_lock:  # the ring is read inside, so the file last renamed holds the newest ring
            dump = Dump(label=label, pid=os.getpid(), host=socket.gethostname(), time=time.time(), reason=reason,
                        torch_version=str(torch.__version__), capacity=self.capacity, entries=self.snapshot())
            try:
                tmp.write_bytes(_encode(dump))
                os.replace(tmp, target)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            torch_trace = compat.torch_flight_recorder_json()
            if torch_trace:
                target.with_suffix(".torch.json").write_bytes(torch_trace)
            self.last_dump_path = target
        if path is None:
            prune_dumps(target.parent, keep=target)
        if path is None and not self._announced_dir:
            self._announced_dir = True
            log.warning("flight recorder dumps go to %s", target.parent)
        return target

    def dump_on_trouble(self, reason: str, *, force: bool = False) -> Path | None:
        """Dump after a failure or an expired deadline, at most every 0.5 s; never raises."""
        if not self.capacity:
            return None
        now = time.monotonic()
        if now - self._last_auto_dump < _MIN_AUTO_DUMP_INTERVAL and not force:
            return None
        self._last_auto_dump = now
        try:
            return self.dump(reason=reason)
        except Exception as err:  # noqa: BLE001 - a failed dump must never become the caller's failure
            log.warning("flight recorder could not dump (%s)", err)
            return None

    def resize(self, capacity: int) -> None:
        _check_capacity(capacity)
        with self._lock:
            self.capacity = capacity
            self._ring = deque(self._ring, maxlen=capacity or 1)
            self._kept = deque(self._kept, maxlen=max(1, capacity // 4))


class RecorderScope:
    """A recorder bound to one channel and member (see :meth:`FlightRecorder.scope`)."""

    def __init__(self, recorder: FlightRecorder, channel: str, member: str) -> None:
        self.recorder, self.channel, self.member = recorder, channel, member

    def record(self, op: str, **fields: Any) -> Entry:
        return self.recorder.record(op, channel=self.channel, member=self.member, **fields)


MAX_DUMP_FOLDERS = 32  # under the default root: older ones go when a new one is made
MAX_DUMPS_PER_FOLDER = 256  # in any folder this recorder writes to: the oldest dumps go past it


def _encode(dump: Dump) -> bytes:
    """The dump's bytes; an entry msgpack cannot hold (an int past 64 bits from a caller's bad
    argument) is left out, never the whole dump."""
    try:
        return msgspec.msgpack.encode(dump)
    except (OverflowError, TypeError, ValueError):
        kept = []
        for entry in dump.entries:
            try:
                msgspec.msgpack.encode(entry)
            except (OverflowError, TypeError, ValueError):
                continue
            kept.append(entry)
        return msgspec.msgpack.encode(msgspec.structs.replace(dump, entries=kept))


def prune_dumps(folder: Path, *, keep: Path | None = None, limit: int = MAX_DUMPS_PER_FOLDER) -> int:
    """Remove the oldest dumps (and torch's trace beside each) in ``folder`` beyond ``limit``, never
    ``keep``; returns how many went. Every process writes its own file, so without a bound a
    folder that many runs share (``$WEIGHTSYNC_FR_DIR``) would grow forever."""
    try:
        dumps = sorted(folder.glob(f"*{DUMP_SUFFIX}"), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return 0  # one went away while sorting: the next dump prunes
    removed = 0
    for old in dumps[limit:]:
        if old == keep:
            continue
        old.unlink(missing_ok=True)
        old.with_suffix(".torch.json").unlink(missing_ok=True)
        removed += 1
    return removed


def dump_root() -> Path:
    """Where dump folders go when neither ``flight_recorder_dir`` nor ``$WEIGHTSYNC_FR_DIR`` says."""
    return Path(tempfile.gettempdir()) / "weightsync-fr"


def dump_folders(root: Path | None = None) -> list[tuple[Path, int, float]]:
    """Folders under ``root`` (default :func:`dump_root`): (path, dumps in it, last change), newest first."""
    base = root or dump_root()
    found = []
    try:
        children = list(base.iterdir())
    except OSError:
        return []
    for child in children:
        try:
            if child.is_dir():
                found.append((child, len(list(child.glob(f"*{DUMP_SUFFIX}"))), child.stat().st_mtime))
        except OSError:
            continue  # went away meanwhile
    return sorted(found, key=lambda f: f[2], reverse=True)


EMPTY_FOLDER_AGE = 60.0  # seconds: an empty dump folder older than this is left over, and goes


def _empty(folder: Path) -> bool:
    try:
        return not any(folder.iterdir())
    except OSError:
        return False


def prune_dump_folders(keep: Path | None = None, *, limit: int = MAX_DUMP_FOLDERS, root: Path | None = None) -> int:
    """Remove the oldest folders under the default root beyond ``limit``, and empty ones left over
    (never ``keep``); returns how many went. Only the default root's folders are pruned: a directory
    the user named is theirs (its own dumps are bounded by :func:`prune_dumps`)."""
    removed = 0
    folders = dump_folders(root)
    settled = time.time() - EMPTY_FOLDER_AGE  # younger empty ones may be another process's, about to dump
    empty = [f for f, count, mtime in folders[:limit] if count == 0 and mtime < settled and _empty(f)]
    for folder, _count, _mtime in [*folders[limit:], *((f, 0, 0.0) for f in empty)]:
        if keep is not None and folder == keep:
            continue
        try:
            shutil.rmtree(folder)
            removed += 1
        except OSError:
            continue  # another process's, or in use: left for a later prune
    return removed


_process_recorder: FlightRecorder | None = None
_process_lock = threading.Lock()


def process_recorder() -> FlightRecorder:
    """The recorder shared by every channel in this process, created on first use."""
    global _process_recorder
    with _process_lock:
        if _process_recorder is None:
            _process_recorder = FlightRecorder()
        return _process_recorder


MAX_DUMP_BYTES = 64 << 20  # a full ring of the default 2000 entries is about half a MiB


def printable(text: str) -> str:
    """``text`` with every control or non-printable character escaped (``\\n``, ``\\x1b``): what a
    dump or a member says is printed to an operator's terminal, never interpreted by it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _read_bounded(path: str | os.PathLike[str], limit: int) -> bytes:
    """A regular file's bytes, at most ``limit`` of them; ValueError for anything else (a FIFO, a
    device such as ``/dev/zero`` behind a symlink, a file past the bound): nothing blocks or
    reads without end."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path}: not a regular file")
        if info.st_size > limit:
            raise ValueError(f"{path}: {info.st_size} bytes, more than a dump holds (at most {limit})")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"{path}: more than a dump holds (at most {limit} bytes)")
    return data


def _clean(entry: Entry) -> Entry:
    texts = (entry.op, entry.channel, entry.member, entry.encoding, entry.digest, entry.state, entry.error)
    if all(t.isprintable() for t in texts) and all(p.isprintable() for p in entry.peers):
        return entry
    return msgspec.structs.replace(entry, op=printable(entry.op), channel=printable(entry.channel),
                                   member=printable(entry.member), encoding=printable(entry.encoding),
                                   digest=printable(entry.digest), state=printable(entry.state),
                                   error=printable(entry.error), peers=tuple(printable(p) for p in entry.peers))


def load_dump(path: str | os.PathLike[str], *, limit: int = MAX_DUMP_BYTES) -> Dump:
    """Read a ``.wsfr`` file; ValueError with a clear message for anything else.

    Hostile input is bounded: only a regular file of at most ``limit`` bytes is read, and every
    text in it comes back with control characters escaped (:func:`printable`)."""
    data = _read_bounded(path, limit)
    try:
        dump = msgspec.msgpack.decode(data, type=Dump)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise ValueError(f"{path}: not a weightsync flight-recorder dump ({printable(str(err))[:200]})") from None
    except RecursionError:
        raise ValueError(f"{path}: not a weightsync flight-recorder dump (nested too deep)") from None
    if dump.format != DUMP_FORMAT:
        raise ValueError(f"{path}: format {printable(dump.format)[:64]!r} is not {DUMP_FORMAT!r}")
    if dump.format_version > DUMP_FORMAT_VERSION:
        raise ValueError(f"{path}: format version {dump.format_version} is newer than this weightsync reads "
                         f"({DUMP_FORMAT_VERSION}); upgrade weightsync")
    dump.label, dump.host, dump.reason = printable(dump.label), printable(dump.host), printable(dump.reason)
    dump.torch_version = printable(dump.torch_version)
    dump.entries = [_clean(e) for e in dump.entries]
    return dump


def install_signal_handler(recorder: FlightRecorder | None = None, signum: int = signal.SIGUSR1) -> None:
    """Dump ``recorder`` (default: this process's) when ``signum`` arrives.

    Call it from the application or the CLI (main thread); importing weightsync never does.
    """
    target = recorder or process_recorder()

    def handler(_sig: int, _frame: Any) -> None:
        path = target.dump(reason=f"signal {signal.Signals(_sig).name}")
        log.warning("flight recorder dumped %s", path)

    signal.signal(signum, handler)
