"""Generator-side processes for ``benchmarks.push_vs_broadcast``: a blocking-broadcast receiver and a Subscriber.

Run as ``python -m benchmarks.workers '<json spec>'``; results come back as msgspec JSON in the
file the spec names (never pickle).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import sys
import time

import msgspec
import torch
import torch.distributed as dist

import weightsync as ws
from benchmarks.baseline import group
from benchmarks.lag import LagMeter
from weightsync.bench.model import make_module, make_state_dict, packed_chunks


class WorkerResult(msgspec.Struct):
    lag_p99_ms: float = 0.0
    lag_max_ms: float = 0.0
    error: str = ""
    built: list[tuple[int, float]] = []  # gated: [nominal MiB, time.time()] as each size's model was begun
    seconds: float = 0.0  # a newcomer: from start() until it held the version
    took: dict[str, int] = {}  # a one-sided newcomer: bytes it received, by source (publisher, peer, self)


GATE_WAIT = dt.timedelta(seconds=600)


def gate(store: dist.TCPStore, key: str) -> float:
    """With ``gate`` in the spec: wait for the trainer's ``begin/<key>`` (a size's pushes begin, or
    ``end``: nothing is timed any more). A receiver that built the next size's model (1 GiB of
    random numbers at 1 GiB) or exited (freeing its memory) after its last push of a size took
    the cores of the other contenders' pushes still timed after it (2026-12-04: up to 3x their
    time to all in the last round of every point); now that waits for the trainer's word."""
    store.wait([f"begin/{key}"], GATE_WAIT)
    return time.time()


def baseline(spec: dict) -> WorkerResult:
    """Receive every planned push by blocking broadcasts, as a generator does today.

    ``plan``: [mode, nominal MiB, pushes] in push order; the model tensors and the packed buffers of
    one size are made once and kept while pushes of that size follow. After push k of (mode, MiB),
    this receiver sets ``done/<mode>/<MiB>/<k>/<rank>``."""
    store = dist.TCPStore(spec["host"], spec["port"], is_master=False, timeout=dt.timedelta(seconds=120))
    pg = group(store, spec["rank"], spec["world"], spec.get("own"))
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    size = -1
    sd: dict[str, torch.Tensor] = {}
    flat: list[torch.Tensor] = []
    count: collections.Counter[tuple[str, int]] = collections.Counter()
    built: list[tuple[int, float]] = []
    for mode, mib, reps in spec["plan"]:
        if mib != size:
            sd, flat = {}, []  # the last size's tensors go before the next size's are made
            if spec.get("gate"):
                built.append((mib, gate(store, str(mib))))
            size, sd = mib, make_state_dict(mib)
        if mode == "packed" and not flat:
            flat = [torch.empty(spec["packed_bytes"], dtype=torch.uint8) for _ in range(2)]
        for _ in range(reps):
            if mode == "naive":
                for t in sd.values():
                    pg.broadcast([t], opts).wait()
            else:
                for i, chunk in enumerate(packed_chunks(sd, spec["packed_bytes"])):
                    buf = flat[i % 2][: chunk.nbytes]
                    pg.broadcast([buf], opts).wait()
                    chunk.unpack(buf)
            store.set(f"done/{mode}/{mib}/{count[mode, mib]}/{spec['rank']}", b"1")
            count[mode, mib] += 1
    if spec.get("gate"):
        gate(store, "end")
    return WorkerResult(built=built)


class SlotServed:
    """A torch module served from a subscriber's slot (``ws_assign``; docs/examples.md, "Serving
    from the subscriber's slot"): its parameters become each version's views, and the ``stream()``
    block that pins a version ends only once the module serves the next one."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._block: contextlib.AbstractAsyncContextManager[ws.WeightStream] | None = None

    async def next(self, sub: ws.Subscriber, version: int) -> None:
        """Serve ``version`` (or a newer one) from the slot: no copy."""
        block = sub.stream(min_version=version, timeout=3600)
        weights = await block.__aenter__()
        self.module.load_state_dict(dict(weights), assign=True)
        previous, self._block = self._block, block
        if previous is not None:
            await previous.__aexit__(None, None, None)  # the slot it pinned is the receiver's again

    async def release(self, own: dict[str, torch.Tensor]) -> None:
        """Give the module tensors of its own (``own``) and let the slot go."""
        if self._block is not None:
            self.module.load_state_dict(own, assign=True)
            block, self._block = self._block, None
            await block.__aexit__(None, None, None)


async def subscriber(spec: dict) -> WorkerResult:
    """Follow the channel until the last version, measuring this process's event-loop lag.

    With ``versions`` ([nominal MiB, mode] per version, in put order) and a store: have every
    version in this generator's own model tensors (``get_into``, or served from the slot in
    ``ws_assign``), as the baselines broadcast into theirs, and count it on the store
    (``done/ws/<version>/<member>``): the bench's time to all ends there for every contender."""
    meter = LagMeter()
    meter.start()
    versions = spec.get("versions") or []
    store = (dist.TCPStore(spec["host"], spec["port"], is_master=False, timeout=dt.timedelta(seconds=120))
             if versions else None)
    async with ws.Subscriber(spec.get("channel", "bench"), address=spec["address"], member_id=spec["member"],
                             timeout=120, transport=spec.get("transport")) as sub:
        if store is None:
            await sub.get(min_version=spec["last_version"], timeout=3600)
        size = -1
        model: dict[str, torch.Tensor] = {}
        served: SlotServed | None = None
        built: list[tuple[int, float]] = []
        for version, (mib, mode) in enumerate(versions):
            if mib != size:
                if served is not None:
                    await served.release(own=model)
                model, served = {}, None  # the last size's tensors go first
                if spec.get("gate"):
                    built.append((mib, await asyncio.to_thread(gate, store, str(mib))))
                # the generator's model tensors: the layout the trainer puts
                size, model = mib, make_state_dict(mib)
                served = SlotServed(make_module(model))  # the same tensors as a torch module's parameters
            assert served is not None
            if mode == "ws_assign":
                await served.next(sub, version)
            else:
                await served.release(own=model)
                # written as it arrives, except in ws_after: copied once readable (as before 2026-12-03)
                await sub.get_into(model, min_version=version, timeout=3600, as_received=mode != "ws_after")
            assert store is not None
            store.set(f"done/ws/{version}/{spec['member']}", b"1")
        if served is not None:
            await served.release(own=model)
        if spec.get("gate"):
            await asyncio.to_thread(gate, store, "end")
    p99 = await meter.stop()
    lags = sorted(meter.samples)
    return WorkerResult(lag_p99_ms=p99, lag_max_ms=lags[-1] * 1e3 if lags else 0.0, built=built)


async def follower(spec: dict) -> WorkerResult:
    """Read every version it can until the publisher goes (a member of benchmarks.recovery)."""
    async with ws.Subscriber(spec.get("channel", "bench"), address=spec["address"], member_id=spec["member"],
                             timeout=spec.get("timeout", 30.0), transport=spec.get("transport")) as sub:
        last = -1
        while True:
            try:
                last = (await sub.get(min_version=last + 1, timeout=3600)).version
            except (ws.PublisherGone, ws.Evicted, ws.Closed):
                return WorkerResult()


async def newcomer(spec: dict) -> WorkerResult:
    """Join late over one-sided reads and time how long until the channel's version is here
    (benchmarks.one_sided --catch-up); then follow until the publisher goes."""
    t0 = time.perf_counter()
    async with ws.Subscriber(spec.get("channel", "bench"), address=spec["address"], member_id=spec["member"],
                             timeout=30.0, transport="one-sided") as sub:
        await sub.get(min_version=spec["version"], timeout=600)
        seconds = time.perf_counter() - t0
        took = dict(sub._receiver._plane.took)  # noqa: SLF001 - the plane's own count by source (no public one)
    return WorkerResult(seconds=seconds, took=took)


def main() -> None:
    spec = msgspec.json.decode(sys.argv[1])
    try:
        if spec["role"] == "baseline":
            result = baseline(spec)
        else:
            import uvloop

            role = {"follower": follower, "newcomer": newcomer}.get(spec["role"], subscriber)
            result = uvloop.run(role(spec))
    except Exception as err:  # reported to the bench, which fails loudly
        result = WorkerResult(error=f"{type(err).__name__}: {err}")
    with open(spec["result"], "wb") as fh:
        fh.write(msgspec.json.encode(result))


if __name__ == "__main__":
    main()
