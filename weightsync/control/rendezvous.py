"""The data plane's rendezvous store, served by the publisher from memory.

gloo and NCCL form a group by exchanging addresses through a c10d Store. weightsync no longer
hosts a TCPStore for that (anyone who could reach it could read, write or flood it): the
publisher keeps a small key-value table (:class:`KeyValue`) and its members reach it only
through their authenticated control connection. Two adapters make it a c10d Store:

- :class:`LocalStore`, the publisher's own view (no network);
- :class:`RemoteStore`, a member's view: each call is a ``StoreOp`` over the control
  connection, answered with a ``StoreResult`` (a ``get`` of a key not there yet waits on the
  publisher's side, bounded).

Bounds: at most ``MAX_KEYS`` keys of at most ``MAX_VALUE`` bytes and ``MAX_KEY`` bytes of name;
keys set during generation g are forgotten once generation g + 2 begins
(:meth:`KeyValue.begin_generation`). Every key lives under the generation's random prefix, so
nobody can pre-write a future generation's keys.

A member speaks only for itself here too (:func:`store_problem`, checked by the control server
before anything reaches the table): it may read only its current generation's keys, and write
only its own: a key whose last path component is a rank number belongs to that rank (gloo's
full mesh and the in-place re-form on 2.14+ name every rank's address ``.../0/<rank>``,
measured on 2.13 and 2.15); any other key to whoever set it first. A member owns at most
``MAX_MEMBER_KEYS`` keys and waits on at most ``MAX_MEMBER_WAITS`` at once
(``MAX_WAITS`` in all); its waits end with its connection, and last no longer than its bound.

The Store subclass needs its Python object alive while torch holds it (the pybind trampoline
looks its methods up on it): owners keep a reference.
"""

from __future__ import annotations

import datetime as dt
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from weightsync import _wire
from weightsync._errors import ControlFailure, KeyTimeout, StoreError
from weightsync.options import UNBOUNDED

MAX_KEYS = 4096
MAX_VALUE = 1 << 20
MAX_KEY = 512  # bytes of a key's name (gloo's are under 100)
MAX_MEMBER_KEYS = 64  # keys one member may own at once (it sets one per generation)
MAX_MEMBER_WAITS = 64  # waits one connection may have outstanding
MAX_WAITS = 4096  # outstanding waits in all
RANKS_PREFIX = "@ranks/"  # the trainer ranks' own keys (``membership.ranks``)
PROBE_KEY = "ws/__probe__"  # what a store clone checks first (``_torch_compat.clone_store``)
WRITES = ("set", "add", "compare_set", "delete")


@dataclass(frozen=True)
class Scope:
    """What one member may touch: the keys of its current generation, and of those its own."""

    prefixes: tuple[str, ...]
    rank: int
    # the previous generation's prefixes: readable still (a member finishing its last transfer there
    # may connect a lazy pair late), never writable
    readable: tuple[str, ...] = ()


def store_problem(op: _wire.StoreOp, *, member: str, scope: Scope | None, rank_link: bool,
                  owner_of: Callable[[str], str | None]) -> str | None:
    """Why a member's ``op`` must be refused, or None (see the module docstring)."""
    for key in op.keys:
        if len(key.encode()) > MAX_KEY:
            return f"a key of {len(key.encode())} bytes (at most {MAX_KEY})"
    if rank_link:  # another trainer rank: only the ranks' own keys
        return None if all(k.startswith(RANKS_PREFIX) for k in op.keys) else "a trainer rank touches @ranks/ keys only"
    if any(k.startswith(RANKS_PREFIX) for k in op.keys):
        return "@ranks/ keys are the ranks' own"
    if op.op == "check" and op.keys == (PROBE_KEY,):
        return None
    if scope is None:
        return "not in a generation's group"
    allowed = scope.prefixes if op.op in WRITES else scope.prefixes + scope.readable
    outside = next((k for k in op.keys if not k.startswith(allowed)), None)
    if outside is not None:
        return f"key {outside[:80]!r} is not of this member's generation"
    if op.op in WRITES:
        key = op.keys[0]
        last = key.rsplit("/", 1)[-1]
        if last.isdigit():
            if int(last) != scope.rank:
                return f"rank {scope.rank} may not write rank {last}'s key"
        elif owner_of(key) not in (None, member):
            return "another member's key"
    return None


PERSISTENT = 1 << 62  # the generation stamp of keys begin_generation never drops


class KeyValue:
    """The publisher's table. Thread-safe; ``on_set`` waiters are called outside the lock."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._data: dict[str, tuple[bytes, int]] = {}  # key -> (value, generation it was set in)
        self._generation = 0
        # outstanding waits: (keys, deadline, callback, owner connection or ""), filed under a key still missing
        self._waiting: dict[str, list[tuple[tuple[str, ...], float, Callable[[bool], None], str]]] = {}
        self._waits: dict[str, int] = {}  # owner connection -> its outstanding waits
        self._owner: dict[str, str] = {}  # key -> the member that set it ("" or absent: the publisher)
        self._closed = False

    @property
    def _waiters(self) -> list[tuple[tuple[str, ...], float, Callable[[bool], None], str]]:
        return [w for ws in self._waiting.values() for w in ws]

    def waiting(self, owner: str | None = None) -> int:
        """Outstanding waits (of ``owner``'s connection, or in all)."""
        with self._cond:
            return sum(self._waits.values()) if owner is None else self._waits.get(owner, 0)

    def owner(self, key: str) -> str | None:
        with self._cond:
            return self._owner.get(key) if key in self._data else None

    def _file(self, waiter: tuple[tuple[str, ...], float, Callable[[bool], None], str]) -> bool:
        """File ``waiter`` under a key it still lacks; False when it lacks none (it is ready)."""
        missing = next((k for k in waiter[0] if k not in self._data), None)
        if missing is None:
            return False
        self._waiting.setdefault(missing, []).append(waiter)
        return True

    def _unfiled(self, waiter: tuple[tuple[str, ...], float, Callable[[bool], None], str]) -> None:
        owner = waiter[3]
        left = self._waits.get(owner, 0) - 1
        if left > 0:
            self._waits[owner] = left
        else:
            self._waits.pop(owner, None)

    def forget(self, owner: str) -> None:
        """A connection closed: its waits go with it, unanswered (nobody is left to answer)."""
        with self._cond:
            for key in list(self._waiting):
                kept = [w for w in self._waiting[key] if w[3] != owner]
                if kept:
                    self._waiting[key] = kept
                else:
                    del self._waiting[key]
            self._waits.pop(owner, None)

    def close(self) -> None:
        """The publisher stops: every wait ends now, unanswered (a group still forming with a member
        that died gives up at once, instead of holding the close for its rendezvous deadline)."""
        with self._cond:
            self._closed = True
            waiters = self._waiters
            self._waiting, self._waits = {}, {}
            self._cond.notify_all()
        for _keys, _deadline, callback, _owner in waiters:
            callback(False)

    def begin_generation(self, generation: int) -> None:
        """Keys of generations before ``generation - 1`` are dropped (bounded memory)."""
        with self._cond:
            self._generation = generation
            self._data = {k: v for k, v in self._data.items() if v[1] >= generation - 1}
            self._owner = {k: m for k, m in self._owner.items() if k in self._data}

    def set(self, key: str, value: bytes, member: str = "") -> None:
        """Set ``key`` (``member``: the member that sets it, "" for the publisher or a trainer rank)."""
        if len(value) > MAX_VALUE:
            raise ValueError(f"rendezvous value of {len(value)} bytes exceeds {MAX_VALUE}")
        if len(key.encode()) > MAX_KEY:
            raise ValueError(f"a rendezvous key of {len(key.encode())} bytes exceeds {MAX_KEY}")
        ready = []
        with self._cond:
            if key not in self._data and len(self._data) >= MAX_KEYS:
                raise ValueError(f"rendezvous table full ({MAX_KEYS} keys)")
            if member and key not in self._data and \
                    sum(1 for m in self._owner.values() if m == member) >= MAX_MEMBER_KEYS:
                raise ValueError(f"{member} owns {MAX_MEMBER_KEYS} rendezvous keys already")
            # the trainer ranks' keys (``membership.ranks``) outlive generations; they delete their own
            self._data[key] = (bytes(value), PERSISTENT if key.startswith(RANKS_PREFIX) else self._generation)
            if member:
                self._owner.setdefault(key, member)
            self._cond.notify_all()
            for waiter in self._waiting.pop(key, []):  # only the waits filed under this key are looked at
                if not self._file(waiter):
                    self._unfiled(waiter)
                    ready.append(waiter)
        for _keys, _deadline, callback, _owner in ready:
            callback(True)

    def get_now(self, key: str) -> bytes | None:
        with self._cond:
            entry = self._data.get(key)
            return None if entry is None else entry[0]

    def add(self, key: str, amount: int, member: str = "") -> int:
        with self._cond:
            value = int(self._data.get(key, (b"0", 0))[0]) + amount
        self.set(key, str(value).encode(), member)
        return value

    def compare_set(self, key: str, expected: bytes, desired: bytes, member: str = "") -> bytes:
        """c10d's compareSet: set ``desired`` if the value is ``expected`` (absent counts as b"")."""
        with self._cond:
            current = self._data.get(key)
            if current is None and expected:
                return expected
            if current is not None and current[0] != expected:
                return current[0]
        self.set(key, desired, member)
        return desired

    def check(self, keys: tuple[str, ...]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def delete(self, key: str) -> bool:
        with self._cond:
            self._owner.pop(key, None)
            return self._data.pop(key, None) is not None

    def wait(self, keys: tuple[str, ...], timeout: float) -> bool:
        """Block (a local caller) until every key is set; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closed or all(k in self._data for k in keys),
                                       max(timeout, 0.0)) and not self._closed

    def when_set(self, keys: tuple[str, ...], timeout: float, callback: Callable[[bool], None],
                 owner: str = "") -> None:
        """Call ``callback(True)`` once every key is set, or ``callback(False)`` at ``expire``.

        ``owner``: the connection asking (its waits are bounded, and go when it closes); ValueError
        when it, or the table, has as many outstanding as allowed.
        """
        with self._cond:
            closed = self._closed
            waiter = (keys, time.monotonic() + timeout, callback, owner)
            if not closed and any(k not in self._data for k in keys):
                if owner and self._waits.get(owner, 0) >= MAX_MEMBER_WAITS:
                    raise ValueError(f"{MAX_MEMBER_WAITS} rendezvous waits outstanding already")
                if sum(self._waits.values()) >= MAX_WAITS:
                    raise ValueError(f"{MAX_WAITS} rendezvous waits outstanding in all")
                self._file(waiter)
                self._waits[owner] = self._waits.get(owner, 0) + 1
                return
        callback(not closed)

    def expire(self) -> None:
        """Fail the waiters whose deadline passed (the server calls this periodically)."""
        now = time.monotonic()
        late = []
        with self._cond:
            for key in list(self._waiting):
                waiters = self._waiting[key]
                late += [w for w in waiters if w[1] <= now]
                kept = [w for w in waiters if w[1] > now]
                if kept:
                    self._waiting[key] = kept
                else:
                    del self._waiting[key]
            for waiter in late:
                self._unfiled(waiter)
        for _keys, _deadline, callback, _owner in late:
            callback(False)

    def serve(self, op: _wire.StoreOp, reply: Callable[[_wire.StoreResult], None], *, member: str = "",
              owner: str = "", bound: float = UNBOUNDED) -> bool:
        """Answer a StoreOp (the control server's thread); never blocks. ``member`` sets keys in its
        name, ``owner`` (its connection) holds the waits, each at most ``bound`` seconds. False when
        it was refused (over a bound, a malformed op): the server counts those."""
        try:
            if not op.keys:
                raise ValueError("a store op without keys")
            if op.op == "set":
                self.set(op.keys[0], op.value, member)
                reply(_wire.StoreResult(op.rid, True))
            elif op.op == "add":
                reply(_wire.StoreResult(op.rid, True, number=self.add(op.keys[0], op.amount, member)))
            elif op.op == "compare_set":
                reply(_wire.StoreResult(op.rid, True, value=self.compare_set(op.keys[0], op.value, op.desired,
                                                                             member)))
            elif op.op == "check":
                reply(_wire.StoreResult(op.rid, True, number=int(self.check(op.keys))))
            elif op.op == "delete":
                reply(_wire.StoreResult(op.rid, True, number=int(self.delete(op.keys[0]))))
            elif op.op in ("get", "wait"):
                def done(ok: bool) -> None:
                    value = (self.get_now(op.keys[0]) or b"") if op.op == "get" and ok else b""
                    reply(_wire.StoreResult(op.rid, ok, value=value, error="" if ok else "wait timeout"))

                self.when_set(op.keys, min(max(op.timeout, 0.0), bound), done, owner)
            else:
                reply(_wire.StoreResult(op.rid, False, error=f"unknown store op {op.op!r}"))
                return False
        except (ValueError, IndexError) as err:
            reply(_wire.StoreResult(op.rid, False, error=str(err)))
            return False
        return True


def _as_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class _StoreBase(dist.Store):
    """A c10d Store over some backend; see the module docstring. Methods follow c10d's names."""

    def __init__(self, timeout: float) -> None:
        super().__init__()
        self._timeout = timeout
        self.set_timeout(dt.timedelta(seconds=timeout))

    def _deadline(self) -> float:
        timeout = getattr(self, "timeout", None)  # c10d's own, which set_timeout() changes
        return timeout.total_seconds() if isinstance(timeout, dt.timedelta) else self._timeout

    def _call(self, op: str, keys: tuple[str, ...], *, value: bytes = b"", amount: int = 0,
              timeout: float = 0.0, desired: bytes = b"") -> _wire.StoreResult:
        raise NotImplementedError

    def set(self, key: str, value: Any) -> None:
        self._call("set", (key,), value=_as_bytes(value))

    def get(self, key: str) -> bytes:
        result = self._call("get", (key,), timeout=self._deadline())
        if not result.ok:
            raise KeyTimeout(f"wait timeout for rendezvous key {key!r}")
        return result.value

    def add(self, key: str, amount: int) -> int:
        return self._call("add", (key,), amount=amount).number

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", tuple(keys)).number)

    def wait(self, keys: list[str], timeout: dt.timedelta | None = None) -> None:
        seconds = timeout.total_seconds() if timeout is not None else self._deadline()
        if not self._call("wait", tuple(keys), timeout=seconds).ok:
            raise KeyTimeout(f"wait timeout for rendezvous keys {keys}")

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call("compare_set", (key,), value=_as_bytes(expected), desired=_as_bytes(desired)).value

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete", (key,)).number)

    def deleteKey(self, key: str) -> bool:  # noqa: N802 - c10d's trampoline looks this name up
        return self.delete_key(key)

    def num_keys(self) -> int:
        raise StoreError("num_keys is not offered by the weightsync rendezvous store")

    def getNumKeys(self) -> int:  # noqa: N802 - c10d's trampoline looks this name up
        return self.num_keys()


class LocalStore(_StoreBase):
    """The publisher's own view of its table."""

    def __init__(self, table: KeyValue, timeout: float) -> None:
        super().__init__(timeout)
        self._table = table

    def clone(self) -> LocalStore:
        return LocalStore(self._table, self._deadline())

    def _call(self, op: str, keys: tuple[str, ...], *, value: bytes = b"", amount: int = 0,
              timeout: float = 0.0, desired: bytes = b"") -> _wire.StoreResult:
        if op in ("get", "wait"):
            if not self._table.wait(keys, timeout):
                return _wire.StoreResult(0, False, error="wait timeout")
            return _wire.StoreResult(0, True, value=self._table.get_now(keys[0]) or b"" if op == "get" else b"")
        results: list[_wire.StoreResult] = []
        self._table.serve(_wire.StoreOp(0, op, keys, value=value, amount=amount, desired=desired), results.append)
        if not results[0].ok:
            raise StoreError(results[0].error)
        return results[0]


class RemoteStore(_StoreBase):
    """A member's view: every call is a StoreOp to the publisher, answered on the same connection."""

    _rids = itertools.count(1)

    def __init__(self, client: Any, timeout: float) -> None:
        super().__init__(timeout)
        self._client = client

    def clone(self) -> RemoteStore:
        return RemoteStore(self._client, self._deadline())

    def _call(self, op: str, keys: tuple[str, ...], *, value: bytes = b"", amount: int = 0,
              timeout: float = 0.0, desired: bytes = b"") -> _wire.StoreResult:
        rid = next(self._rids)
        try:
            call = _wire.StoreOp(rid, op, keys, value=value, amount=amount, timeout=timeout, desired=desired)
            result = self._client.call_store(call, timeout + self._deadline())
        except ControlFailure as err:
            raise StoreError(f"rendezvous store unreachable: {err}") from err
        if not result.ok and op not in ("get", "wait"):
            raise StoreError(result.error)
        return result
