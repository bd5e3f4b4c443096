"""An outsider on the publisher's network: it knows the address and speaks the wire format, but
not (necessarily) the secret. Attack and fault tests use it the way a real process would: a
plain socket, hand-built frames, no weightsync client code in between."""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Any

from weightsync import _wire
from weightsync.control import auth
from weightsync.control.framing import TO_CLIENT, TO_SERVER, BadFrame, Session, open_refusal


class Outsider:
    def __init__(self, address: str, timeout: float = 10.0) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.session = Session(outgoing=TO_SERVER, incoming=TO_CLIENT)
        self.challenge: _wire.Challenge | None = None

    def read(self, timeout: float = 10.0) -> Any:
        """The next message from the server (None when it closed the connection)."""
        self.sock.settimeout(timeout)
        header = self._exactly(4)
        if header is None:
            return None
        body = self._exactly(struct.unpack(">I", header)[0])
        if body is None:
            return None
        try:
            return self.session.open(body, _wire.server_decoder)
        except BadFrame:
            refusal = open_refusal(self.session, body)  # a Deny at the door carries no MAC
            if refusal is None:
                raise
            return refusal

    def _exactly(self, n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            try:
                chunk = self.sock.recv(n - len(data))
            except (ConnectionError, OSError):
                return None
            if not chunk:
                return None
            data += chunk
        return data

    def send(self, message: Any) -> None:
        self.sock.sendall(self.session.seal(message))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def join(self, member_id: str, fingerprint: _wire.Fingerprint, secret: bytes | None,
             proof: bytes | None = None, transport: str = "group") -> Any:
        """Answer the challenge (with the right proof for ``secret``, or ``proof`` as given); the reply."""
        self.challenge = self.read()
        assert isinstance(self.challenge, _wire.Challenge)
        nonce = os.urandom(16)
        if proof is None:
            proof = auth.join_proof(secret, channel=self.challenge.channel, server_nonce=self.challenge.nonce,
                                    client_nonce=nonce, member_id=member_id, fp=fingerprint, transport=transport)
        join = _wire.Join(member_id=member_id, fingerprint=fingerprint, nonce=nonce, proof=proof, transport=transport)
        self.last_join = join
        self.send(join)
        self.session.key = auth.session_key(secret, server_nonce=self.challenge.nonce, client_nonce=nonce,
                                            member_id=member_id)
        reply = self.read()
        while isinstance(reply, _wire.Beat):  # beats may come before the Admit
            reply = self.read()
        return reply

    def closed_within(self, seconds: float) -> bool:
        """True once the server closed this connection (reads return nothing), within ``seconds``."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if self.read(timeout=max(deadline - time.monotonic(), 0.01)) is None:
                    return True
            except TimeoutError:
                return False
            except Exception:  # noqa: BLE001 - a frame we cannot open still means it talks
                continue
        return False

    def close(self) -> None:
        self.sock.close()
