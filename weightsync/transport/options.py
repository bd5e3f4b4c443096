"""Validated, keyword-only channel options shared by Publisher and Subscriber."""

from __future__ import annotations

import socket

import msgspec
import torch

MiB = 1 << 20


class ChannelOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Deadlines and sizes of one channel end.

    Attributes:
        timeout: seconds; the floor of every data-plane deadline and the default for control
            waits (joins, acknowledgements, rendezvous).
        min_bandwidth: bytes/s; a bucket's deadline is ``timeout + nbytes / min_bandwidth``.
        bucket_bytes: size of one broadcast (publisher only; subscribers follow announcements).
        heartbeat_interval: seconds between a subscriber's liveness beats.
    """

    timeout: float = 30.0
    min_bandwidth: float = 50e6
    bucket_bytes: int = 64 * MiB
    heartbeat_interval: float = 1.0

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")
        if not self.min_bandwidth > 0:
            raise ValueError(f"min_bandwidth must be > 0 bytes/s, got {self.min_bandwidth}")
        if not 4096 <= self.bucket_bytes <= 16 * 1024 * MiB:
            raise ValueError(f"bucket_bytes must be in [4 KiB, 16 GiB], got {self.bucket_bytes}")
        if not 0 < self.heartbeat_interval <= self.timeout:
            raise ValueError(f"heartbeat_interval must be in (0, timeout], got {self.heartbeat_interval}")

    def deadline(self, nbytes: int) -> float:
        return self.timeout + nbytes / self.min_bandwidth


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port); port 0 means any free port."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"address must be 'host:port', got {address!r}")
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"address port must be an integer, got {address!r}") from None
    if not 0 <= port < 65536 or not host:
        raise ValueError(f"address must be 'host:port' with port in [0, 65535], got {address!r}")
    return host, port


def advertised_host(host: str) -> str:
    """The host to hand to subscribers when the store listens on ``host``."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {dev}")
    return dev


def connect_store(address: str, timeout: float = 30.0) -> object:
    """A new client connection to the store at ``address`` (a publisher's ``pub.address``).

    For side channels an application runs beside a weightsync channel (rollouts flowing back
    to the trainer, stop flags): ``queue_push``/``queue_pop``, ``set``/``check``. The
    connection is made with a short handshake deadline and probed (see torch-versions.md);
    ``timeout`` becomes its operation timeout. Keys under ``ws/`` belong to weightsync.
    """
    from weightsync.pg import _torch_compat as compat

    host, port = parse_address(address)
    if port == 0:
        raise ValueError(f"connect to a listening store, not port 0: {address!r}")
    return compat.new_store_client(host, port, timeout)
