"""A subscriber's end of the control plane: one connection to the publisher, and a reader thread.

:meth:`ControlClient.connect` opens the connection, answers the server's Challenge with a Join
(its proof binds the server's nonce, so it cannot be replayed elsewhere) and starts the reader
thread ``ws-<channel>-control``, which sorts what arrives:

- commands (Admit, Deny, Go, Announce, Reconfigure, Shutdown) into :attr:`commands`;
- Seals (and a delta's WireSizes, which come before its Seal) into :attr:`seals`;
- rendezvous answers to the thread waiting in :meth:`call_store`;
- Beats only refresh :attr:`last_heard`.

Every frame must carry the next sequence number and, once admitted, a valid MAC under the
session key; anything else is dropped and recorded, never obeyed. The first MAC'd frame (the
Admit or a Deny) shows the publisher knows the secret. When the connection closes, the reader
puts a Wake into both queues and fails every rendezvous call: waits end at once.

Nothing here blocks while holding the GIL: socket calls release it, and every send has a
deadline (``send_timeout``), so a frozen publisher can stall no thread beyond its bound.
"""

from __future__ import annotations

import itertools
import os
import platform
import queue
import socket
import struct
import sys
import threading
import time
from typing import Any

from weightsync import _wire
from weightsync._errors import NotListening, ProtocolError, PublisherBusy, StoreUnreachable
from weightsync.control import auth
from weightsync.control.framing import (
    HANDSHAKE_FRAME,
    HEADER,
    MAX_FRAME,
    TO_CLIENT,
    TO_SERVER,
    BadFrame,
    Session,
    frame_length,
    open_refusal,
)
from weightsync.errors import AdmissionDenied, HandshakeMismatch, TransportUnavailable
from weightsync.planes.shm import plane as shm
from weightsync.recorder.recorder import RecorderScope

_ENGINE_RIDS = itertools.count(1)  # negative rids: apart from the rendezvous calls' on the same connection

READ_SLICE = 0.5  # the reader wakes this often to show it is alive (``tick``)
GOODBYE_WAIT = 1.0  # how long a member that said Leave waits for the publisher to close (goodbye)
# the kernel's receive time of each segment (SO_TIMESTAMPNS, Linux; the generic value, which
# x86-64 and arm64 use): a probe is timed from its first segment's arrival to its last, whatever
# the reader thread was doing meanwhile (waiting for the GIL, or descheduled on a busy host)
SO_TIMESTAMPNS = 35 if sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64") else None
STAMP = struct.Struct("=qq")  # struct timespec
STAMP_SPACE = socket.CMSG_SPACE(STAMP.size) if hasattr(socket, "CMSG_SPACE") else 0


class ControlClient:
    """One member incarnation's connection (see the module docstring)."""

    def __init__(self, channel: str, member_id: str, *, host: str, port: int, secret: bytes | None,
                 fingerprint: _wire.Fingerprint, recorder: RecorderScope, send_timeout: float,
                 transport: str = "group", want: tuple[_wire.Want, ...] | None = None,
                 accepts: str | None = None) -> None:
        self.channel, self.member_id, self._host, self._port = channel, member_id, host, port
        self.want = want  # a sliced member's boxes (told in the Join, covered by its proof)
        self.accepts = accepts  # the format its engine loads (told in the Join, covered by its proof)
        self._secret, self._fingerprint, self._rec = secret, fingerprint, recorder
        self._send_timeout = send_timeout
        self.requested = transport  # "auto" | "group" | "shm"
        self.transport = "group"  # what this connection joined with (decided on the Challenge)
        self.shm_pid = 0
        self.commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.seals: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.last_heard = time.monotonic()
        self.tick = time.monotonic()
        self.closed = threading.Event()
        self.close_reason = ""
        #: the publisher's word that it dropped this member (a Reconfigure without it), seen by the
        #: reader before the connection closed: what ended it was an eviction, not the publisher
        self.dropped = ""
        self._sock: socket.socket | None = None
        self._rsock: socket.socket | None = None
        self._session: Session | None = None
        self._send_lock = threading.Lock()
        self._calls: dict[int, tuple[threading.Event, list[Any]]] = {}
        self._calls_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._answered = False  # the publisher answered our Join (from then on, only MAC'd frames)

    # connecting -------------------------------------------------------------------------------
    def connect(self, timeout: float) -> None:
        """Connect, answer the Challenge with a Join, start the reader; raises ControlFailure.

        The answer to the Join (Admit or Deny) arrives in :attr:`commands`.
        """
        deadline = time.monotonic() + timeout
        try:
            sock = socket.create_connection((self._host, self._port), timeout=max(timeout, 0.01))
        except OSError as err:
            raise NotListening(f"cannot connect to {self._host}:{self._port}: {err}") from err
        if self_connected(sock):
            # nobody listens there yet, and the kernel gave this socket that very port as its own:
            # TCP's simultaneous open connected it to itself (a subscriber dialing a local publisher
            # that is not up). It would wait for its own Challenge until the join deadline. Closed at
            # once (linger 0: no TIME_WAIT), or the publisher could not bind its port for a minute.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
            raise NotListening(f"cannot connect to {self._host}:{self._port}: nothing listens there (the socket "
                               "connected to itself)")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        session = Session(outgoing=TO_SERVER, incoming=TO_CLIENT)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            challenge = session.open(self._read_frame(sock, HANDSHAKE_FRAME), _wire.server_decoder)
            if isinstance(challenge, _wire.Deny) and challenge.kind == "busy":
                raise PublisherBusy(f"the publisher at {self._host}:{self._port} turned us away: "
                                    f"{challenge.reason[:200]}")
            if not isinstance(challenge, _wire.Challenge):
                raise BadFrame(f"the first frame is a {type(challenge).__name__}, not a Challenge")
            self._check_challenge(challenge)
            self.transport = self._choose_transport(challenge.shm)
            nonce = auth.new_nonce()
            proof = auth.join_proof(self._secret, channel=self.channel, server_nonce=challenge.nonce,
                                    client_nonce=nonce, member_id=self.member_id, fp=self._fingerprint,
                                    transport=self.transport, want=self.want, accepts=self.accepts)
            sock.sendall(session.seal(_wire.Join(self.member_id, self._fingerprint, nonce, proof, pid=os.getpid(),
                                                 host=socket.gethostname(), transport=self.transport,
                                                 want=self.want, accepts=self.accepts)))
            session.key = auth.session_key(self._secret, server_nonce=challenge.nonce, client_nonce=nonce,
                                           member_id=self.member_id)
        except (TransportUnavailable, HandshakeMismatch, AdmissionDenied, PublisherBusy):  # before OSError: a
            sock.close()  # PublisherBusy is a ConnectionError
            raise
        except (OSError, BadFrame) as err:
            sock.close()
            raise StoreUnreachable(f"the publisher did not answer the handshake: {err}") from err
        # the reader has its own descriptor: a socket's timeout is per object, and the reader's
        # short slices must never cut a sender's sendall short
        self._sock, self._rsock, self._session = sock, sock.dup(), session
        self.local_host: str = sock.getsockname()[0]  # the interface that reaches the publisher
        self.last_heard = time.monotonic()
        self._reader = threading.Thread(target=self._read_loop, name=f"ws-{self.channel}-control", daemon=True)
        self._reader.start()

    def _check_challenge(self, challenge: _wire.Challenge) -> None:
        """A publisher we must not join, said in one line naming both sides (never key material)."""
        where = f"{self._host}:{self._port}"
        if challenge.protocol != _wire.PROTOCOL_VERSION:
            raise HandshakeMismatch(f"protocol: the publisher at {where} speaks weightsync protocol "
                                    f"{challenge.protocol}, this subscriber {_wire.PROTOCOL_VERSION} "
                                    "(install the same weightsync release on both ends)",
                                    channel=self.channel, member=self.member_id)
        if challenge.channel != self.channel:
            raise HandshakeMismatch(f"channel: the publisher at {where} serves channel {challenge.channel[:80]!r}, "
                                    f"this subscriber asked for {self.channel!r}", channel=self.channel,
                                    member=self.member_id)
        if challenge.open and self._secret is not None:
            raise AdmissionDenied(f"secret: the publisher at {where} has no secret (an open channel), this "
                                  "subscriber has one (secret= or $WEIGHTSYNC_TOKEN): give both ends the same "
                                  "secret, or neither", channel=self.channel, member=self.member_id)

    def _choose_transport(self, offer: _wire.ShmOffer | None) -> str:
        """``"shm"`` when asked for (or ``"auto"``) and this process can read the publisher's memory;
        any other transport (the group, a trainer rank's link, a registered plane) as asked."""
        if self.requested not in ("auto", "shm"):
            return self.requested
        problem = shm.door_problem(offer)
        if problem is None:
            assert offer is not None
            self.shm_pid = offer.pid
            return "shm"
        if self.requested == "shm":
            raise TransportUnavailable(f"transport='shm' is impossible: {problem}", channel=self.channel,
                                       member=self.member_id)
        return "group"

    @staticmethod
    def _read_frame(sock: socket.socket, limit: int) -> bytes:
        header = _recv_exactly(sock, HEADER.size)
        return _recv_exactly(sock, frame_length(header, limit))

    # sending (any thread) -----------------------------------------------------------------------
    def send(self, message: Any) -> None:
        """Send ``message`` (bounded by ``send_timeout``); ControlFailure when the connection is gone."""
        if self._sock is None or self._session is None or self.closed.is_set():
            raise StoreUnreachable(f"control connection closed: {self.close_reason or 'not connected'}")
        with self._send_lock:
            data = self._session.seal(message)
            try:
                self._sock.settimeout(self._send_timeout)
                self._sock.sendall(data)
            except OSError as err:
                self._close(f"send failed: {err}")
                raise StoreUnreachable(f"control connection failed: {err}") from err

    def call_store(self, op: _wire.StoreOp, timeout: float) -> _wire.StoreResult:
        """One rendezvous call to the publisher, answered on this connection (bounded)."""
        result: _wire.StoreResult = self.call(op, timeout)
        return result

    def report_engine(self, version: int, layout: str, digest: str, timeout: float) -> dict[str, int]:
        """Any thread: tell the publisher what this member's engine holds after loading ``version``;
        how many members reported each digest for that version and layout (ours included).
        StoreUnreachable when the connection is gone or no answer came within ``timeout``."""
        report = _wire.EngineReport(rid=-next(_ENGINE_RIDS), version=version, layout=layout, digest=digest)
        tally: _wire.EngineTally = self.call(report, timeout)
        if tally.error:
            raise ProtocolError(f"the publisher refused the engine report: {tally.error}")
        return dict(tally.counts)

    def call(self, op: Any, timeout: float) -> Any:
        """A request (a StoreOp or an EngineReport, with its ``rid``) and its answer, on this connection
        (bounded)."""
        done, box = threading.Event(), list[Any]()
        with self._calls_lock:
            self._calls[op.rid] = (done, box)
        try:
            self.send(op)
            if not done.wait(timeout) or not box:
                raise StoreUnreachable(self.close_reason or f"no rendezvous answer within {timeout:.1f}s")
            return box[0]
        finally:
            with self._calls_lock:
                self._calls.pop(op.rid, None)

    def goodbye(self, message: Any, wait: float = GOODBYE_WAIT) -> None:
        """Send ``message`` (a Leave) as the last word, then end this side's sending and wait (at
        most ``wait`` seconds) for the publisher to close its side: it reads all of it first.

        Closing at once lost the Leave one time in 15 when 2 generators left together: a socket
        closed with bytes unread (a Reconfigure the publisher sent meanwhile) is reset, not shut,
        and the publisher's stream reader drops what it had buffered on a reset; the member that
        left was found dead, with a flight-recorder dump. ControlFailure as :meth:`send`."""
        self.send(message)
        assert self._sock is not None
        try:
            self._sock.shutdown(socket.SHUT_WR)  # after the bytes sent: the publisher reads them, then EOF
        except OSError:
            return
        if self._reader is not None and self._reader is not threading.current_thread():
            self.closed.wait(wait)  # the reader sees the publisher close its side (or the wait ends)

    def drained(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) for the reader to have read what the publisher sent before the
        connection broke; True once it has. A member frozen past its eviction finds the publisher's
        notice and the close in its socket together, and its heartbeat may see the close first."""
        reader = self._reader
        if reader is None or reader is threading.current_thread():
            return True
        reader.join(timeout)
        return not reader.is_alive()

    def close(self, reason: str = "closed") -> None:
        """Close the connection (idempotent); waits end at once."""
        self._close(reason)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(READ_SLICE * 4)

    # the reader thread -------------------------------------------------------------------------
    def _read_loop(self) -> None:
        assert self._rsock is not None and self._session is not None
        sock, session = self._rsock, self._session
        stamps = _stamp_arrivals(sock)
        try:
            while not self.closed.is_set():
                sock.settimeout(READ_SLICE)
                try:
                    header = sock.recv(HEADER.size, socket.MSG_PEEK)
                except TimeoutError:
                    self.tick = time.monotonic()
                    continue
                if not header:
                    raise ConnectionError("the publisher closed the connection")
                sock.settimeout(None if self._send_timeout is None else max(self._send_timeout, READ_SLICE))
                first = time.monotonic()  # the frame's first bytes are here
                if stamps:
                    data, stamped = _read_stamped_frame(sock, MAX_FRAME)
                else:
                    data, stamped = self._read_frame(sock, MAX_FRAME), None
                self.tick = time.monotonic()
                # without the kernel's times: from when this thread saw the first bytes to the last
                arriving = self.tick - first if stamped is None else stamped
                try:
                    message = session.open(data, _wire.server_decoder)
                except BadFrame as err:
                    refusal = open_refusal(session, data) if not self._answered else None
                    if refusal is None:
                        self._rec.record("reject").fail(str(err))
                        continue
                    message = refusal
                self._answered = True
                self.last_heard = time.monotonic()
                self._dispatch(message, arriving)
        except (OSError, BadFrame) as err:
            self._close(f"{err}" if str(err) else type(err).__name__)

    def _dispatch(self, message: Any, arriving: float = 0.0) -> None:
        if isinstance(message, _wire.Beat):
            return
        if isinstance(message, _wire.Probe):  # how long its bytes took to arrive, on this link
            try:
                self.send(_wire.ProbeReply(member_id=self.member_id, seq=message.seq, seconds=arriving))
            except StoreUnreachable:
                pass  # the connection is going: the reader finds out next
            return
        if isinstance(message, (_wire.StoreResult, _wire.EngineTally)):
            with self._calls_lock:
                call = self._calls.get(message.rid)
            if call is not None:
                call[1].append(message)
                call[0].set()
            return
        if isinstance(message, (_wire.Seal, _wire.WireSizes)):  # a version's in-band words, in order
            self.seals.put(message)
            return
        if isinstance(message, _wire.Challenge):
            self._rec.record("reject").fail("a second Challenge on one connection")
            return
        if isinstance(message, _wire.Reconfigure) and self.member_id not in message.members:
            self.dropped = message.reason or "evicted"  # set before the close that follows it is seen
        self.commands.put(message)

    def _close(self, reason: str) -> None:
        if self.closed.is_set():
            return
        self.close_reason = reason
        self.closed.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        if self._rsock is not None:
            self._rsock.close()
        wake = _wire.Wake(reason=f"control connection closed: {reason}")
        self.commands.put(wake)
        self.seals.put(wake)
        with self._calls_lock:
            calls = list(self._calls.values())
        for done, _box in calls:
            done.set()


def self_connected(sock: socket.socket) -> bool:
    """True when ``sock`` is connected to itself (its own address is its peer's)."""
    try:
        return bool(sock.getsockname() == sock.getpeername())
    except OSError:
        return False


def _stamp_arrivals(sock: socket.socket) -> bool:
    """Ask the kernel to stamp each segment ``sock`` receives; False where it cannot."""
    if SO_TIMESTAMPNS is None or not STAMP_SPACE:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


def _read_stamped_frame(sock: socket.socket, limit: int) -> tuple[bytes, float | None]:
    """One frame's body, and the seconds from its first segment's arrival to its last by the
    kernel's stamps (None when a read came without one). A TCP read is stamped with the newest
    segment it consumed: the header's read with the first, the body's last read with the last."""
    header, first = _recv_stamped(sock, HEADER.size)
    body, last = _recv_stamped(sock, frame_length(header, limit))
    return body, None if first is None or last is None else max(last - first, 0.0)


def _recv_stamped(sock: socket.socket, n: int) -> tuple[bytes, float | None]:
    buf = bytearray(n)
    view, got, stamp = memoryview(buf), 0, None
    while got < n:
        k, ancillary, _flags, _addr = sock.recvmsg_into([view[got:got + (1 << 20)]], STAMP_SPACE)
        if not k:
            raise ConnectionError("the connection closed mid-frame")
        got += k
        stamp = None
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= STAMP.size:
                seconds, nanos = STAMP.unpack_from(data)
                stamp = seconds + nanos * 1e-9
    return bytes(buf), stamp


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the connection closed mid-frame")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
