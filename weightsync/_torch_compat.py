"""Every private or version-dependent torch.distributed call weightsync makes lives here.

Callers ask capability questions (``nccl2_available()``, ``gloo_options_reconfigurable()``),
never torch version strings. Each probe looks for the attribute it needs, so a torch that
adds or drops a feature takes the matching path without code changes elsewhere.

What the probes found (see docs/torch-versions.md):

- 2.15: ``ProcessGroupNCCL2`` (the single-communicator NCCL backend, a ``Backend`` but not
  a ``ProcessGroupNCCL`` subclass), ``enable_reconfigure`` options and ``Backend.reconfigure``
  on gloo and NCCL, per-backend flight-recorder dumps.
- 2.13 / 2.11: ``ProcessGroupGloo`` and ``ProcessGroupNCCL`` only; ``abort`` on gloo does not
  make a pending operation return, so every wait carries its own deadline.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from weightsync._errors import KeyTimeout

_c10d: Any = getattr(torch._C, "_distributed_c10d", None)


def _td(seconds: float) -> dt.timedelta:
    return dt.timedelta(seconds=max(seconds, 0.001))


def distributed_available() -> bool:
    return bool(dist.is_available()) and _c10d is not None


def gloo_available() -> bool:
    return distributed_available() and bool(dist.is_gloo_available())


def nccl_available() -> bool:
    """NCCL is compiled in and a CUDA device is visible."""
    return distributed_available() and bool(dist.is_nccl_available()) and torch.cuda.is_available()


def nccl2_available() -> bool:
    """The rewritten single-communicator NCCL backend (torch 2.15+) is present."""
    return nccl_available() and hasattr(_c10d, "ProcessGroupNCCL2")


def nccl_version() -> str:
    if not (distributed_available() and dist.is_nccl_available()):
        return ""
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a CPU build without libnccl answers with anything
        return ""
    return ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)


_PROBE_TIMEOUT = 1.0
_CONNECT_ATTEMPTS = 5


def _validated(make: Any, timeout: float) -> Any:
    """A store connection that answered a probe; retried on a silent one.

    Seen on torch 2.13 and 2.15 (about 1 connection in 20 on a 2-core machine): a fresh
    TCPStore connection whose handshake is never answered, and while it waits the server
    answers nobody. Every connection is therefore made with a short handshake deadline (1 s:
    it also bounds the server-wide stall, which liveness accounting discounts), probed, and
    replaced when it stays silent.
    """
    last: BaseException | None = None
    for _ in range(_CONNECT_ATTEMPTS):
        try:
            store = make(_td(min(_PROBE_TIMEOUT, timeout)))
            store.check(["ws/__probe__"])
            store.set_timeout(_td(timeout))
            return store
        except (RuntimeError, dist.DistError) as err:
            last = err
    assert last is not None
    raise last


def new_store_client(host: str, port: int, timeout: float) -> Any:
    def make(t: dt.timedelta) -> Any:
        return _within(lambda: dist.TCPStore(host, port, is_master=False, timeout=t), t.total_seconds() + 1.0)

    return _validated(make, timeout)


def _within(make: Any, seconds: float) -> Any:
    """``make()`` on a daemon thread, given up on after ``seconds``.

    Measured on torch 2.13: a TCPStore client whose TCP connection is accepted (a listener's
    backlog) but never answered blocks in its constructor far past its timeout (over 40 s with
    ``timeout=1 s``); the timeout bounds only the connect retries. A silent peer would hold the
    caller forever, so the constructor runs here. A thread given up on stays blocked on that
    socket until the peer closes it: at most ``_CONNECT_ATTEMPTS`` per call.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["store"] = make()
        except BaseException as err:  # noqa: BLE001 - handed to the caller as is
            box["error"] = err

    thread = threading.Thread(target=run, name="ws-store-connect", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise RuntimeError(f"the store accepted the connection but did not answer within {seconds:.1f}s")
    if "error" in box:
        raise box["error"]
    return box["store"]


def clone_store(store: Any, timeout: float) -> Any:
    """A new connection to the same store, for a thread that blocks on it.

    A clone inherits its parent's timeout for the handshake, so the parent's is shortened
    while cloning: call this from one thread at a time per parent (before threads start).
    """
    original = store.timeout if hasattr(store, "timeout") else _td(timeout)

    def make(t: dt.timedelta) -> Any:
        store.set_timeout(t)
        try:
            return store.clone()
        finally:
            store.set_timeout(original)

    return _validated(make, timeout)


def prefix_store(prefix: str, store: dist.Store) -> dist.Store:
    return dist.PrefixStore(prefix, store)


def gloo_options_reconfigurable() -> bool:
    gloo: Any = dist.ProcessGroupGloo
    return gloo_available() and hasattr(gloo._Options(), "enable_reconfigure")


_LAZY_ENV = "TORCH_GLOO_LAZY_INIT"
_lazy_lock = threading.Lock()


def gloo_device(host: str | None) -> Any:
    """The network device a gloo backend binds: the interface with address ``host``.

    ``GLOO_SOCKET_IFNAME`` wins when set (the user's explicit choice; the first of a comma-separated
    list): torch reads it only when it makes the devices itself, and with devices passed in options
    (as here) ``create_default_device`` ignored it and resolved the hostname, which inside a network
    namespace fell back to loopback (a two-host ``weightsync bench`` hung on it). Otherwise ``host`` is
    the address this end's control connection uses, the one known to reach the other end. gloo's
    own default resolves the machine's hostname instead, which on a multi-homed host (or inside
    a network namespace) can name an interface the peers cannot reach. Without ``host``
    (a publisher listening on every interface), gloo's default applies.
    """
    gloo: Any = dist.ProcessGroupGloo
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if interface:
        return gloo.create_device(interface=interface)
    if host:
        return gloo.create_device(hostname=host)
    return gloo.create_default_device()


def gloo_options(timeout: float, host: str | None, streams: int) -> Any:
    """A gloo backend's options with ``streams`` devices, hence as many connections per pair.

    ProcessGroupGloo keeps one context (a full mesh of pairs) per device and gives consecutive
    operations consecutive tags, each run on the context its tag names (``tag % devices``), by
    as many worker threads as there are devices (two at least). So bucket i and bucket i+1, both
    in flight, travel on different sockets and threads (what that buys: docs/benchmarks.md, "Two
    connections per pair").
    """
    gloo: Any = dist.ProcessGroupGloo
    options = gloo._Options()
    options._timeout = _td(timeout)
    options._devices = [gloo_device(host) for _ in range(streams)]
    options._threads = max(2, streams)
    return options


def make_gloo(store: dist.Store, rank: int, size: int, timeout: float, host: str | None = None,
              streams: int = 1) -> Any:
    """A standalone gloo backend whose pairs connect lazily, on first use.

    Measured on torch 2.13 (the soak test, 1 of 4 members killed just after a generation
    formed): an eager gloo constructor connects the full mesh, and a member whose peer died
    mid-connect stayed blocked in it for more than 12 s, past its own timeout, unable to
    answer anything. With lazy pairs the constructor returns at once and a connection to a
    dead peer fails inside the first collective, under that collective's own deadline, where
    a receiver can also give up when told to. torch only offers this through the
    ``TORCH_GLOO_LAZY_INIT`` environment variable, read by the constructor: it is set around
    this one call (under a lock) and restored, never left behind.

    ``streams``: connections per pair (:func:`gloo_options`).
    """
    with _lazy_lock:
        previous = os.environ.get(_LAZY_ENV)
        os.environ[_LAZY_ENV] = "1"
        try:
            gloo: Any = dist.ProcessGroupGloo
            return gloo(store, rank, size, gloo_options(timeout, host, streams))
        finally:
            if previous is None:
                del os.environ[_LAZY_ENV]
            else:
                os.environ[_LAZY_ENV] = previous


def make_gloo_reconfigurable(store: dist.Store, slot: int, timeout: float, host: str | None = None,
                             streams: int = 1) -> Any:
    """A gloo backend (2.14+) that joins a group only through :func:`reconfigure`.

    ``slot`` must be unique among the backends that will ever share a group: it is part of the
    reconfigure handle, and handles must differ. ``TORCH_GLOO_LAZY_INIT`` is held off around the
    constructor (under the same lock as :func:`make_gloo`): measured on 2.15, one member whose
    reconfigurable backend was made with it set (the variable left in its environment) crashed
    the *publisher* with SIGSEGV inside its next ``reconfigure``.
    """
    with _lazy_lock:
        previous = os.environ.pop(_LAZY_ENV, None)
        try:
            gloo: Any = dist.ProcessGroupGloo
            options = gloo_options(timeout, host, streams)
            options.enable_reconfigure = True
            return gloo(store, slot, slot + 1, options)
        finally:
            if previous is not None:
                os.environ[_LAZY_ENV] = previous


def reconfigure_handle(pg: Any) -> str:
    """The backend's current handle; it changes with every reconfigure, so read it each time."""
    return str(pg.get_reconfigure_handle())


def reconfigure_keys(uuid: int) -> str:
    """Where, under its store, one re-form (``reconfigure`` with ``uuid``) keeps its rendezvous keys.

    Measured on 2.15: ``reconfigure/<uuid>/claimed`` (rank 0's compare_set) and
    ``reconfigure/<uuid>/0/<rank>`` (each rank's address, set by that rank).
    """
    return f"reconfigure/{uuid}/"


def reconfigure(pg: Any, uuid: int, handles: Sequence[str], timeout: float) -> None:
    """Re-form ``pg`` in place with ``handles`` (rank = position); bounded by ``timeout``."""
    opts = _c10d.ReconfigureOptions()
    opts.uuid = uuid
    opts.handles = list(handles)
    opts.timeout = _td(timeout)
    wait_work(pg.reconfigure(opts), timeout)


def make_nccl(store: dist.Store, rank: int, size: int, timeout: float, device: torch.device, max_ctas: int) -> Any:
    """A standalone NCCL backend with one communicator, created eagerly on ``device``."""
    options = _c10d.ProcessGroupNCCL.Options()
    options._timeout = _td(timeout)
    options.is_high_priority_stream = False
    if max_ctas > 0 and hasattr(options, "config") and hasattr(options.config, "max_ctas"):
        options.config.max_ctas = max_ctas
    if hasattr(_c10d, "ProcessGroupNCCL2"):
        pg = _c10d.ProcessGroupNCCL2(store, rank, size, options, device)
    else:
        pg = _c10d.ProcessGroupNCCL(store, rank, size, options)
    if hasattr(pg, "eager_connect_single_device"):
        # Eager init binds exactly one communicator to the device now; collectives only
        # from here on, so no lazily created p2p communicator is ever added.
        pg.eager_connect_single_device(device)
    return pg


def broadcast(pg: Any, tensor: torch.Tensor, root: int, timeout: float) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    if hasattr(opts, "timeout"):
        opts.timeout = _td(timeout)
    return pg.broadcast([tensor], opts)


def send(pg: Any, tensor: torch.Tensor, dst: int, tag: int) -> Any:
    """Point to point: ``tensor`` to rank ``dst`` (bounded by the wait on the returned work)."""
    return pg.send([tensor], dst, tag)


def recv(pg: Any, tensor: torch.Tensor, src: int, tag: int) -> Any:
    return pg.recv([tensor], src, tag)


def _fresh(err: BaseException) -> BaseException:
    """A new ``type(err)(message)`` (a RuntimeError where the type takes other arguments); ``err``'s
    traceback, the frames that waited on its work, is dropped."""
    err.__traceback__ = None
    try:
        return type(err)(str(err))
    except Exception:  # noqa: BLE001 - some pybind exception types take other arguments
        return RuntimeError(str(err))


def wait_work(work: Any, timeout: float) -> None:
    """Wait for ``work`` at most ``timeout`` seconds; raises TimeoutError or the backend's error.

    Some works (``FutureWrappingWork``) refuse a finite timeout; for those a done-callback on
    their future sets an Event that is waited on with the deadline instead.

    A failed work keeps its error, and when that error was raised in Python (by our store, inside
    the backend's rendezvous) it is the very object re-raised here: its traceback would hold this
    frame, and this frame the work, a cycle through C++ that the garbage collector never sees.
    Measured in the soak test on 2.13: each such failure kept a whole gloo context alive (its
    loop thread, epoll, pipe, listening socket) for the life of the process. So the error is
    re-raised as a new exception of the same type and the original's traceback is dropped.
    """
    try:
        ok = work.wait(_td(timeout))
    except Exception as err:  # noqa: BLE001 - re-raised below, detached from the work
        fresh = _fresh(err)
        message = str(fresh)
        if "not implemented" not in message:
            # our store's KeyTimeout, or torch's own wording (its errors carry no type for it)
            if isinstance(fresh, KeyTimeout) or "timed out" in message.lower() or "timeout" in message.lower():
                raise TimeoutError(message) from None
            raise fresh from None
        done = threading.Event()
        fut = work.get_future()
        fut.add_done_callback(lambda _f: done.set())
        if not done.wait(timeout):
            raise TimeoutError(f"operation did not complete within {timeout:.1f}s") from None
        try:
            fut.value()  # re-raises the operation's own error, if any
        except Exception as err:  # noqa: BLE001 - the same cycle, through the future
            raise _fresh(err) from None
        return
    if ok is False:
        raise TimeoutError(f"operation did not complete within {timeout:.1f}s")


def abort(pg: Any) -> None:
    """Tear the backend down, as forcefully as this torch allows; never raises."""
    for verb in ("abort", "shutdown"):
        fn = getattr(pg, verb, None)
        if fn is None:
            continue
        try:
            fn()
            return
        except Exception:  # noqa: BLE001,S112 - best effort on an already broken group
            continue


def torch_flight_recorder_json() -> bytes | None:
    """torch's own flight-recorder trace for this process as JSON, when this build has one.

    JSON, not the pickled variant: nothing weightsync writes or reads is pickle. Tries the
    2.15 per-backend form first, then the older global one; empty traces count as none.
    """
    for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
        fn = getattr(_c10d, name, None)
        if fn is None:
            continue
        for kwargs in ({"backend": "gloo"}, {}):
            try:
                data = fn(**kwargs)
            except Exception:  # noqa: BLE001,S112 - no buffer in this build/config, or no such argument
                continue
            if isinstance(data, (bytes, bytearray)) and b'"entries"' in data:
                return bytes(data)
    return None
