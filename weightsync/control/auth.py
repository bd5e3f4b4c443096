"""Admission: environment fingerprints, the shared secret, and the keys it yields.

A new connection gets a :class:`~weightsync._wire.Challenge` with a fresh server nonce. The
subscriber answers with a Join carrying its own nonce and, when a secret is configured, a proof:
an HMAC under the secret over both nonces, the channel, its member id and its fingerprint. A
recorded Join is worthless on any other connection (the server nonce differs). Admission yields
a per-member session key, derived from the secret and both nonces: every later frame, both
ways, carries a MAC under it (see :mod:`weightsync.control.framing`). The publisher's first
MAC'd frame (Admit or Deny) proves to the subscriber that it knows the secret too.

Without a secret the channel is open: no proof, no MACs; sequence numbers are still checked.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

import torch

from weightsync import _torch_compat as compat
from weightsync._wire import PROTOCOL_VERSION, Deny, Fingerprint, Join, Want, encode, name_problem

# NCCL variables that change the wire protocol or transport choice and so must agree.
NCCL_VARS_THAT_MUST_MATCH = ("NCCL_PROTO", "NCCL_ALGO", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE",
                             "NCCL_NET", "NCCL_SHM_DISABLE", "NCCL_BUFFSIZE")
TOKEN_ENV = "WEIGHTSYNC_TOKEN"  # noqa: S105 - the variable's name, not a secret
NONCE_BYTES = 16


def fingerprint(backend: str, device: torch.device) -> Fingerprint:
    """This process's fingerprint for a channel on ``backend`` with ``device``."""
    nccl = backend == "nccl"
    return Fingerprint(
        protocol=PROTOCOL_VERSION,
        torch=torch.__version__.split("+")[0],
        nccl=compat.nccl_version() if nccl else "",
        backend=backend,
        device_kind=(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu") if nccl else "",
        nccl_env={k: os.environ[k] for k in NCCL_VARS_THAT_MUST_MATCH if k in os.environ} if nccl else {},
    )


def compare(publisher: Fingerprint, subscriber: Fingerprint) -> list[str]:
    """Human-readable differences that would break the data plane; empty when compatible.

    On gloo only the protocol and backend must match (gloo talks across torch versions as
    long as the framing is ours); on NCCL the torch/NCCL versions, device kind and the
    NCCL_* variables above must agree too.
    """
    diffs = []
    for field in ("protocol", "backend"):
        a, b = getattr(publisher, field), getattr(subscriber, field)
        if a != b:
            diffs.append(f"{field}: publisher {a!r} != subscriber {b!r}")
    if publisher.backend == "nccl" and not diffs:
        for field in ("torch", "nccl", "device_kind", "nccl_env"):
            a, b = getattr(publisher, field), getattr(subscriber, field)
            if a != b:
                diffs.append(f"{field}: publisher {a!r} != subscriber {b!r}")
    return diffs


def resolve_secret(secret: str | bytes | None) -> bytes | None:
    """``secret``, else ``$WEIGHTSYNC_TOKEN``, as bytes; None for an open channel."""
    if secret is None:
        secret = os.environ.get(TOKEN_ENV) or None
    if secret is None:
        return None
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


def join_proof(secret: bytes | None, *, channel: str, server_nonce: bytes, client_nonce: bytes, member_id: str,
               fp: Fingerprint, transport: str = "group", want: tuple[Want, ...] | None = None,
               accepts: str | None = None) -> bytes:
    """What a Join must carry to be admitted (b"" on an open channel). It covers what the member
    asks for (its transport, a sliced member's boxes, the format its engine loads): nobody on the
    path can change them."""
    if secret is None:
        return b""
    return _mac(secret, b"ws-join-v4", channel.encode(), member_id.encode(), server_nonce, client_nonce, encode(fp),
                transport.encode(), encode(want), encode(accepts))


def session_key(secret: bytes | None, *, server_nonce: bytes, client_nonce: bytes, member_id: str) -> bytes | None:
    """The key every later frame of this connection is MAC'd with (None on an open channel)."""
    if secret is None:
        return None
    return _mac(secret, b"ws-session-v2", member_id.encode(), server_nonce, client_nonce)


def admission_problem(join: Join, *, channel: str, server_nonce: bytes, secret: bytes | None, mine: Fingerprint,
                      closing: bool, transports: tuple[str, ...] = ("group",),
                      unserved: Mapping[str, str] | None = None) -> Deny | None:
    """Why the publisher must refuse ``join``, or None to admit it (duplicates are the Sender's call).

    Args:
        join: the subscriber's answer to this connection's challenge.
        channel: the channel name (part of the proof).
        server_nonce: the nonce this connection's challenge carried.
        secret: the shared secret, or None for an open channel.
        mine: the publisher's own fingerprint.
        closing: the publisher is shutting down.
        transports: what the publisher serves (``"shm"`` only where it offered its shared memory).
        unserved: transports the publisher knows but cannot serve here, and why (the member's
            ``TransportUnavailable`` says it).
    """
    if closing:
        return Deny(reason="the publisher is shutting down", kind="closed")
    problem = name_problem("member id", join.member_id)
    if problem is None and not (join.host.isprintable() and len(join.host) <= 256):
        problem = f"host must be a printable name of at most 256 characters, got {join.host[:64]!r}"
    if problem is not None:
        return Deny(reason=problem, kind="token")
    if secret is not None:
        expected = join_proof(secret, channel=channel, server_nonce=server_nonce, client_nonce=join.nonce,
                              member_id=join.member_id, fp=join.fingerprint, transport=join.transport,
                              want=join.want, accepts=join.accepts)
        if not join.proof:
            return Deny(reason="secret: the publisher requires a secret, this subscriber has none (pass secret= "
                               f"or set ${TOKEN_ENV} on both ends)", kind="token")
        if len(join.nonce) < NONCE_BYTES or not hmac.compare_digest(expected, join.proof):
            return Deny(reason="secret: this subscriber's secret is not the publisher's (wrong token)", kind="token")
    diffs = compare(mine, join.fingerprint)
    if diffs:
        return Deny(reason="; ".join(diffs), kind="handshake")
    if join.transport not in transports:
        why = (unserved or {}).get(join.transport)
        if why is not None:
            return Deny(reason=f"transport {join.transport!r} is not served by this publisher: {why}", kind="transport")
        return Deny(reason=f"transport {join.transport[:16]!r} is not served here", kind="handshake")
    return None
