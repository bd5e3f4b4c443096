"""Admission: environment fingerprints and the optional shared-secret token.

A subscriber's Join carries its :class:`~weightsync._wire.Fingerprint` and, when a secret is
configured, an HMAC of its member id. The publisher compares both before the subscriber may
touch the data plane, so a mismatch is a clear error at join time rather than a hang later.
"""

from __future__ import annotations

import hashlib
import hmac
import os

import torch

from weightsync._wire import PROTOCOL_VERSION, Deny, Fingerprint, Join
from weightsync.pg import _torch_compat as compat

# NCCL variables that change the wire protocol or transport choice and so must agree.
NCCL_VARS_THAT_MUST_MATCH = ("NCCL_PROTO", "NCCL_ALGO", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE",
                             "NCCL_NET", "NCCL_SHM_DISABLE", "NCCL_BUFFSIZE")
TOKEN_ENV = "WEIGHTSYNC_TOKEN"  # noqa: S105 - the variable's name, not a secret


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
    if secret is None:
        secret = os.environ.get(TOKEN_ENV) or None
    if secret is None:
        return None
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def token_mac(secret: bytes | None, channel: str, member_id: str) -> str:
    if secret is None:
        return ""
    return hmac.new(secret, f"{channel}\0{member_id}".encode(), hashlib.sha256).hexdigest()


def token_ok(secret: bytes | None, channel: str, member_id: str, mac: str) -> bool:
    if secret is None:
        return True
    return hmac.compare_digest(token_mac(secret, channel, member_id), mac)


def admission_problem(join: Join, *, channel: str, queue_prefix: str, secret: bytes | None, mine: Fingerprint,
                      taken: bool, closing: bool) -> Deny | None:
    """Why the publisher must refuse ``join``, or None to admit it.

    Args:
        join: the subscriber's request.
        channel: the channel name (part of the token's MAC).
        queue_prefix: where this channel's member queues live; replies go nowhere else.
        secret: the shared secret, or None for an open channel.
        mine: the publisher's own fingerprint.
        taken: the member id is already a member, a joiner, or the publisher's.
        closing: the publisher is shutting down.
    """
    if closing:
        return Deny(reason="the publisher is shutting down", kind="closed")
    if not join.reply_to.startswith(queue_prefix):
        return Deny(reason=f"reply queue {join.reply_to!r} is outside this channel", kind="token")
    if not token_ok(secret, channel, join.member_id, join.token_mac):
        return Deny(reason="missing or wrong token", kind="token")
    diffs = compare(mine, join.fingerprint)
    if diffs:
        return Deny(reason="; ".join(diffs), kind="handshake")
    if taken:
        return Deny(reason=f"member id {join.member_id!r} is already in the channel", kind="duplicate")
    return None
