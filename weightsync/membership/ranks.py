"""A sharded publisher's trainer ranks: how they find each other and agree on each put.

Rank 0's control server is the ranks' meeting point. Every other rank connects to it as an
authenticated connection of kind ``"rank"`` (the same door, secret and MACs as subscribers;
never a member of a generation) and uses its table through ``StoreOp``s; rank 0 uses the same
table directly. Keys (under ``@ranks/``, which only rank connections may touch; the data plane's
rendezvous keys start with ``ws/``):

- ``lane/<r>``: rank r's own listening address (its lane; subscribers get the list in Admit);
- ``put/<v>/<r>``: rank r's digest of version v (the version and the global manifest) and the
  bytes it owns: every rank's put waits for all of them and refuses to send on any difference;
- ``done/<v>/<r>``: what became of rank r's lane of version v: every rank's handle resolves
  once all lanes said (so a report means every rank's part arrived);
- ``dead/<r>``: rank 0 saw rank r's connection close or fall silent; waits for r end now.

Nothing here runs on the event loop: the publisher calls it from a worker thread.
"""

from __future__ import annotations

import datetime as dt
import socket
import struct
import threading
import time
from collections import deque
from typing import Any

import torch

from weightsync import _wire
from weightsync._errors import ControlFailure, KeyTimeout
from weightsync.control.client import ControlClient
from weightsync.control.rendezvous import KeyValue, LocalStore, RemoteStore
from weightsync.errors import PublisherGone, RankMismatch, SyncTimeout, WeightSyncError
from weightsync.options import is_loopback, parse_address
from weightsync.recorder.recorder import RecorderScope

PREFIX = "@ranks/"
SLICE = 0.5  # seconds: a wait for other ranks looks for dead ranks this often
KEEP_VERSIONS = 16  # a rank keeps its keys of this many latest puts (the others may still read them)
_OWNED = struct.Struct("<Q")


def rank_member(rank: int) -> str:
    return f"rank-{rank}"


def rank_of(member_id: str, world: int) -> int | None:
    """The trainer rank a ``"rank"`` connection speaks for, or None when its id names none."""
    head, _, tail = member_id.partition("-")
    if head != "rank" or not tail.isdigit():
        return None
    rank = int(tail)
    return rank if 0 < rank < world else None


class Ranks:
    """One rank's view of the others, over the table (rank 0) or its connection to rank 0."""

    def __init__(self, channel: str, rank: int, world: int, store: Any, rec: RecorderScope,
                 timeout: float) -> None:
        self.channel, self.rank, self.world = channel, rank, world
        self._store, self._rec, self._timeout = store, rec, timeout
        self._history: deque[int] = deque()  # the versions this rank agreed on, oldest first

    # keys ---------------------------------------------------------------------------------------
    def _set(self, key: str, value: bytes) -> None:
        try:
            self._store.set(PREFIX + key, value)
        except RuntimeError as err:
            raise self._gone(err) from err

    def _gone(self, err: BaseException) -> WeightSyncError:
        return PublisherGone(f"trainer rank 0 cannot be reached: {err}", channel=self.channel)

    def _wait(self, keys: list[str], deadline: float, what: str) -> dict[str, bytes]:
        """Every key's value; SyncTimeout naming the ranks that did not answer, or naming a dead one."""
        values: dict[str, bytes] = {}
        while True:
            missing = [k for k in keys if k not in values]
            for key in missing:
                try:
                    if self._store.check([PREFIX + key]):
                        values[key] = self._store.get(PREFIX + key)
                except RuntimeError as err:
                    raise self._gone(err) from err
            missing = [k for k in keys if k not in values]
            if not missing:
                return values
            ranks = [int(k.rsplit("/", 1)[1]) for k in missing]
            for key, r in zip(missing, ranks, strict=True):
                try:
                    dead = self._store.check([f"{PREFIX}dead/{r}"])
                    reason = self._store.get(f"{PREFIX}dead/{r}").decode(errors="replace") if dead else ""
                    # a rank may say its word and leave between our two looks: its word counts
                    if dead and self._store.check([PREFIX + key]):
                        values[key] = self._store.get(PREFIX + key)
                        continue
                except RuntimeError as err:
                    raise self._gone(err) from err
                if dead:
                    self._rec.record("rank", peers=(rank_member(r),)).fail(f"{what}: rank {r} is gone: {reason}")
                    raise PublisherGone(f"{what}: trainer rank {r} is gone ({reason})", channel=self.channel)
            missing = [k for k in keys if k not in values]
            if not missing:
                return values
            ranks = [int(k.rsplit("/", 1)[1]) for k in missing]
            left = deadline - time.monotonic()
            if left <= 0:
                self._rec.record("rank", peers=tuple(rank_member(r) for r in ranks)).fail(f"{what}: no answer")
                raise SyncTimeout(f"{what}: trainer ranks {ranks} did not answer within the deadline",
                                  channel=self.channel)
            try:
                self._store.wait([PREFIX + missing[0]], _td(min(SLICE, left)))
            except KeyTimeout:
                pass  # one slice without it: look again (and for a dead rank's word)
            except RuntimeError as err:
                raise self._gone(err) from err

    # what the publisher calls -------------------------------------------------------------------
    def register(self, address: str) -> None:
        self._set(f"lane/{self.rank}", address.encode())

    def lanes(self, timeout: float) -> tuple[str, ...]:
        """Ranks 1..W-1's addresses, once all of them registered."""
        keys = [f"lane/{r}" for r in range(1, self.world)]
        values = self._wait(keys, time.monotonic() + timeout, "starting")
        return tuple(values[k].decode() for k in keys)

    def agree(self, version: int, digest: bytes, owned: int, payload: int, timeout: float) -> None:
        """Every rank puts ``version`` with the same global manifest, and the ranks' pieces add up
        to the full tensors; raises RankMismatch (before anything is sent) or SyncTimeout."""
        self._set(f"put/{version}/{self.rank}", digest + _OWNED.pack(owned))
        keys = [f"put/{version}/{r}" for r in range(self.world)]
        values = self._wait(keys, time.monotonic() + timeout, f"version {version}")
        differ = [r for r in range(self.world) if values[keys[r]][:-_OWNED.size] != digest]
        if differ:
            self._rec.record("rank", version=version, peers=tuple(rank_member(r) for r in differ)).fail(
                "a different version or manifest")
            raise RankMismatch(f"version {version}: trainer ranks {differ} put other tensors (names, dtypes or "
                               f"global shapes) than rank {self.rank}: nothing was sent", channel=self.channel,
                               version=version)
        total = sum(_OWNED.unpack(values[k][-_OWNED.size:])[0] for k in keys)
        if total != payload:
            raise RankMismatch(f"version {version}: the ranks' pieces add up to {total} bytes, the full tensors "
                               f"hold {payload}: placements overlap or leave bytes out; nothing was sent",
                               channel=self.channel, version=version)
        self._history.append(version)
        while len(self._history) > KEEP_VERSIONS:  # bounded table: old agreements are done with
            self._forget(self._history.popleft())

    def _forget(self, version: int) -> None:
        for key in (f"put/{version}/{self.rank}", f"done/{version}/{self.rank}"):
            try:
                self._store.delete_key(PREFIX + key)
            except RuntimeError:
                pass

    def delivered(self, version: int, status: str) -> None:
        self._set(f"done/{version}/{self.rank}", status.encode())

    def outcome(self, version: int, timeout: float) -> dict[int, str]:
        """Every rank's word on its lane of ``version`` (``"ok"``, ``"superseded"`` or an error)."""
        keys = [f"done/{version}/{r}" for r in range(self.world)]
        values = self._wait(keys, time.monotonic() + timeout, f"delivering version {version}")
        return {r: values[keys[r]].decode(errors="replace") for r in range(self.world)}


def _td(seconds: float) -> dt.timedelta:
    return dt.timedelta(seconds=max(seconds, 0.001))


class Hub:
    """Rank 0: the other ranks' connections to its control server."""

    def __init__(self, channel: str, world: int, table: KeyValue, rec: RecorderScope) -> None:
        self.channel, self.world, self._table, self._rec = channel, world, table, rec
        self._live: dict[int, str] = {}  # rank -> incarnation
        self._lock = threading.Condition()

    def store(self, timeout: float) -> LocalStore:
        return LocalStore(self._table, timeout)

    def accept(self, member_id: str, incarnation: str) -> int | None:
        """A ``"rank"`` connection passed the door: the rank it speaks for, or None to refuse it."""
        rank = rank_of(member_id, self.world)
        if rank is None:
            self._rec.record("rank", peers=(member_id[:64],)).fail(f"not a rank of {self.world}")
            return None
        with self._lock:
            if rank in self._live:
                self._rec.record("rank", peers=(member_id,)).fail("a second connection for this rank")
                return None
            self._live[rank] = incarnation
        self._table.delete(f"{PREFIX}dead/{rank}")
        self._rec.record("rank", peers=(member_id,)).complete()
        return rank

    def lost(self, member_id: str, reason: str) -> None:
        """Its connection closed or fell silent: every wait for that rank ends now."""
        rank = rank_of(member_id, self.world)
        if rank is None:
            return
        with self._lock:
            self._live.pop(rank, None)
            self._lock.notify_all()
        if reason != "left":
            self._rec.record("rank", peers=(member_id,)).fail(reason)
        self._table.set(f"{PREFIX}dead/{rank}", reason.encode()[:200])


    def wait_gone(self, timeout: float) -> bool:
        """Rank 0's close: until every other rank left (they may still read its table), within ``timeout``."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._live, max(timeout, 0.0))


class Link:
    """Rank r > 0: its authenticated connection to rank 0, with heartbeats both ways."""

    def __init__(self, channel: str, rank: int, *, host: str, port: int, secret: bytes | None,
                 fingerprint: _wire.Fingerprint, rec: RecorderScope, timeout: float) -> None:
        self.channel, self.rank = channel, rank
        self._args = dict(host=host, port=port, secret=secret, fingerprint=fingerprint, recorder=rec,
                          send_timeout=timeout)
        self._rec, self._timeout = rec, timeout
        self.client: ControlClient | None = None
        self._stop = threading.Event()
        self._beater: threading.Thread | None = None

    def connect(self, timeout: float) -> None:
        """Connect to rank 0 (retrying while it is not listening yet) and wait for its Admit."""
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            client = ControlClient(self.channel, rank_member(self.rank), transport="rank", **self._args)  # type: ignore[arg-type]
            try:
                client.connect(max(deadline - time.monotonic(), 0.1))
                reply = client.commands.get(timeout=max(deadline - time.monotonic(), 0.1))
            except (ControlFailure, Exception) as err:  # noqa: BLE001 - retried until the deadline
                client.close("retrying")
                last = err
                self._stop.wait(0.2)
                continue
            if isinstance(reply, _wire.Admit):
                self.client = client
                self._beater = threading.Thread(target=self._beat, args=(reply.settings.heartbeat_interval,),
                                                name=f"ws-{self.channel}-rank-beat", daemon=True)
                self._beater.start()
                return
            client.close("refused")
            reason = getattr(reply, "reason", type(reply).__name__)
            raise PublisherGone(f"trainer rank 0 refused rank {self.rank}: {reason}", channel=self.channel)
        raise PublisherGone(f"trainer rank 0 did not admit rank {self.rank} within {timeout:.3g}s: {last}",
                            channel=self.channel)

    def store(self, timeout: float) -> RemoteStore:
        assert self.client is not None
        return RemoteStore(self.client, timeout)

    def _beat(self, interval: float) -> None:
        client = self.client
        assert client is not None
        while not self._stop.wait(interval) and not client.closed.is_set():
            try:
                client.send(_wire.Beat())
            except ControlFailure:
                return

    def close(self) -> None:
        self._stop.set()
        if self.client is not None:
            try:
                self.client.goodbye(_wire.Leave(member_id=rank_member(self.rank)))
            except ControlFailure:
                pass
            self.client.close("rank closed")
        if self._beater is not None:
            self._beater.join(timeout=self._timeout)


def rank_and_world(rank: int | None, world_size: int | None, group: Any) -> tuple[int, int]:
    if group is not None:
        import torch.distributed as dist

        if rank is not None or world_size is not None:
            raise ValueError("pass group= or rank= and world_size=, not both")
        return dist.get_rank(group), dist.get_world_size(group)
    world = 1 if world_size is None else world_size
    rank = 0 if rank is None else rank
    for what, value in (("rank", rank), ("world_size", world)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of world_size {world}: need world_size >= 1 and 0 <= rank < world_size")
    return rank, world


def addresses(rank: int, address: str, lane_address: str | None, group: Any
              ) -> tuple[tuple[str, int], tuple[str, int] | None]:
    """(where this rank listens, where rank 0 listens or None). Rank 0 listens at ``address``;
    on other ranks ``address`` is rank 0's and this rank listens at ``lane_address`` (default:
    port 0 on the interface that reaches rank 0)."""
    bind = parse_address(address)
    if rank == 0:
        return bind, None
    if bind[1] == 0 and group is None:
        raise ValueError(f"rank {rank}: address must be rank 0's 'host:port' (its pub.address), "
                         "or pass group= to learn it from rank 0")
    return parse_address(lane_address or f"{lane_host(bind[0])}:0"), bind


def lane_host(rank0_host: str) -> str:
    """Where a rank > 0 listens by default: loopback beside a loopback rank 0, else the address of
    this host's interface that reaches rank 0 (what members reach it by: on every interface, the
    address a rank would hand out is its host name's, which often resolves to 127.0.1.1)."""
    if is_loopback(rank0_host):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((rank0_host, 9))  # a datagram socket's connect sends nothing: it picks the route
            return str(probe.getsockname()[0])
    except OSError:
        return "0.0.0.0"


ADDRESS_BYTES = 512


def share_address(group: Any, address: str) -> str:
    """Rank 0's address, broadcast over the trainer ranks' own group as bytes (no pickle)."""
    import torch.distributed as dist

    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    buf = torch.zeros(ADDRESS_BYTES, dtype=torch.uint8, device=device)
    if address:
        data = address.encode()
        if len(data) >= ADDRESS_BYTES:
            raise ValueError(f"address {address[:40]!r}... is too long to share")
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
    raw = bytes(buf.cpu().tolist())
    return raw.split(b"\0", 1)[0].decode()
