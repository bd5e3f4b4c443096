"""What the one-sided plane uses of ``torch.distributed._transport`` (torch 2.15): one NIXL endpoint
per publisher that registers its staging memory, one per member that reads it.

Nothing here is imported before a one-sided member or part is built: torch below 2.15 has no
``torch.distributed._transport``, and ``nixl`` is an optional dependency (``weightsync[nixl]``).
:func:`problem` says which of them is missing.

**The publisher's end** (:class:`Exposure`) binds once (its agent's metadata is the ``url`` every
Announce carries), registers each staging buffer the first time a version in it is announced and
unregisters it when staging drops the buffer. It issues nothing: members read.

**A member's end** (:class:`Reader`) connects to the publisher's url once, registers the memory it
receives into (each buffer's whole storage, once, a few at most) and reads byte ranges of the
publisher's registration into it. The abort contract (``Transport``'s own: a timeout does not
cancel DMA, pytorch/pytorch#197032): a read given up on (past its deadline, or the version
cancelled) is kept; until it ends, the memory it may still write is not read into again
(:meth:`Reader.ready_for` waits for it, bounded, then refuses) and not unregistered; the storage
stays alive while its registration holds it.
"""

from __future__ import annotations

import functools
import importlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from weightsync._errors import Cancelled, LocalFailure, PeerFailure, ProtocolError

BACKEND = "nixl"
LOCAL_KEPT = 4  # storages a member keeps registered: its two slots, a decoder's scratch, one spare
POLL_MIN, POLL_MAX = 20e-6, 1e-3  # seconds between looks at a read in flight


@functools.cache
def problem() -> str | None:
    """Why this process cannot move bytes one-sided (None: it can): the torch, the backend or the
    package that is missing, as a user fixes it."""
    try:
        api = importlib.import_module("torch.distributed._transport")
    except ImportError:
        return (f"torch {torch.__version__} has no torch.distributed._transport (its one-sided transport "
                "API came with torch 2.15)")
    if BACKEND not in api.available_transports():
        return f"torch {torch.__version__} has no {BACKEND!r} transport backend"
    try:
        importlib.import_module("nixl")
    except (ImportError, OSError) as err:
        return f"the nixl package cannot be imported ({err}; pip install 'weightsync[nixl]')"
    if not importlib.import_module("torch.distributed._transport.nixl").NIXLTransport.supported():
        return "the nixl package has no agent API torch's NIXL transport needs"
    return None


def refusal(transport: str, device: torch.device, sliced: bool) -> str | None:
    """Why a member receiving into ``device`` (``sliced``: with ``want=``) cannot take ``transport``
    here, for the planes that read the publisher's host memory ("shm", "one-sided"); else None."""
    if transport not in ("shm", "one-sided"):
        return None
    if device.type != "cpu":
        return f"transport={transport!r} receives into host memory, not {device} (not built yet)"
    if sliced:
        return f"want= receives over the group; transport={transport!r} copies whole versions"
    why = problem() if transport == "one-sided" else None
    return None if why is None else f"transport='one-sided' is impossible: {why}"


class Registration(msgspec.Struct, frozen=True):
    """A registered buffer as a peer reads it (the NIXL remote descriptor's fields, as a msgspec
    Struct on the wire, never the backend's own serialization): agent ``agent`` holds ``length``
    bytes at ``address``."""

    agent: str
    address: int
    length: int
    device: int
    memory: str  # "DRAM" or "VRAM"
    metadata: bytes  # the agent's partial metadata for this registration (connection info, keys)


def _new_transport() -> Any:
    """An endpoint without NIXL's own progress thread: it spins a whole core for as long as the
    endpoint lives (measured: 0.98 CPU-seconds per second, idle). A member's end progresses as it
    polls its reads; the publisher's is progressed by :class:`Exposure`'s own thread."""
    api = importlib.import_module("torch.distributed._transport")
    return api.new_transport(BACKEND, enable_prog_thread=False)


PUMP_BUSY, PUMP_IDLE = 1e-3, 20e-3  # seconds between progress calls while members may read, and otherwise
BUSY_FOR = 10.0  # seconds after a version was announced that members may still be reading it


class Exposure:
    """The publisher's endpoint (see the module docstring). Any thread; ``close`` once, last.

    Its thread (``ws-nixl``) progresses the endpoint (so members' reads over TCP are served): every
    :data:`PUMP_BUSY` seconds while a version announced in the last :data:`BUSY_FOR` seconds may
    be read, every :data:`PUMP_IDLE` otherwise (measured on a 2-core Xeon: 4-6% of a core at the
    busy cadence, against the whole core of NIXL's own thread, for the same read times)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._transport: Any = None
        self._url = b""
        self._exposed: dict[int, tuple[Any, Registration]] = {}  # data pointer -> (memory, registration)
        self._busy_until = 0.0
        self._stop = threading.Event()
        self._pump: threading.Thread | None = None

    def url(self) -> bytes:
        """This endpoint's connection bytes (its agent's metadata); binds on first use."""
        with self._lock:
            return self._open()[1]

    def _open(self) -> tuple[Any, bytes]:
        if self._transport is None:
            self._transport = _new_transport()
            self._url = bytes(self._transport.bind())
            self._pump = threading.Thread(target=self._progress, args=(self._transport,), name="ws-nixl", daemon=True)
            self._pump.start()
        return self._transport, self._url

    def announced(self) -> None:
        """A version was announced: members may read for a while (progress at the busy cadence)."""
        self._busy_until = time.monotonic() + BUSY_FOR

    def _progress(self, transport: Any) -> None:
        """Progress the endpoint until closed: its agent's notification poll moves the backend's
        worker (torch's transport serializes calls on its lock: taken, or the turn skipped)."""
        lock, agent = transport._operation_lock, transport._agent  # noqa: SLF001 - torch 2.15's NIXLTransport
        while not self._stop.wait(PUMP_BUSY if time.monotonic() < self._busy_until else PUMP_IDLE):
            if lock.acquire(blocking=False):
                try:
                    if transport._closing or transport._closed:  # noqa: SLF001
                        return
                    agent.get_new_notifs()
                except Exception:  # noqa: BLE001 - a failing poll ends the pump; members' reads then fail
                    return
                finally:
                    lock.release()

    def expose(self, whole: torch.Tensor) -> Registration:
        """``whole`` (a staging buffer, header included), registered once for every member to read."""
        with self._lock:
            found = self._exposed.get(whole.data_ptr())
            if found is not None and found[1].length == whole.numel():
                return found[1]
            transport, _ = self._open()
            memory = transport.register_memory(whole)
            desc = memory.to_remote_buffer()
            reg = Registration(desc.agent_name, desc.address, desc.length, desc.device_id, desc.memory_type,
                               bytes(desc.metadata))
            self._exposed[whole.data_ptr()] = (memory, reg)
            return reg

    def withdraw(self, whole: torch.Tensor) -> None:
        """Staging dropped ``whole``: members can no longer read it (a read in flight fails on their side)."""
        with self._lock:
            found = self._exposed.pop(whole.data_ptr(), None)
            if found is not None and self._transport is not None:
                self._transport.unregister_memory(found[0])

    def exposed(self) -> int:
        """Buffers registered now (tests count them)."""
        with self._lock:
            return len(self._exposed)

    def close(self) -> None:
        with self._lock:
            transport, self._transport = self._transport, None
            self._exposed.clear()
        self._stop.set()
        if self._pump is not None:
            self._pump.join(timeout=5.0)
        if transport is not None:
            try:
                transport.close(timeout=5.0)
            except Exception:  # noqa: BLE001 - a member's read of ours may pend: kept, it goes with the process
                _held.append(transport)


class Reader:
    """A member's endpoint (see the module docstring). Owned by the receiver thread."""

    def __init__(self) -> None:
        self._transport: Any = None
        self._url = b""
        self._remote_cls: Any = None
        self._local: OrderedDict[tuple[int, int, str], Any] = OrderedDict()  # storage -> its registration
        self._stale: list[tuple[Any, tuple[int, int, str]]] = []  # reads given up on, and what they write
        self._head = torch.zeros(2, dtype=torch.int64)  # the publisher's epoch and ready count land here

    def connect(self, url: bytes) -> None:
        """Connect to the publisher's endpoint (once; another url later is a protocol error)."""
        if self._transport is not None:
            if url != self._url:
                raise ProtocolError("the publisher announced another one-sided endpoint than the one connected")
            return
        transport = _new_transport()
        try:
            transport.connect(url)
        except Exception as err:  # noqa: BLE001 - any backend failure to reach it
            transport.close(timeout=5.0)
            raise PeerFailure(f"cannot connect to the publisher's one-sided endpoint: {err}") from err
        self._transport, self._url = transport, url
        self._remote_cls = importlib.import_module("torch.distributed._transport.nixl").NIXLRemoteBuffer

    def remote(self, reg: Registration, offset: int, nbytes: int) -> Any:
        """The backend descriptor of ``nbytes`` at ``offset`` of ``reg``; ProtocolError outside it."""
        if offset < 0 or nbytes < 0 or offset + nbytes > reg.length:
            raise ProtocolError(f"{nbytes} bytes at {offset} are outside the publisher's {reg.length}-byte "
                                "registration")
        return self._remote_cls(reg.agent, reg.address + offset, nbytes, reg.device, reg.memory, reg.metadata)

    def _key(self, t: torch.Tensor) -> tuple[int, int, str]:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes(), str(t.device)

    def _memory(self, t: torch.Tensor) -> tuple[Any, int]:
        """``t``'s storage registered (once; the least recently used past :data:`LOCAL_KEPT` go, unless
        a read given up on may still write them) and ``t``'s offset in it."""
        key = self._key(t)
        memory = self._local.get(key)
        if memory is None:
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            memory = self._transport.register_memory(whole)
            self._local[key] = memory
            for old in [k for k in self._local if k != key][: max(0, len(self._local) - LOCAL_KEPT)]:
                if not self._writes(old):
                    self._transport.unregister_memory(self._local.pop(old))
        self._local.move_to_end(key)
        return memory, t.data_ptr() - key[0]

    def _writes(self, key: tuple[int, int, str]) -> bool:
        """A read given up on may still write storage ``key``."""
        self._stale = [(w, k) for w, k in self._stale if not w.is_completed()]
        return any(k == key for _, k in self._stale)

    def ready_for(self, into: torch.Tensor, deadline: float) -> None:
        """Before reading into ``into``: every read given up on that may write its storage ended
        (waited for until ``deadline``); LocalFailure when one still may (nothing is read into it)."""
        key = self._key(into)
        while self._writes(key):
            if time.monotonic() > deadline:
                raise LocalFailure("a one-sided read given up on may still write this member's receive memory: "
                                   "it is not read into until that read ends")
            time.sleep(POLL_MAX)

    def read(self, into: torch.Tensor, remote: Any, deadline: float, cancelled: Callable[[], bool] | None,
             what: str) -> None:
        """Read ``into.numel()`` bytes of ``remote`` into ``into`` (uint8, contiguous), by ``deadline``.
        PeerFailure when the read fails or outlives it, Cancelled when ``cancelled()`` says so; the
        read is then kept until it ends (see the module docstring)."""
        memory, offset = self._memory(into)
        view = memory.to_mutable_view(offset, into.numel())
        left = max(deadline - time.monotonic(), 1e-3)
        try:
            work = self._transport.read(view, remote, async_op=True, timeout=left)
        except Exception as err:  # noqa: BLE001 - refused before a byte moved (outside the registration, say)
            raise PeerFailure(f"the one-sided read of {what} was refused: {err}") from err
        pause = POLL_MIN
        while not work.is_completed():
            if cancelled is not None and cancelled():
                self._stale.append((work, self._key(into)))
                raise Cancelled("the publisher gave up on this version")
            if time.monotonic() > deadline:
                self._stale.append((work, self._key(into)))
                raise PeerFailure(f"the one-sided read of {what} did not end in time")
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX)
        error = work.exception()
        if error is not None:
            raise PeerFailure(f"the one-sided read of {what} failed: {error}")

    def head(self, reg: Registration, deadline: float, cancelled: Callable[[], bool] | None) -> tuple[int, int]:
        """The publisher's buffer header's epoch and ready count (16 bytes at ``EPOCH_AT``)."""
        from weightsync.planes.shm.plane import EPOCH_AT
        self.read(self._head.view(torch.uint8), self.remote(reg, EPOCH_AT, 16), deadline, cancelled,
                  "the publisher's buffer header")
        return int(self._head[0]), int(self._head[1])

    def busy(self) -> int:
        """Reads given up on that may still write (tests look)."""
        self._stale = [(w, k) for w, k in self._stale if not w.is_completed()]
        return len(self._stale)

    def close(self) -> None:
        """Let go of the endpoint: waits (bounded) for reads given up on; memory they may still write
        stays referenced by the backend's registrations until it closes."""
        transport, self._transport = self._transport, None
        if transport is None:
            return
        try:
            transport.close(timeout=5.0)
        except Exception:  # noqa: BLE001 - a read still pends: its memory stays held with the agent
            _held.append(transport)
        self._local.clear()
        self._stale.clear()


#: endpoints whose close timed out with a read still pending: kept, so the memory it writes stays alive
_held: list[Any] = []
