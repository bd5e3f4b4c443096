"""The publisher's end of the control plane: one authenticated connection per member.

One thread (``ws-<channel>-control``) runs its own asyncio loop, never the application's: a
trainer that blocks its event loop for a whole training step still answers beats and joins.
Per connection, in order:

1. send a :class:`~weightsync._wire.Challenge` with a fresh nonce;
2. read the Join (at most ``HANDSHAKE_FRAME`` bytes, within ``handshake_timeout``); check it at
   the door (``auth.admission_problem``: proof, fingerprint, closing). A refusal is answered
   with Deny, recorded, and the connection closed. Otherwise the session key is derived and
   ``on_join`` hands the link to the Sender, which alone decides about duplicate ids;
3. read frames: each must carry the next sequence number and a valid MAC, or it is recorded
   (``reject``) and the connection closed at once (a member whose frame was lost is known dead
   now, not after its silence bound). Ready and Ack go to :attr:`replies` once their member id
   matches the link's; Leave goes to ``on_leave``; StoreOp is answered from the rendezvous
   table if the member may (``rendezvous.store_problem``); any valid frame is a sign of life.

Every ``heartbeat_interval / 2`` the loop beats to every member, expires rendezvous waits, and
reports each bound member whose connection closed or who fell silent for ``dead_after``, once
(``on_dead``). A closed connection is reported at once: a killed member is known dead in
milliseconds, not after missed heartbeats.

Bounds: at most ``MAX_PENDING`` connections may be mid-handshake, ``MAX_PENDING_PER_SOURCE`` of
them from one address (a flood from one host leaves room for the others' joins; a connection
turned away is told ``Deny(kind="busy")`` and its subscriber tries again); a member whose unsent
data exceeds ``MAX_BACKLOG`` (it stopped reading) is disconnected; frames are length-checked
first. Refused connections are aggregated in the flight recorder (the first of each source and
reason per ``refusals.WINDOW`` seconds, then one count), so a flood cannot push out the entries
about real work.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from weightsync import _wire
from weightsync._errors import ControlFailure
from weightsync.control import auth
from weightsync.control.engines import EngineTable
from weightsync.control.framing import (
    HANDSHAKE_FRAME,
    HEADER,
    MAX_FRAME,
    TO_CLIENT,
    TO_SERVER,
    BadFrame,
    Session,
    frame_length,
)
from weightsync.control.refusals import Refusals
from weightsync.control.rendezvous import KeyValue, Scope, store_problem
from weightsync.options import UNBOUNDED
from weightsync.recorder.recorder import RecorderScope

MAX_PENDING = 64
MAX_PENDING_PER_SOURCE = 16  # one address cannot take every handshake place: others can still join
MAX_BACKLOG = 512 << 20
MAX_OFFER = 16 << 10  # a PeerOffer's source (a plane's description of a buffer) larger than this is dropped
MAX_REFUSALS = 64  # store ops refused on one connection before it is closed (a member that keeps trying)


# a member's link time: what it took at least, from its answer to the newest round of probes, and
# at most, from the last three rounds. Each probe is written on a quiet link (no version moving:
# begin_transfer) and bounded both ways: the member times it from its first segment's arrival to
# its last by the kernel's stamps, which can only come out shorter than the link took, and the
# publisher from writing it to the answer, which can only come out longer (the smallest of three
# is still a bound, and a tighter one on a busy host). The least is fresh each round: one slow
# answer is not carried into the next versions' verdicts
PROBE_WINDOW = 3
MAX_UNANSWERED = 12  # probes a member left unanswered before they are forgotten


def link_bounds(newest: float, round_trips: Iterable[float]) -> tuple[float, float]:
    """A link's (least, most) seconds for one probe: the newest answer's own measure, and the
    shortest of its last round trips; the least never above the most.

    A link that carried a probe in ``most`` seconds lately can carry it that fast: a newer probe
    that took longer was slowed by something else. Measured on the emulated cluster (8 equal 300
    Mbit/s links, htb): a shaper whose tokens the version had just used paced the next probe to
    7.5 ms where rested ones passed theirs in 2; times 160 for a 20 MiB version, one healthy
    member's least came out at 1.2 s against the others' most of 0.3 s, past the 3x that flags a
    member. A link truly slower than the policy allows is slow in every round trip, its least too.
    """
    fastest = min(round_trips)
    return min(newest, fastest), fastest


@dataclass(eq=False)
class Link:
    """One member connection (an *incarnation*: a rejoin is a new one)."""

    incarnation: str
    member_id: str
    host: str
    pid: int
    session: Session
    writer: asyncio.StreamWriter
    last_heard: float = field(default_factory=time.monotonic)
    bound: bool = False  # the Sender accepted it as this member's current incarnation
    closed: bool = False
    reported: bool = False
    probes: dict[int, tuple[float, int, int]] = field(default_factory=dict)  # seq -> (when written, epoch, round)
    link_time: tuple[float, int] | None = None  # (low, round) of its newest answered probe
    round_trips: deque[float] = field(default_factory=lambda: deque(maxlen=PROBE_WINDOW))  # its last answers
    transport: str = "group"  # "shm": a same-host member that reads the publisher's shared memory
    want: tuple[_wire.Want, ...] | None = None  # a sliced member's boxes (it receives point to point)
    accepts: str | None = None  # the checkpoint format its engine loads ("": unquantized); None: any
    scope: Scope | None = None  # the rendezvous keys it may touch (its current generation's), set by grant()
    refusals: int = 0  # its store ops refused so far
    copied: tuple[int, int, int] = (-1, -1, -1)  # (generation, seq, bucket) it last copied out of a ring
    offer: tuple[int, bytes] | None = None  # a version it holds where other members may read it, and where


class ControlServer:
    """Owns the control thread and every member connection (see the module docstring).

    Callbacks run on the control thread and must not block: ``on_join(link)``,
    ``on_leave(link)``, ``on_dead(member_id, reason)``.
    """

    def __init__(self, channel: str, *, host: str, port: int, secret: bytes | None, mine: _wire.Fingerprint,
                 table: KeyValue, recorder: RecorderScope, heartbeat_interval: float, dead_after: float,
                 handshake_timeout: float, closing: Callable[[], bool], on_join: Callable[[Link], None],
                 on_leave: Callable[[Link], None], on_dead: Callable[[str, str], None],
                 shm_offer: Callable[[], _wire.ShmOffer | None] = lambda: None, planes: tuple[str, ...] = (),
                 unserved: Mapping[str, str] | None = None, rank_links: bool = False,
                 wait_bound: float = UNBOUNDED) -> None:
        self.channel, self._host, self._port = channel, host, port
        self._secret, self._mine, self._table, self._rec = secret, mine, table, recorder
        self._interval, self._dead_after, self._handshake_timeout = heartbeat_interval, dead_after, handshake_timeout
        self._closing, self._on_join, self._on_leave, self._on_dead = closing, on_join, on_leave, on_dead
        self._shm_offer = shm_offer
        self._planes = planes  # transports served beyond the group and shared memory (one-sided, registered planes)
        self._unserved = dict(unserved or {})  # transports known but not served here, and why
        self._wait_bound = wait_bound  # the longest a member's rendezvous wait may last (its deadline)
        self._rank_links = rank_links  # a sharded publisher's rank 0: the other ranks connect here too
        self.replies: queue.SimpleQueue[Any] = queue.SimpleQueue()  # Ready | Ack | Wake, for the Sender
        self.engines = EngineTable()  # what the members' inference engines report holding (EngineReport)
        self.tick = time.monotonic()  # the control loop's own last sign of life
        self._links: dict[str, Link] = {}
        self._members: dict[str, Link] = {}  # member id -> its bound incarnation
        self._pending = 0
        self._pending_from: dict[str, int] = {}  # source address -> its connections mid-handshake
        self._refusals = Refusals(recorder)  # refused connections, counted per source and reason
        self._probe_seq = 0
        self._probe_bytes = 0
        self._round = 0  # rounds of probes written so far
        self._lock = threading.Lock()
        # probes time a link only while no version moves: a probe is written in a quiet epoch and
        # counts only if its answer comes before the next transfer begins (begin_transfer)
        self._quiet = threading.Condition()
        self._epoch = 0
        self._round_pending = False  # a probe round was asked for and is not written yet
        self._unanswered: set[str] = set()  # incarnations whose probe of this epoch is unanswered
        self._copied = threading.Condition()  # a same-host member copied a ring bucket (wait_copied)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # lifecycle (the publisher's threads) -------------------------------------------------------
    def start(self, timeout: float) -> int:
        """Bind and start the control thread; returns the port. Raises OSError when it cannot bind."""
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(asyncio.start_server(self._accept, self._host, self._port))
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as err:  # noqa: BLE001 - handed to start() on the caller's thread
                errors.append(err)
                ready.set()
                loop.close()
                return
            ready.set()
            housekeeping = loop.create_task(self._housekeeping())
            try:
                loop.run_forever()
            finally:
                housekeeping.cancel()
                loop.run_until_complete(self._shutdown())
                loop.run_until_complete(asyncio.gather(housekeeping, return_exceptions=True))
                loop.close()

        self._thread = threading.Thread(target=run, name=f"ws-{self.channel}-control", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise ControlFailure(f"the control server did not start within {timeout}s")
        if errors:
            raise errors[0]
        return self.port

    def stop(self, timeout: float) -> None:
        """Close every connection and end the thread (bounded); idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:
            pass
        thread.join(timeout)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        self._refusals.count(time.monotonic(), everything=True)  # what a flood left uncounted
        links = list(self._links.values())
        for link in links:  # what is queued (a Shutdown) still goes out, briefly
            self._drop(link, "server stopped", flush=True)
        if links:
            await asyncio.wait([asyncio.ensure_future(link.writer.wait_closed()) for link in links], timeout=1.0)

    # any thread -----------------------------------------------------------------------------
    def send(self, incarnation: str, message: Any) -> bool:
        """Queue ``message`` to one member; False when that connection is gone."""
        with self._lock:
            link = self._links.get(incarnation)
        if link is None or link.closed or self._loop is None:
            return False
        try:
            self._loop.call_soon_threadsafe(self._write, link, message)
        except RuntimeError:  # the loop is closed
            return False
        return True

    def bind(self, incarnation: str) -> bool:
        """The Sender accepted ``incarnation`` as its member's current one; False if it is gone."""
        with self._lock:
            link = self._links.get(incarnation)
            if link is None or link.closed:
                return False
            link.bound = True
            self._members[link.member_id] = link
            return True

    def release(self, member_id: str, reason: str) -> None:
        """Forget ``member_id`` (left or evicted) and close its connection after what is queued."""
        with self._lock:
            link = self._members.pop(member_id, None)
        if link is not None and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._drop, link, reason, True)
            except RuntimeError:
                pass

    def formats(self) -> dict[str, str]:
        """The checkpoint format each connected member's engine loads, where it said (``accepts``)."""
        with self._lock:
            return {link.member_id: link.accepts for link in self._links.values()
                    if link.accepts is not None and not link.closed}

    def heard(self, member_id: str) -> tuple[float | None, bool]:
        """(monotonic time of its last frame, whether its connection is open) for a bound member."""
        with self._lock:
            link = self._members.get(member_id)
        if link is None:
            return None, False
        return link.last_heard, not link.closed

    def probe(self, nbytes: int) -> None:
        """Send every bound member a Probe carrying ``nbytes``; its answer times that link (if it
        comes before the next :meth:`begin_transfer`)."""
        if self._loop is None or nbytes <= 0:
            return
        with self._quiet:
            self._round_pending, epoch = True, self._epoch
        try:
            self._loop.call_soon_threadsafe(self._probe_all, nbytes, epoch)
        except RuntimeError:
            with self._quiet:
                self._round_pending = False
                self._quiet.notify_all()

    def settle_probes(self, timeout: float) -> bool:
        """Sender thread, before a transfer: wait until the last round of probes was answered, at
        most ``timeout``, so the next version's bytes do not share the links with them (a probe
        behind a bucket measures the bucket). True when every answer came."""
        with self._quiet:
            return self._quiet.wait_for(lambda: not self._round_pending and not self._unanswered, timeout)

    def begin_transfer(self) -> None:
        """A version starts to move: answers to probes written before now no longer count."""
        with self._quiet:
            self._epoch += 1
            self._round_pending = False
            self._unanswered.clear()

    def link_seconds(self, member_id: str) -> tuple[float, float, int, int] | None:
        """What ``member_id``'s link took at least (its newest answered probe) and at most (the
        shortest of its last round trips), the probes' size, and the round of the newest answer
        (rounds count up); or None. See :func:`link_bounds`."""
        with self._lock:
            link = self._members.get(member_id)
        if link is None or link.link_time is None:
            return None
        low, round_ = link.link_time
        return *link_bounds(low, link.round_trips), self._probe_bytes, round_

    def stale(self) -> bool:
        """True when the control loop itself has not run lately (a stalled process): no verdicts."""
        return time.monotonic() - self.tick > 2 * self._interval + 0.5

    # the control thread ------------------------------------------------------------------------
    def _write(self, link: Link, message: Any) -> None:
        if link.closed:
            return
        link.writer.write(link.session.seal(message))
        if link.writer.transport.get_write_buffer_size() > MAX_BACKLOG:
            self._rec.record("control", peers=(link.member_id,)).fail("stopped reading its connection")
            self._drop(link, "stopped reading")

    def _probe_all(self, nbytes: int, epoch: int) -> None:
        with self._quiet:
            if epoch != self._epoch:  # a transfer began before this round was written: not now
                return
            self._round_pending = False
            if nbytes != self._probe_bytes:  # another size: older times measured something else
                self._probe_bytes = nbytes
                for link in list(self._links.values()):
                    link.link_time = None
                    link.round_trips.clear()
            self._round += 1
            round_ = self._round
            with self._lock:
                links = [link for link in self._links.values() if link.bound and not link.closed]
            self._unanswered = {link.incarnation for link in links}
            self._quiet.notify_all()
        pad = bytes(nbytes)
        for link in links:
            self._probe_seq += 1
            if len(link.probes) > MAX_UNANSWERED:  # unanswered ones: a member that does not care
                link.probes.clear()
            link.probes[self._probe_seq] = (time.monotonic(), epoch, round_)
            self._write(link, _wire.Probe(self._probe_seq, pad))

    def offers(self, members: Iterable[str], version: int) -> dict[str, bytes]:
        """Sender thread: where members among ``members`` (alive now) said they hold ``version``."""
        with self._lock:
            links = {m: self._members.get(m) for m in members}
        return {m: link.offer[1] for m, link in links.items()
                if link is not None and not link.closed and link.offer is not None and link.offer[0] == version}

    def wait_copied(self, members: tuple[str, ...], generation: int, seq: int, bucket: int, timeout: float,
                    cancelled: Callable[[], bool]) -> set[str]:
        """Sender thread: wait until each of ``members`` copied ``bucket`` of announcement ``seq`` out of
        the ring (or a later one), at most ``timeout``; the members that did not (empty: all did).
        ``cancelled()`` (a member died, an abort) ends the wait early."""
        deadline = time.monotonic() + timeout

        def behind() -> set[str]:
            with self._lock:
                links = {m: self._members.get(m) for m in members}
            return {m for m, link in links.items()
                    if link is None or link.closed or link.copied[:2] != (generation, seq) or link.copied[2] < bucket}

        with self._copied:
            while True:
                late = behind()
                left = deadline - time.monotonic()
                if not late or left <= 0 or cancelled():
                    return late
                self._copied.wait(min(left, 0.05))

    def grant(self, member_id: str, scope: Scope | None) -> None:
        """Any thread: the rendezvous keys ``member_id``'s current connection may touch from now on."""
        with self._lock:
            link = self._members.get(member_id)
        if link is not None:
            old = link.scope
            link.scope = None if scope is None else Scope(scope.prefixes, scope.rank,
                                                          readable=old.prefixes if old is not None else ())

    def _drop(self, link: Link, reason: str, flush: bool = False) -> None:
        if link.closed:
            return
        link.closed = True
        with self._lock:
            self._links.pop(link.incarnation, None)
        with self._quiet:  # nobody waits for its probe's answer
            self._unanswered.discard(link.incarnation)
            self._quiet.notify_all()
        self._table.forget(link.incarnation)  # its rendezvous waits end with it
        if link.bound:
            self.engines.forget(link.member_id)  # its engine's reports no longer count
        if flush:
            link.writer.close()  # what is queued is still sent
        else:
            link.writer.transport.abort()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if self._pending >= MAX_PENDING or self._pending_from.get(source, 0) >= MAX_PENDING_PER_SOURCE:
            self._refusals.refuse(source, "too many connections mid-handshake")
            busy = _wire.Deny(reason="too many connections mid-handshake; try again", kind="busy")
            writer.write(Session(outgoing=TO_CLIENT, incoming=TO_SERVER).seal(busy))  # the joiner retries
            writer.close()
            return
        self._pending += 1
        self._pending_from[source] = self._pending_from.get(source, 0) + 1
        try:
            link = await asyncio.wait_for(self._handshake(reader, writer, source), self._handshake_timeout)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, BadFrame) as err:
            self._refusals.refuse(source, f"handshake failed: {type(err).__name__}", detail=str(err))
            writer.transport.abort()
            return
        finally:
            self._pending -= 1
            left = self._pending_from.get(source, 1) - 1
            if left > 0:
                self._pending_from[source] = left
            else:
                self._pending_from.pop(source, None)
        if link is None:
            return
        try:
            await self._serve(reader, link)
        except (asyncio.IncompleteReadError, ConnectionError, BadFrame) as err:
            closed = isinstance(err, (asyncio.IncompleteReadError, ConnectionError))
            self._lost(link, "connection closed" if closed else str(err))
        except Exception as err:  # noqa: BLE001 - one broken connection must never stop the server
            self._rec.record("control", peers=(link.member_id,)).fail(f"{type(err).__name__}: {err}")
            self._lost(link, f"control error: {err}")

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         source: str = "?") -> Link | None:
        nonce = auth.new_nonce()
        session = Session(outgoing=TO_CLIENT, incoming=TO_SERVER)
        offer = self._shm_offer()
        writer.write(session.seal(_wire.Challenge(_wire.PROTOCOL_VERSION, self.channel, nonce, shm=offer,
                                                  open=self._secret is None)))
        length = frame_length(await reader.readexactly(HEADER.size), HANDSHAKE_FRAME)
        join = session.open(await reader.readexactly(length), _wire.client_decoder)
        if not isinstance(join, _wire.Join):
            raise BadFrame(f"expected a Join, got {type(join).__name__}")
        transports = ("group", "shm", *self._planes) if offer is not None else ("group", *self._planes)
        deny = auth.admission_problem(join, channel=self.channel, server_nonce=nonce, secret=self._secret,
                                      mine=self._mine, closing=self._closing() and join.transport != "rank",
                                      transports=transports + (("rank",) if self._rank_links else ()),
                                      unserved=self._unserved)
        if deny is None and self._rank_links and join.transport != "rank" and join.member_id.startswith("rank-"):
            deny = _wire.Deny(reason="member ids rank-N are the trainer ranks' own", kind="duplicate")
        if deny is not None:
            self._refusals.refuse(source, deny.reason, who=join.member_id[:64])  # recorded before answered
            writer.write(session.seal(deny))
            writer.close()
            return None
        session.key = auth.session_key(self._secret, server_nonce=nonce, client_nonce=join.nonce,
                                       member_id=join.member_id)
        link = Link(secrets.token_hex(8), join.member_id, join.host[:256], join.pid, session, writer,
                    transport=join.transport, want=join.want, accepts=join.accepts)
        with self._lock:
            self._links[link.incarnation] = link
        self._on_join(link)
        return link

    async def _serve(self, reader: asyncio.StreamReader, link: Link) -> None:
        while not link.closed:
            length = frame_length(await reader.readexactly(HEADER.size), MAX_FRAME)
            data = await reader.readexactly(length)
            try:
                message = link.session.open(data, _wire.client_decoder)
            except BadFrame as err:
                # out of sequence (a frame lost or replayed on the path), forged or malformed: every
                # later frame would be refused too, so the connection is closed now; a member is then
                # known dead at once instead of after its silence bound, and may rejoin
                self._rec.record("reject", peers=(link.member_id,)).fail(f"{err}: connection closed")
                raise
            link.last_heard = time.monotonic()
            if isinstance(message, (_wire.Ready, _wire.Ack)):
                if message.member_id != link.member_id or not link.bound:
                    self._rec.record("reject", peers=(link.member_id,)).fail(
                        f"{type(message).__name__} for {message.member_id!r} on {link.member_id!r}'s connection")
                    continue
                self.replies.put(message)
            elif isinstance(message, _wire.ProbeReply):
                # the member's own measure of the probe's arrival, bounded by the round trip: a
                # reply can only speak for a probe sent on its own connection, about itself
                sent = link.probes.pop(message.seq, None)
                if sent is not None and message.member_id == link.member_id:
                    with self._quiet:
                        if sent[1] == self._epoch:  # no version moved since it was written
                            rtt = time.monotonic() - sent[0]
                            link.link_time = (min(max(message.seconds, 0.0), rtt), sent[2])
                            link.round_trips.append(rtt)
                            self._unanswered.discard(link.incarnation)
                            self._quiet.notify_all()
            elif isinstance(message, _wire.Leave):
                if link.bound:
                    link.reported = True  # its connection closing next is a goodbye, not a death
                    self._on_leave(link)
            elif isinstance(message, _wire.StoreOp):
                self._store_op(link, message)
            elif isinstance(message, _wire.Copied):
                if message.member_id == link.member_id and link.bound:
                    with self._copied:
                        link.copied = (message.generation, message.seq, message.bucket)
                        self._copied.notify_all()
            elif isinstance(message, _wire.PeerOffer):
                if message.member_id == link.member_id and link.bound and len(message.source) <= MAX_OFFER:
                    link.offer = (message.version, message.source)
            elif isinstance(message, _wire.EngineReport):
                self._engine_report(link, message)
            elif isinstance(message, _wire.Join):
                self._rec.record("reject", peers=(link.member_id,)).fail("a second Join on one connection")

    def _engine_report(self, link: Link, report: _wire.EngineReport) -> None:
        """A member's engine digest for a version: counted under that member only (its connection
        says who it is); answered with the counts for that version and layout."""
        if not link.bound:
            self._reply(link, _wire.EngineTally(report.rid, {}, error="not admitted yet"))
            return
        try:
            counts = self.engines.report(link.member_id, report.version, report.layout, report.digest)
        except ValueError as err:
            self._rec.record("reject", peers=(link.member_id,)).fail(f"engine report refused: {err}")
            self._reply(link, _wire.EngineTally(report.rid, {}, error=str(err)))
            return
        self._reply(link, _wire.EngineTally(report.rid, counts))

    def _store_op(self, link: Link, op: _wire.StoreOp) -> None:
        """Serve ``op`` from the table if this member may (rendezvous.store_problem), else refuse it;
        a connection refused ``MAX_REFUSALS`` times is closed (its member is then dead)."""
        if not link.bound:
            problem: str | None = "not admitted yet"
        else:
            problem = store_problem(op, member=link.member_id, scope=link.scope, rank_link=link.transport == "rank",
                                    owner_of=self._table.owner)
        if problem is None:
            rank = link.transport == "rank"  # the trainer ranks wait for each other for minutes
            if self._table.serve(op, functools.partial(self._reply, link), member="" if rank else link.member_id,
                                 owner=link.incarnation, bound=UNBOUNDED if rank else self._wait_bound):
                return
            problem = "over the table's bounds"  # answered already: counted like any refusal
        link.refusals += 1
        if link.refusals & (link.refusals - 1) == 0:  # the 1st, 2nd, 4th, 8th ...: a flood leaves few entries
            self._rec.record("reject", peers=(link.member_id,)).fail(
                f"rendezvous {op.op} refused ({problem}); {link.refusals} so far")
        if problem != "over the table's bounds":
            self._reply(link, _wire.StoreResult(op.rid, False, error=problem))
        if link.refusals >= MAX_REFUSALS:
            self._lost(link, f"closed after {link.refusals} refused rendezvous ops ({problem})")

    def _reply(self, link: Link, result: _wire.StoreResult | _wire.EngineTally) -> None:
        """Rendezvous answers may come from any thread (a key set by the publisher's own group)."""
        if self._loop is not None and not link.closed:
            try:
                self._loop.call_soon_threadsafe(self._write, link, result)
            except RuntimeError:
                pass

    def _lost(self, link: Link, reason: str) -> None:
        was_bound = link.bound and not link.closed
        self._drop(link, reason)
        if was_bound and not link.reported:
            link.reported = True
            self._on_dead(link.member_id, reason)

    async def _housekeeping(self) -> None:
        period = self._interval / 2
        while True:
            await asyncio.sleep(period)
            try:
                self._keep_house()
            except Exception as err:  # noqa: BLE001 - recorded; the next round tries again
                self._rec.record("control").fail(f"housekeeping: {type(err).__name__}: {err}")

    def _keep_house(self) -> None:
        """Beat to every member, expire rendezvous waits, report the silent (once each)."""
        now = time.monotonic()
        stalled = now - self.tick > 2 * self._interval + 0.5  # we were not running: silence is ours
        self.tick = now
        self._table.expire()
        self._refusals.count(now)
        with self._lock:
            links = list(self._links.values())
        for link in links:
            if link.bound:
                self._write(link, _wire.Beat())
                if stalled:
                    link.last_heard = now
                elif now - link.last_heard > self._dead_after and not link.reported:
                    link.reported = True
                    self._on_dead(link.member_id, f"silent for {now - link.last_heard:.1f}s")
