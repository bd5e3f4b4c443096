"""The data plane's rendezvous store, served by the publisher from memory.

gloo and NCCL form a group by exchanging addresses through a c10d Store. weightsync no longer
hosts a TCPStore for that (anyone who could reach it could read, write or flood it): the
publisher keeps a small key-value table (:class:`KeyValue`) and its members reach it only
through their authenticated control connection. Two adapters make it a c10d Store:

- :class:`LocalStore`, the publisher's own view (no network);
- :class:`RemoteStore`, a member's view: each call is a ``StoreOp`` over the control
  connection, answered with a ``StoreResult`` (a ``get`` of a key not there yet waits on the
  publisher's side, bounded).

Bounds: at most ``MAX_KEYS`` keys of at most ``MAX_VALUE`` bytes; keys set during generation g
are forgotten once generation g + 2 begins (:meth:`KeyValue.begin_generation`). Every key lives
under the generation's random prefix, so nobody can pre-write a future generation's keys.

The Store subclass needs its Python object alive while torch holds it (the pybind trampoline
looks its methods up on it): owners keep a reference.
"""

from __future__ import annotations

import datetime as dt
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from weightsync import _wire
from weightsync._errors import ControlFailure

MAX_KEYS = 4096
MAX_VALUE = 1 << 20


PERSISTENT = 1 << 62  # the generation stamp of keys begin_generation never drops


class KeyValue:
    """The publisher's table. Thread-safe; ``on_set`` waiters are called outside the lock."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._data: dict[str, tuple[bytes, int]] = {}  # key -> (value, generation it was set in)
        self._generation = 0
        self._waiters: list[tuple[tuple[str, ...], float, Callable[[bool], None]]] = []
        self._closed = False

    def close(self) -> None:
        """The publisher stops: every wait ends now, unanswered (a group still forming with a member
        that died gives up at once, instead of holding the close for its rendezvous deadline)."""
        with self._cond:
            self._closed = True
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
        for _keys, _deadline, callback in waiters:
            callback(False)

    def begin_generation(self, generation: int) -> None:
        """Keys of generations before ``generation - 1`` are dropped (bounded memory)."""
        with self._cond:
            self._generation = generation
            self._data = {k: v for k, v in self._data.items() if v[1] >= generation - 1}

    def set(self, key: str, value: bytes) -> None:
        if len(value) > MAX_VALUE:
            raise ValueError(f"rendezvous value of {len(value)} bytes exceeds {MAX_VALUE}")
        with self._cond:
            if key not in self._data and len(self._data) >= MAX_KEYS:
                raise ValueError(f"rendezvous table full ({MAX_KEYS} keys)")
            # the trainer ranks' keys (``transport.ranks``) outlive generations; they delete their own
            self._data[key] = (bytes(value), PERSISTENT if key.startswith("@ranks/") else self._generation)
            self._cond.notify_all()
            ready = [w for w in self._waiters if all(k in self._data for k in w[0])]
            self._waiters = [w for w in self._waiters if w not in ready]
        for _keys, _deadline, callback in ready:
            callback(True)

    def get_now(self, key: str) -> bytes | None:
        with self._cond:
            entry = self._data.get(key)
            return None if entry is None else entry[0]

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            value = int(self._data.get(key, (b"0", 0))[0]) + amount
        self.set(key, str(value).encode())
        return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """c10d's compareSet: set ``desired`` if the value is ``expected`` (absent counts as b"")."""
        with self._cond:
            current = self._data.get(key)
            if current is None and expected:
                return expected
            if current is not None and current[0] != expected:
                return current[0]
        self.set(key, desired)
        return desired

    def check(self, keys: tuple[str, ...]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def delete(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None

    def wait(self, keys: tuple[str, ...], timeout: float) -> bool:
        """Block (a local caller) until every key is set; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closed or all(k in self._data for k in keys),
                                       max(timeout, 0.0)) and not self._closed

    def when_set(self, keys: tuple[str, ...], timeout: float, callback: Callable[[bool], None]) -> None:
        """Call ``callback(True)`` once every key is set, or ``callback(False)`` at ``expire``."""
        with self._cond:
            closed = self._closed
            if not closed and not all(k in self._data for k in keys):
                self._waiters.append((keys, time.monotonic() + timeout, callback))
                return
        callback(not closed)

    def expire(self) -> None:
        """Fail the waiters whose deadline passed (the server calls this periodically)."""
        now = time.monotonic()
        with self._cond:
            late = [w for w in self._waiters if w[1] <= now]
            self._waiters = [w for w in self._waiters if w[1] > now]
        for _keys, _deadline, callback in late:
            callback(False)

    def serve(self, op: _wire.StoreOp, reply: Callable[[_wire.StoreResult], None]) -> None:
        """Answer a member's StoreOp (the control server's thread); never blocks."""
        try:
            if op.op == "set":
                self.set(op.keys[0], op.value)
                reply(_wire.StoreResult(op.rid, True))
            elif op.op == "add":
                reply(_wire.StoreResult(op.rid, True, number=self.add(op.keys[0], op.amount)))
            elif op.op == "compare_set":
                reply(_wire.StoreResult(op.rid, True, value=self.compare_set(op.keys[0], op.value, op.desired)))
            elif op.op == "check":
                reply(_wire.StoreResult(op.rid, True, number=int(self.check(op.keys))))
            elif op.op == "delete":
                reply(_wire.StoreResult(op.rid, True, number=int(self.delete(op.keys[0]))))
            elif op.op in ("get", "wait"):
                def done(ok: bool) -> None:
                    value = (self.get_now(op.keys[0]) or b"") if op.op == "get" and ok else b""
                    reply(_wire.StoreResult(op.rid, ok, value=value, error="" if ok else "wait timeout"))

                self.when_set(op.keys, min(op.timeout, 3600.0), done)
            else:
                reply(_wire.StoreResult(op.rid, False, error=f"unknown store op {op.op!r}"))
        except (ValueError, IndexError) as err:
            reply(_wire.StoreResult(op.rid, False, error=str(err)))


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
            raise RuntimeError(f"wait timeout for rendezvous key {key!r}")
        return result.value

    def add(self, key: str, amount: int) -> int:
        return self._call("add", (key,), amount=amount).number

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", tuple(keys)).number)

    def wait(self, keys: list[str], timeout: dt.timedelta | None = None) -> None:
        seconds = timeout.total_seconds() if timeout is not None else self._deadline()
        if not self._call("wait", tuple(keys), timeout=seconds).ok:
            raise RuntimeError(f"wait timeout for rendezvous keys {keys}")

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call("compare_set", (key,), value=_as_bytes(expected), desired=_as_bytes(desired)).value

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete", (key,)).number)

    def deleteKey(self, key: str) -> bool:  # noqa: N802 - c10d's trampoline looks this name up
        return self.delete_key(key)

    def num_keys(self) -> int:
        raise RuntimeError("num_keys is not offered by the weightsync rendezvous store")

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
            raise RuntimeError(results[0].error)
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
            raise RuntimeError(f"rendezvous store unreachable: {err}") from err
        if not result.ok and op not in ("get", "wait"):
            raise RuntimeError(result.error)
        return result
