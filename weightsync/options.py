"""Channel options, and the one place every deadline is computed.

The publisher's :class:`ChannelOptions` become a :class:`~weightsync._wire.ChannelSettings`
that every member receives at admission; both ends then compute each deadline with
:class:`Deadlines` from those settings. Nothing here is duplicated on the subscriber: it
waits on nothing the publisher did not tell it (except its own join and liveness bounds).
"""

from __future__ import annotations

import logging
import math
import os
import socket

import msgspec
import torch

from weightsync._wire import PROTOCOL_VERSION, ChannelSettings

MiB = 1 << 20
MAX_STREAMS = 8  # gloo connections per pair: each is a socket and a thread on every end


def valid_streams(streams: object) -> bool:
    """A count of gloo connections per pair an end may build: an int in [1, MAX_STREAMS]."""
    return isinstance(streams, int) and not isinstance(streams, bool) and 1 <= streams <= MAX_STREAMS

def check_number(what: str, value: object, *, integer: bool = False) -> None:
    """TypeError unless ``value`` is a finite real number (an int, not a bool, with ``integer``):
    ``timeout="5"`` or ``max_snapshots=2.5`` is refused at the call, naming the argument, instead
    of failing inside a thread later. Range checks stay with each caller."""
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(f"{what} must be {'an int' if integer else 'a number'}, got {type(value).__name__} "
                        f"{value!r:.40}")
    assert isinstance(value, (int, float))
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {value!r}")


#: a member is dead after this many silent heartbeat intervals ...
DEAD_AFTER_BEATS = 5
#: ... and never sooner than this: a loaded machine delays beats, and an eviction is costly
DEAD_AFTER_SECONDS = 2.0


class ChannelOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Deadlines and sizes of one channel end.

    Attributes:
        timeout: seconds; the floor of every data-plane deadline and the default for control
            waits (joins, acknowledgements, rendezvous).
        min_bandwidth: bytes/s; a bucket's deadline is ``timeout + nbytes / min_bandwidth``.
        bucket_bytes: size of one broadcast (publisher only; subscribers follow announcements).
        heartbeat_interval: seconds between a subscriber's liveness beats.
        streams: gloo connections per pair of ends (consecutive buckets take turns on them).
    """

    timeout: float = 30.0
    min_bandwidth: float = 50e6
    bucket_bytes: int = 64 * MiB
    heartbeat_interval: float = 1.0
    streams: int = 2

    def __post_init__(self) -> None:
        for what in ("timeout", "min_bandwidth", "heartbeat_interval"):
            check_number(what, getattr(self, what))
        check_number("bucket_bytes", self.bucket_bytes, integer=True)
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")
        if not self.min_bandwidth > 0:
            raise ValueError(f"min_bandwidth must be > 0 bytes/s, got {self.min_bandwidth}")
        if not 4096 <= self.bucket_bytes <= 16 * 1024 * MiB:
            raise ValueError(f"bucket_bytes must be in [4 KiB, 16 GiB], got {self.bucket_bytes}")
        if not 0 < self.heartbeat_interval <= self.timeout:
            raise ValueError(f"heartbeat_interval must be in (0, timeout], got {self.heartbeat_interval}")
        if not valid_streams(self.streams):
            raise ValueError(f"streams must be an int in [1, {MAX_STREAMS}], got {self.streams!r}")

    def settings(self, *, checksum: bool, in_place: bool, activation: str = "each") -> ChannelSettings:
        """What members are told at admission."""
        return ChannelSettings(protocol=PROTOCOL_VERSION, bucket_bytes=self.bucket_bytes, timeout=self.timeout,
                               min_bandwidth=self.min_bandwidth, heartbeat_interval=self.heartbeat_interval,
                               checksum=checksum, in_place=in_place, activation=activation,
                               streams=self.streams)


ACTIVATIONS = ("each", "all")  # when a member exposes a version (Publisher(activation=))


RANKS_START = 120.0  # seconds rank 0 waits, at least, for the other trainer ranks to register


UNBOUNDED = 3600.0  # seconds: a wait that only a message, a closed connection or an abort ends


class Deadlines:
    """Every deadline of one channel, in seconds, from the publisher's settings.

    Both ends construct it from the same :class:`ChannelSettings` (the subscriber from its
    ``Admit``), so they agree on every bound. Example::

        d = Deadlines(opts.settings(checksum=True, in_place=False))
        d.bucket(64 << 20)   # timeout + 64 MiB / min_bandwidth
    """

    def __init__(self, settings: ChannelSettings) -> None:
        self.settings = settings

    def bucket(self, nbytes: int) -> float:
        """One bucket of ``nbytes`` on the wire: the floor plus its bytes at the slowest rate."""
        return self.settings.timeout + nbytes / self.settings.min_bandwidth

    def rendezvous(self) -> float:
        """Forming a generation's group (gloo/NCCL rendezvous, or an in-place re-form)."""
        return self.settings.timeout + self.bucket(self.settings.bucket_bytes)

    def rendezvous_wait(self) -> float:
        """The longest a member's wait on a rendezvous key may last (its rendezvous, once more if late)."""
        return 2 * self.rendezvous()

    def acknowledgements(self) -> float:
        """From the last bucket (or the Seal) to every member's Ack."""
        return self.settings.timeout

    def read_alone(self, nbytes: int) -> float:
        """A member that reads a version on its own after its Seal went (shared memory, one-sided):
        its bytes at the slowest rate, on top of ``acknowledgements`` (the publisher walked its
        buckets without waiting for it)."""
        return nbytes / self.settings.min_bandwidth

    def seal(self) -> float:
        """A receiver waiting for the Seal after its last bucket."""
        return self.settings.timeout

    def readers(self) -> float:
        """A receiver waiting for readers to release the slot it must overwrite."""
        return self.settings.timeout

    def drain(self) -> float:
        """A subscriber closing: the version in flight finishes (two of the largest buckets)."""
        return 2 * self.bucket(self.settings.bucket_bytes)

    def member_silence(self) -> float:
        """The publisher declares a member dead after this long without a beat."""
        return max(DEAD_AFTER_BEATS * self.settings.heartbeat_interval, DEAD_AFTER_SECONDS)

    def publisher_silence(self, own_timeout: float) -> float:
        """A subscriber declares the publisher gone after this long without its beat."""
        return max(3 * self.settings.heartbeat_interval, own_timeout / 2)

    # an end's own bounds, from its own timeout (a subscriber knows no settings before its Admit)
    @staticmethod
    def joining(timeout: float) -> float:
        """A subscriber's start or rejoin: its tries until admitted (a publisher not up yet included)."""
        return 2 * timeout

    @staticmethod
    def closing(timeout: float) -> float:
        """A publisher's aclose(): what is pending is sent, then everything stops."""
        return 4 * timeout

    @staticmethod
    def teardown(timeout: float) -> float:
        """The last step of a close: the recorder's dump and the end's worker thread."""
        return 3 * timeout

    @staticmethod
    def aborting(timeout: float) -> float:
        """A blocking front's wait for its end's abort() to finish."""
        return 2 * timeout

    # a sharded publisher's trainer ranks (weightsync.transport.trainers)
    def ranks_meeting(self) -> float:
        """A rank > 0 connecting to rank 0 and registering its lane; each rank store call's bound."""
        return 2 * self.settings.timeout

    def ranks_start(self) -> float:
        """Rank 0 waiting for every other rank to register (they may start minutes later)."""
        return max(RANKS_START, 4 * self.settings.timeout)

    def ranks_agreement(self) -> float:
        """Every rank's put of one version agreeing, before anything is sent."""
        return 2 * self.settings.timeout

    def ranks_outcome(self, nbytes: int, world: int) -> float:
        """Every rank's word on what became of its part of a version of ``nbytes`` (one rank's)."""
        return 4 * self.settings.timeout + nbytes * world / self.settings.min_bandwidth


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


def is_loopback(host: str) -> bool:
    """True when ``host`` can only be reached from this machine."""
    if host in ("localhost", "::1") or host.startswith("127."):
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


_warned: set[str] = set()


def warn_open_channel(channel: str, address: str) -> None:
    """Once per channel: listening beyond loopback without a secret admits anyone who can connect."""
    if channel in _warned:
        return
    _warned.add(channel)
    logging.getLogger("weightsync.publisher").warning(
        "channel %r listens on %s without a secret: any process that can reach it may join and "
        "read the weights. Pass secret= (or set WEIGHTSYNC_TOKEN) on both ends; see docs/security.md.",
        channel, address)


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cpu")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(dev)!r}: this torch ({torch.__version__}) has no usable CUDA device "
                         f"({'no GPU is visible' if torch.version.cuda else 'it was built without CUDA'}); "
                         "use device='cpu'")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {dev}")
    return dev


def connect_store(address: str, timeout: float = 30.0) -> object:
    """A new, probed client connection to the torch ``TCPStore`` at ``address``.

    For side channels an application runs beside a weightsync channel (rollouts flowing back
    to the trainer, stop flags) on a store it hosts itself (``torch.distributed.TCPStore``):
    ``queue_push``/``queue_pop``, ``set``/``check``. The connection is made with a short
    handshake deadline and probed (see torch-versions.md); ``timeout`` becomes its operation
    timeout. A publisher's own address is not a store: weightsync's control connection
    admits members only.
    """
    from weightsync import _torch_compat as compat

    host, port = parse_address(address)
    if port == 0:
        raise ValueError(f"connect to a listening store, not port 0: {address!r}")
    return compat.new_store_client(host, port, timeout)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1
