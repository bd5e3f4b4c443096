"""LoRA adapter channels: push only the adapters, each with versions of its own (docs/lora.md).

:class:`AdapterPublisher` is a :class:`~weightsync.Publisher` whose versions are sets of adapters
(weightsync.format.adapters): ``put("math", adapter)`` sends a version of the channel holding the
new version of ``math`` and the latest version of every other adapter, as a delta by default, so
what did not change costs almost nothing on the wire. :class:`AdapterSubscriber` follows the
channel and keeps the last ``keep`` versions of each adapter it received, so a rollout that began
on one version can finish on it while newer ones arrive. The vLLM backend registers each version in
the engine's LoRA manager instead (weightsync.integrations.vllm, ``update_adapters``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

import torch

from weightsync.engine.handles import PutHandle, check_timeout
from weightsync.engine.lifecycle import check_version, next_version
from weightsync.errors import Closed, Superseded, SyncTimeout, WeightSyncError
from weightsync.format import adapters as fmt
from weightsync.format.adapters import Adapter, AdapterEntry
from weightsync.transport.publisher import Publisher
from weightsync.transport.subscriber import Subscriber

__all__ = ["AdapterPublisher", "AdapterSubscriber", "AdapterVersion"]

T = TypeVar("T")


class AdapterPublisher:
    """Pushes versions of named LoRA adapters on channel ``name``.

    Takes :class:`~weightsync.Publisher`'s arguments (``encoding`` defaults to ``"delta"``: each
    version of the channel holds every adapter, and those that did not change go as empty deltas).
    Its channel is one of its own: a trainer that also pushes base weights runs a Publisher for
    them beside it. ``publisher`` is the underlying Publisher (``address``, ``members``,
    ``statistics()``...).
    """

    def __init__(self, name: str, *, encoding: str = "delta", **publisher_args: Any) -> None:
        self.publisher = Publisher(name, encoding=encoding, **publisher_args)
        self.name = name
        self._current: dict[str, tuple[AdapterEntry, dict[str, torch.Tensor]]] = {}
        self._last: dict[str, int] = {}  # every adapter's newest version, kept after a removal
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> AdapterPublisher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        await self.publisher.start()

    async def aclose(self, timeout: float | None = None) -> None:
        await self.publisher.aclose(timeout)

    async def abort(self) -> None:
        await self.publisher.abort()

    @property
    def address(self) -> str:
        return self.publisher.address

    @property
    def adapters(self) -> dict[str, int]:
        """Each adapter the channel holds now, with its newest version."""
        return {name: entry.version for name, (entry, _) in self._current.items()}

    async def wait_subscribers(self, n: int, timeout: float | None = None) -> tuple[str, ...]:
        return await self.publisher.wait_subscribers(n, timeout)

    async def put(self, name: str, adapter: Adapter, *, version: int | None = None,
                  dtype: torch.dtype | None = None) -> PutHandle:
        """Send version ``version`` of adapter ``name`` (``None``: the one after its last, 0 first;
        versions of one adapter strictly increase, ``ValueError`` otherwise). ``dtype`` casts the
        factors (the engine's LoRA dtype, e.g. ``torch.bfloat16``). The factors are copied at the
        call, so the caller may train on at once. Returns the channel version's handle
        (``handle.version`` is the channel's, which counts every put and removal)."""
        fmt.check_name(name)
        if not isinstance(adapter, Adapter):
            raise TypeError(f"put() takes a weightsync.Adapter (ws.from_peft(model) makes one), got "
                            f"{type(adapter).__name__}")
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        async with self._lock:
            version = next_version(version, self._last.get(name))
            copies = {k: t.detach().to(dtype or t.dtype, copy=True) for k, t in adapter.tensors.items()}
            self._current[name] = (adapter.entry(name, version), copies)
            self._last[name] = version
            return await self._send()

    async def remove(self, name: str) -> PutHandle:
        """Drop adapter ``name`` from the channel: members stop holding it. ``KeyError`` if absent.
        Its versions go on from where they were if it is put again."""
        async with self._lock:
            if name not in self._current:
                raise KeyError(f"adapter {name!r} is not on channel {self.name!r} (it has {sorted(self._current)})")
            del self._current[name]
            if not self._current:
                raise ValueError("removing the last adapter would leave an empty version: put another first, or "
                                 "close the channel")
            return await self._send()

    async def _send(self) -> PutHandle:
        entries = [entry for entry, _ in self._current.values()]
        tensors: dict[str, torch.Tensor] = {fmt.MANIFEST: fmt.encode_manifest(fmt.AdapterSet(entries))}
        for entry, factors in self._current.values():
            tensors.update((fmt.tensor_name(entry.name, k), t) for k, t in factors.items())
        # the copies are this publisher's and never written again (a new put makes new ones)
        return await self.publisher.put(tensors, copy=False)


class AdapterVersion:
    """One version of one adapter, as a member holds it: ``tensors`` (read-only mapping of PEFT
    names to factors, this member's own copy), ``rank``, ``alpha``, ``target_modules`` and
    ``peft_config()`` (what its ``adapter_config.json`` would say)."""

    def __init__(self, entry: AdapterEntry, tensors: dict[str, torch.Tensor]) -> None:
        self.entry = entry
        self.name, self.version, self.rank, self.alpha = entry.name, entry.version, entry.rank, entry.alpha
        self.target_modules = tuple(entry.target_modules)
        self.tensors: Mapping[str, torch.Tensor] = MappingProxyType(tensors)

    def peft_config(self) -> dict[str, Any]:
        return self.entry.peft_config()

    def __repr__(self) -> str:
        return f"AdapterVersion({self.name!r}@{self.version}, rank={self.rank}, {len(self.tensors)} tensors)"


class AdapterSubscriber:
    """Follows an adapter channel and keeps the last ``keep`` versions of each adapter it received.

    Takes :class:`~weightsync.Subscriber`'s arguments. ``keep`` (default 2) versions of each
    adapter stay readable (``get(name, version=v)``) while newer ones arrive: set it to the
    staleness your rollouts allow plus one. ``subscriber`` is the underlying Subscriber.
    """

    def __init__(self, name: str, *, address: str, keep: int = 2, **subscriber_args: Any) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        self.subscriber = Subscriber(name, address=address, **subscriber_args)
        self.name, self.keep = name, keep
        self._held: dict[str, OrderedDict[int, AdapterVersion]] = {}
        self._changed: asyncio.Condition | None = None
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self.channel_version: int | None = None  # the channel's version the adapters held came with

    async def __aenter__(self) -> AdapterSubscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self, timeout: float | None = None) -> None:
        await self.subscriber.start(timeout)
        self._follow_on()

    def _follow_on(self) -> None:
        self._changed = self._changed or asyncio.Condition()
        self._error = None
        self._task = asyncio.get_running_loop().create_task(self._follow(), name=f"ws-{self.name}-adapters")

    async def rejoin(self, timeout: float | None = None) -> None:
        """After ``Evicted``: join again; the adapters held stay readable meanwhile."""
        await self.subscriber.rejoin(timeout)
        self._follow_on()

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, WeightSyncError):
                await task
        await self.subscriber.aclose()

    @property
    def adapters(self) -> dict[str, int]:
        """Each adapter held, with its newest version held."""
        return {name: next(reversed(held)) for name, held in self._held.items() if held}

    def versions(self, name: str) -> tuple[int, ...]:
        """The versions of adapter ``name`` held, oldest first (empty if none)."""
        return tuple(self._held.get(name, ()))

    async def get(self, name: str, *, version: int | None = None, min_version: int | None = None,
                  timeout: float | None = None) -> AdapterVersion:
        """Adapter ``name``: its newest version held, once that is at least ``min_version``, or
        ``version`` itself (``Superseded`` once it is no longer held: ``keep`` newer ones came, or
        the member never received it because a newer one came first). ``SyncTimeout`` after
        ``timeout``; the subscriber's end (``Evicted``, ``PublisherGone``) is raised as it is."""
        fmt.check_name(name)
        check_timeout("timeout", timeout)
        if version is not None and min_version is not None:
            raise ValueError("get() takes version or min_version, not both")
        for value, what in ((version, "version"), (min_version, "min_version")):
            if value is not None:
                check_version(what, value)
        wanted = f"version {version}" if version is not None else f"version >= {min_version or 0}"
        return await self._until(lambda: self._find(name, version, min_version), timeout,
                                 lambda: f"adapter {name!r}: no {wanted} within {timeout:.3g}s (held here: "
                                         f"{list(self.versions(name))})")

    async def wait_for(self, channel_version: int, timeout: float | None = None) -> None:
        """Until this member holds what version ``channel_version`` of the channel holds (a put's or a
        removal's ``handle.version``), or a newer one. ``SyncTimeout`` after ``timeout``."""
        check_version("channel_version", channel_version)
        check_timeout("timeout", timeout)
        await self._until(lambda: True if (self.channel_version or -1) >= channel_version else None, timeout,
                          lambda: f"channel version {channel_version} not held within {timeout:.3g}s (this member "
                                  f"holds {self.channel_version})")

    async def _until(self, ready: Callable[[], T | None], timeout: float | None, late: Callable[[], str]) -> T:
        """``ready()``'s first answer that is not None, each time the held adapters change; the
        follower's end raised; SyncTimeout (``late()``'s words) after ``timeout``."""
        if self._changed is None:
            raise RuntimeError("call start() first")
        deadline = None if timeout is None else time.monotonic() + timeout
        async with self._changed:
            while True:
                found = ready()
                if found is not None:
                    return found
                if self._error is not None:
                    raise self._error
                if self._task is None:
                    raise Closed("adapter subscriber is closed", channel=self.name)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise SyncTimeout(late(), channel=self.name)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), left)

    def _find(self, name: str, version: int | None, min_version: int | None) -> AdapterVersion | None:
        held = self._held.get(name)
        if not held:
            return None
        newest = next(reversed(held))
        if version is None:
            return held[newest] if newest >= (min_version or 0) else None
        if version in held:
            return held[version]
        if newest > version:
            raise Superseded(f"adapter {name!r} version {version} is not held here: this member holds "
                             f"{list(held)} (keep={self.keep})", channel=self.name, version=version)
        return None

    async def _follow(self) -> None:
        assert self._changed is not None
        last = self.channel_version
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    async with self.subscriber.stream(min_version=None if last is None else last + 1) as weights:
                        held = await loop.run_in_executor(None, self._take, list(weights))
                        last = weights.version
                except Closed:
                    return
                async with self._changed:
                    self._held, self.channel_version = held, last
                    self._changed.notify_all()
        except WeightSyncError as err:  # evicted, publisher gone: readers hear it
            async with self._changed:
                self._error = err
                self._changed.notify_all()

    def _take(self, pairs: list[tuple[str, torch.Tensor]]) -> dict[str, OrderedDict[int, AdapterVersion]]:
        """What this member holds after a version: a copy of each adapter version it did not have,
        the ``keep`` newest of each adapter the version holds (an adapter it no longer holds is
        dropped)."""
        manifest = fmt.decode_manifest(dict(pairs)[fmt.MANIFEST])
        held: dict[str, OrderedDict[int, AdapterVersion]] = {}
        for entry in manifest.adapters:
            versions = OrderedDict(self._held.get(entry.name, {}))
            if entry.version not in versions:
                factors = fmt.of_adapter(pairs, entry)
                versions[entry.version] = AdapterVersion(entry, {k: t.clone() for k, t in factors.items()})
            while len(versions) > self.keep:
                versions.popitem(last=False)
            held[entry.name] = versions
        return held
