"""The worker side: every vLLM worker process is a weightsync Subscriber.

vLLM creates one :class:`WeightsyncEngine` per worker (each tensor- and pipeline-parallel rank
of each data-parallel replica) when ``weight_transfer_config={"backend": "weightsync"}``. The
worker then drives it through ``init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights`` / ``finish_weight_update`` (``LLM`` methods or ``collective_rpc``).

What happens in one update:

1. ``update_weights({"min_version": v})`` waits (bounded) until this worker's subscriber holds
   a complete, verified version ``>= v`` and pins it: the receiver keeps writing newer versions
   into its other slot, never into the pinned one.
2. The workers of one replica agree on one version (a max/min all-reduce over vLLM's CPU world
   group; a worker that is behind waits for the newest one). Nothing of the model has been
   touched yet, so a failure here (publisher gone or frozen, deadline) leaves the engine
   serving its previous weights.
3. vLLM's layerwise reload starts, and ``model.load_weights`` reads the pinned version's
   ``(name, tensor)`` views directly: the model's own loaders copy (and, for tensor
   parallelism, slice) out of the receive slot, with no second copy of the version.
4. ``finish_weight_update`` finalizes the reload, then unpins the slot.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightsync.control.engines import disagrees
from weightsync.errors import EngineMismatch, ManifestMismatch, Superseded, SyncTimeout, WeightSyncError
from weightsync.format import adapters as adapter_format
from weightsync.integrations.vllm import checks, plan, replica, sliced
from weightsync.integrations.vllm.adapters import AdapterChannel, AdapterInitInfo
from weightsync.integrations.vllm.replica import GRACE
from weightsync.recorder.recorder import process_recorder
from weightsync.transport.loopthread import LoopThread
from weightsync.transport.subscriber import Subscriber

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

    from weightsync.engine.handles import WeightStream

log = logging.getLogger("weightsync.vllm")


@dataclass
class WeightsyncInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine`` arguments for the ``"weightsync"`` backend.

    Attributes:
        address: the publisher's ``"host:port"`` (its ``pub.address``).
        channel: the channel name the trainer publishes on.
        secret: the channel's shared secret (default ``$WEIGHTSYNC_TOKEN`` in the worker).
        timeout: seconds; joining takes at most twice this, and it is the default bound of
            each ``update_weights``.
        member_id: this worker's name in the channel; the engine appends ``-dp{i}-r{rank}``
            so every worker's name is unique (default: ``vllm-<host>-<pid>``).
        backend: the channel's process-group backend, as the publisher's: ``"auto"`` picks
            NCCL for a worker on a CUDA device (receive slots on that device) and gloo
            otherwise; ``"gloo"`` receives into host memory on any worker.
        transport: the Subscriber's ``transport``: ``"auto"`` (the trainer's shared memory when
            the worker is on its host and receives into host memory, else the group) or
            ``"group"`` (as a worker on another host receives).
        patches: load an update as sparse patches of what changed since the version the engine
            serves, through vLLM's own loader (``load_checkpoint_weight_patches``), where this
            worker still holds that version; False: every update loads the whole version. Default:
            on for workers on CUDA, off on CPU, where vLLM packs linear weights for its kernels and
            a patch of the checkpoint-format parameter would not reach them (docs/vllm.md).
        compare_replicas: after each load, report a digest of what the engine holds to the
            publisher and compare it with the other engines of the same layout that loaded the
            version; one that disagrees loads the version again once, then fails (docs/vllm.md).
        sliced: after the first full load, join again wanting only what this worker's loaders
            read of each tensor (recorded during that load, ``plan.py``), so a tensor-parallel
            worker receives about its share of each later version (over the group). Default off.
    """

    address: str
    channel: str
    secret: str | None = None
    timeout: float = 30.0
    member_id: str | None = None
    backend: str = "auto"
    transport: str = "auto"
    patches: bool | None = None
    compare_replicas: bool = True
    sliced: bool = False

    def __post_init__(self) -> None:
        replica.check_join(self.address, self.channel, self.timeout)


@dataclass
class WeightsyncUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights`` arguments: load version ``>= min_version`` (the newest there is).

    ``timeout`` bounds the wait for it (default: the init ``timeout``).
    """

    min_version: int
    timeout: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.min_version, bool) or not isinstance(self.min_version, int) or self.min_version < 0:
            raise ValueError(f"min_version must be an int >= 0, got {self.min_version!r}")
        if self.timeout is not None and not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout!r}")


@dataclass
class UpdateStats:
    """What the last completed update took, readable with :func:`..engine_info`."""

    version: int
    wait_s: float  # until a version >= min_version was pinned and the workers agreed
    load_s: float  # model.load_weights plus finalizing the layerwise reload (or the sparse patches)
    nbytes: int
    patched: tuple[int, int] | None = None  # loaded as sparse patches: (tensors, elements); None: in full
    received_bytes: int = 0  # what this worker's member received of it (its boxes, when sliced)


class WeightsyncEngine(WeightTransferEngine[WeightsyncInitInfo, WeightsyncUpdateInfo]):
    """vLLM weight-transfer engine ``"weightsync"``: one Subscriber per worker."""

    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo

    def __init__(self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.version: int | None = None  # the version the model holds (None: its initial weights)
        self.last: UpdateStats | None = None
        self._bridge: LoopThread | None = None
        self._sub: Subscriber | None = None
        self._timeout = 30.0
        self._pinned: tuple[contextlib.AbstractAsyncContextManager[WeightStream], WeightStream] | None = None
        self._reloading = False
        self._wait_s = 0.0
        self._load_began = 0.0
        self._member: str | None = None
        self._channel = ""
        self.patches = True  # load what changed as sparse patches where the engine's version is still held
        self._patched: tuple[int, int] | None = None  # the last update's (tensors, elements) patched, else None
        self.patch_fallbacks = 0  # updates whose patches the model's loader refused (loaded in full)
        self._loaded: set[str] | None = None  # what this update's full load wrote (load_weights' names)
        self._full = False  # this update loads the whole version (not sparse patches)
        self.failed: str | None = None  # the last update's failed check: the engine serves no known version
        self.error: str | None = None  # the last update's (or request's) error, where this rank did not raise it
        self.refreshed = 0  # MoE layers whose experts' packed weights the last update refreshed
        self.compare = True  # compare what the engine holds with the other engines of its layout
        self.reloads = 0  # the last update's loads again, after disagreeing with the others
        self.agreement: tuple[int, int] | None = None  # engines holding this one's digest, of those that reported
        self.compare_s = 0.0  # what the last comparison took (the digest and the round trip)
        self._layout = ""
        self.adapters: AdapterChannel | None = None  # the adapter channel this worker follows, if any
        self.merged: str | None = None  # merged mode: the adapter version merged into the weights served
        self.plan: dict[str, Any] | None = None  # what the last full load's loaders read of each tensor (plan.py)
        self._init: WeightsyncInitInfo | None = None
        self._sliced: dict[str, Any] | None = None  # the plan whose boxes this worker's member wants

    def __call__(self, what: str = "info", payload: dict[str, Any] | None = None) -> Any:
        """What ``collective_rpc("weight_transfer_engine", args=(what,))`` returns per worker, as plain
        data: ``"info"`` this worker's state (:func:`weightsync.integrations.vllm.engine_info`);
        ``"digests"`` a digest of every engine parameter's bytes, as the kernels read them
        (:func:`~weightsync.integrations.vllm.engine_digests`); ``"zero"`` zeroes every engine
        parameter (the drill, :func:`~weightsync.integrations.vllm.verify`) and returns how many;
        ``"adapters_init"``, ``"adapters_update"`` and ``"adapters_close"`` (with ``payload``) drive
        this worker's adapter channel (:func:`~weightsync.integrations.vllm.update_adapters`).
        A request that fails raises on the last rank only (``replica.replied``)."""
        if what not in ("info", "plan", "digests"):
            self.error = None
        return replica.replied(self, self._answer, what, payload)

    def _answer(self, what: str, payload: dict[str, Any] | None) -> Any:
        if what.startswith("adapters_"):
            return self._adapter_call(what, payload or {})
        if what == "digests":
            return checks.engine_parameter_digests(self.model)
        if what == "plan":
            return self.plan
        if what == "zero":  # the engine no longer holds any version: the next update loads in full
            self.version = None
            return checks.zero_parameters(self.model)
        if what != "info":
            raise ValueError(f"weightsync engine: unknown request {what!r} (info, digests, plan, zero)")
        last = self.last
        return {"backend": "weightsync", "version": self.version, "member": self._member,
                "wait_s": None if last is None else last.wait_s, "load_s": None if last is None else last.load_s,
                "nbytes": None if last is None else last.nbytes,
                "received_bytes": None if last is None else last.received_bytes,
                "plan_bytes": None if self.plan is None else self.plan["needed_bytes"],
                "patched": None if last is None else last.patched, "patch_fallbacks": self.patch_fallbacks,
                "failed": self.failed, "refreshed": self.refreshed, "reloads": self.reloads,
                "agreement": self.agreement, "compare_s": self.compare_s,
                "adapters": None if self.adapters is None else self.adapters.info(), "merged": self.merged,
                "error": self.error}

    def _adapter_call(self, what: str, payload: dict[str, Any]) -> Any:
        if what == "adapters_init":
            self._adapter_call("adapters_close", {})
            self.adapters = AdapterChannel(self.model, self.vllm_config, AdapterInitInfo(**payload))
            return self.adapters.member
        if what == "adapters_close":
            channel, self.adapters = self.adapters, None
            if channel is not None:
                channel.close()
            return None
        if self.adapters is None:
            raise RuntimeError("weightsync: call init_adapters before update_adapters or update_merged")
        if what == "adapters_merge":
            return self._merge(str(payload["name"]), int(payload.get("min_version") or 0), payload.get("timeout"))
        if what != "adapters_update":
            raise ValueError(f"weightsync engine: unknown request {what!r}")
        return self.adapters.update(dict(payload.get("min_versions") or {}), payload.get("timeout"))

    def _merge(self, name: str, min_version: int, timeout: float | None) -> list[int]:
        """Merged mode: load the base channel's newest version (at least the one served) with adapter
        ``name``'s newest version (at least ``min_version``) merged into the weights it adapts, each
        computed afresh from the base version's own bytes (never from the weights served, so no
        error accumulates), through the full load and its checks. Returns [base version, adapter
        version]."""
        assert self.adapters is not None
        if self._sub is None:
            raise RuntimeError("weightsync: merged mode merges into a version of the base channel: call "
                               "init_weight_transfer_engine first")
        seconds = self._timeout if timeout is None else float(timeout)
        began = time.monotonic()
        self._release()
        entry, factors = self.adapters.pin_adapter(name, min_version, seconds)
        try:
            weights = self._begin(self.version or 0, seconds, began)
            merged = adapter_format.merged_weights(dict(weights), entry, factors)
            tensors = [(n, merged.get(n, t)) for n, t in weights]
            self._load_full(weights, tensors)
            layout, self._layout = self._layout, f"{self._layout}|merged {entry.name}@{entry.version}"
            try:
                self._compare_until_agreed(weights, tensors)
            finally:
                self._layout = layout
            self.merged = f"{entry.name}@{entry.version}"
            self._finish()
            return [weights.version, entry.version]
        finally:
            self.adapters.release()

    # lifecycle ----------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        """Join the channel (bounded by twice ``timeout``); re-initializing leaves the old one. Each
        of vLLM's calls into this engine raises on the last rank only (``replica.replied``)."""
        self.error = None
        replica.replied(self, self._init_engine, init_info)

    def _init_engine(self, init_info: WeightsyncInitInfo) -> None:
        self.shutdown()
        rank, dp = replica.ranks(self.vllm_config)
        base = init_info.member_id or f"vllm-{socket.gethostname()}-{os.getpid()}"
        member = f"{base}-dp{dp}-r{rank}"
        self._timeout = float(init_info.timeout)
        self._bridge = LoopThread(f"ws-vllm-{member}")
        self._init, self._sliced = init_info, None
        made = sliced.bake(self) if init_info.sliced else None
        try:
            sub, member, made = sliced.first_join(self, member, made)
        except BaseException:
            self._bridge.close()
            self._bridge = None
            raise
        self._sub, self._member, self._channel = sub, member, init_info.channel
        if made is not None:
            self._sliced = made
        self.compare = bool(init_info.compare_replicas)
        world = getattr(self.vllm_config.parallel_config, "world_size", 1)
        self._layout = (f"{type(self.model).__name__}|{self.vllm_config.model_config.dtype}|rank {rank} of {world}|"
                        f"{self.device.type}")
        # vLLM's CPU backend packs linear weights for its GEMM kernels (oneDNN, sgl): a patch written
        # into a parameter in checkpoint format would not reach what the kernel reads
        self.patches = self._sliced is None and (self.device.type == "cuda" if init_info.patches is None
                                                 else bool(init_info.patches))
        log.info("vLLM worker %s joined channel %r at %s", member, init_info.channel, init_info.address)

    def _subscriber(self, member: str, want: dict[str, Any] | None = None) -> Subscriber:
        init = self._init
        assert init is not None
        device = self.device if self.device.type == "cuda" and init.backend != "gloo" else "cpu"
        return Subscriber(init.channel, address=init.address, secret=init.secret, timeout=self._timeout,
                          member_id=member, backend=init.backend, device=device,
                          transport="group" if want is not None else init.transport, want=want,
                          accepts=checks.engine_format(self.model_config))

    def shutdown(self) -> None:
        """Leave the channel; the model keeps whatever weights it has."""
        self._release()
        sub, bridge, self._sub, self._bridge = self._sub, self._bridge, None, None
        if bridge is None:
            return
        try:
            if sub is not None:
                bridge.run(sub.aclose(), sub.timeout + GRACE, "leaving the channel")
        except (WeightSyncError, OSError, RuntimeError):
            pass  # leaving is best effort: the publisher evicts a silent member on its own
        finally:
            bridge.close()

    # one update ---------------------------------------------------------------------------
    def start_weight_update(self) -> None:
        """Nothing is touched here: the reload starts only once a version is in hand."""
        self.error = None
        replica.replied(self, self._start)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        replica.replied(self, super().update_weights, update_info)

    def _start(self) -> None:
        if self._sub is None:
            raise RuntimeError("weightsync: call init_weight_transfer_engine before start_weight_update")
        self._release()

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        if self._sub is None or self._bridge is None:
            raise RuntimeError("weightsync: call init_weight_transfer_engine before update_weights")
        if self._pinned is not None:
            raise RuntimeError("weightsync loads a whole version per update: call finish_weight_update "
                               "before the next update_weights")
        timeout = update_info.timeout if update_info.timeout is not None else self._timeout
        weights = self._begin(update_info.min_version, timeout, time.monotonic())
        if weights.since is None or not self._patch(weights):
            self._load_full(weights)
        self._compare_until_agreed(weights)

    def _begin(self, min_version: int, timeout: float, began: float) -> WeightStream:
        """Pin the version the replica's workers agree on (at least ``min_version``) and check its
        format; nothing of the engine is touched yet, so a refusal leaves it serving what it did."""
        replica.pin_agreed(self._pin, self._release, min_version, timeout)
        self._load_began = time.monotonic()
        self._wait_s = self._load_began - began
        assert self._pinned is not None
        weights = self._pinned[1]
        self._patched, self._loaded, self._full, self.reloads, self.agreement = None, None, False, 0, None
        self.merged = None
        refused = checks.format_problem(self.model_config, weights)
        if refused is not None:
            self._release()
            self.failed = f"version {weights.version} refused: {refused}"
            log.error("vLLM worker %s: %s; it still serves version %s", self._member, self.failed, self.version)
            raise EngineMismatch(self.failed, channel=self._channel, member=self._member, version=weights.version)
        return weights

    def _compare_until_agreed(self, weights: WeightStream, tensors: list[tuple[str, torch.Tensor]] | None = None
                              ) -> None:
        """Compare what the engine holds with the other engines of its layout; a disagreement loads
        the version again once, a second one fails closed (this engine, not a stray write)."""
        while self.compare and (disagreement := self._compare(weights.version)) is not None:
            if self.reloads:
                self._release()
                self._fail(disagreement, weights.version)
            self.reloads += 1
            log.warning("vLLM worker %s: %s; loading version %d again", self._member, disagreement, weights.version)
            self._load_full(weights, tensors)

    def _load_full(self, weights: WeightStream, tensors: list[tuple[str, torch.Tensor]] | None = None) -> None:
        """Load the whole pinned version through the model's own loaders (vLLM's layerwise reload),
        check that it wrote every engine parameter (else fail closed), finalize the reload and
        refresh what vLLM's reload leaves stale."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        try:
            initialize_layerwise_reload(self.model)
            self._reloading, self._full = True, True
            with _no_mtp_check():
                pairs = self._tensors(weights) if tensors is None else tensors
                if tensors is None and self._sliced is None:  # whole, out of the slot: record what is read
                    with plan.LoadRecorder() as recorder:  # (it holds the tensors: views of the slot, free)
                        loaded = self.model.load_weights(recorder.watch(pairs))  # type: ignore[operator]
                    self.plan = recorder.plan()
                else:  # a sliced worker's expanded boxes are made one at a time: no recorder holds them
                    loaded = self.model.load_weights(iter(pairs))  # type: ignore[operator]
            self._loaded = None if loaded is None else set(loaded)
        except BaseException:
            self._release()  # finalizes the reload: layers that loaded nothing keep their old tensors
            raise
        problem = self._coverage(weights.version)
        if problem is not None:  # raised from update_weights: vLLM ends the update session itself
            self._release()
            self._fail(problem, weights.version)
        self._finalize()
        if self._loaded is not None:  # the reload is finalized: refresh what it leaves stale
            self.refreshed = len(checks.refresh_fused_experts(self.model, self._loaded))

    def finish_weight_update(self) -> None:
        replica.replied(self, self._finish)

    def _finish(self) -> None:
        if self._pinned is None:
            return  # nothing was loaded (update_weights failed or was not called)
        weights = self._pinned[1]
        problem = self._release()
        if problem is not None:  # fail closed: the engine loaded bytes the publisher wrote again meanwhile
            self._fail(problem, weights.version)
        self.failed = None
        self.version = weights.version
        nbytes = weights.nbytes if self._sliced is None else self._sliced["version_bytes"]
        self.last = UpdateStats(weights.version, self._wait_s, time.monotonic() - self._load_began, nbytes,
                                self._patched, weights.nbytes)
        log.info("vLLM worker %s now serves version %d (waited %.3fs, loaded %.3fs)", self._member, self.version,
                 self.last.wait_s, self.last.load_s)
        if self._init is not None and self._init.sliced and self._sliced is None and self._full and self.plan:
            sliced.join(self)

    # helpers ------------------------------------------------------------------------------
    def _tensors(self, weights: WeightStream) -> Iterable[tuple[str, torch.Tensor]]:
        """The ``(name, tensor)`` pairs a full load hands ``model.load_weights`` (a subclass may
        rename or filter them, as a custom mapping would)."""
        return weights if self._sliced is None else plan.expanded(weights, self._sliced)

    def _coverage(self, version: int) -> str | None:
        """After a full load: every engine parameter written by it? The failure, or None."""
        loaded = self._loaded
        if loaded is None:
            log.warning("vLLM worker %s: model.load_weights returned no names: version %d's coverage is "
                        "not checked", self._member, version)
            return None
        missing = checks.uncovered(self.model, loaded)
        if missing:
            return (f"version {version} did not write {len(missing)} engine parameters (they keep the previous "
                    f"version's bytes, or none): {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
        return None

    def _after_load(self) -> None:
        """Called once the engine holds the loaded version, before it is compared (a test-only
        subclass corrupts the engine's memory here)."""

    def _compare(self, version: int) -> str | None:
        """Tell the publisher a digest of what this engine now holds; the disagreement with the
        other engines of its layout that loaded this version, or None. A publisher that cannot be
        asked does not fail the update (the load itself was checked)."""
        assert self._sub is not None and self._bridge is not None
        self._after_load()
        began = time.monotonic()
        digest = checks.combined_digest(checks.engine_parameter_digests(self.model))
        try:
            counts = self._bridge.run(self._sub.compare_engine(version, self._layout, digest, timeout=self._timeout),
                                      self._timeout + GRACE, f"comparing version {version} with the other engines")
        except WeightSyncError as err:
            log.warning("vLLM worker %s: version %d not compared with the other engines: %s", self._member, version,
                        err)
            return None
        finally:
            self.compare_s = time.monotonic() - began
        self.agreement = (counts.get(digest, 0), sum(counts.values()))
        if not disagrees(counts, digest):
            return None
        others = ", ".join(f"{d[:12]}: {n}" for d, n in sorted(counts.items()) if d != digest)
        return (f"version {version}: this engine holds other weights than the other engines of its layout "
                f"({self._layout}): its digest {digest[:12]} is held by {counts.get(digest, 0)} of "
                f"{sum(counts.values())} ({others})")

    def _fail(self, problem: str, version: int) -> NoReturn:
        """Fail closed: this worker serves no known version until a later update passes; say so in
        ``engine_info`` (``failed``), the log and the flight recorder, and raise."""
        self.version, self.failed = None, problem
        process_recorder().record("engine_check", channel=self._channel, member=self._member or "",
                                  version=version).fail(problem)
        log.error("vLLM worker %s: %s; it serves no known version until a later update passes", self._member, problem)
        raise EngineMismatch(problem, channel=self._channel, member=self._member, version=version)

    def _patch(self, weights: WeightStream) -> bool:
        """Load only what changed since the version the engine serves, as sparse patches through
        vLLM's own loader (``load_checkpoint_weight_patches``: the model's ``load_weights`` maps,
        slices and packs them, NaN marking the elements it keeps); True when that is done. False:
        a full load is needed (a tensor changed in a way a sparse patch cannot say: NaN or a
        non-floating dtype; or the model's loader does not take patches, after which the full load
        rewrites whatever the patch had reached)."""
        if checks.has_packed_experts(self.model):
            log.info("vLLM worker %s: the model's MoE experts keep a packed layout a patch would not respect: "
                     "version %d loads whole", self._member, weights.version)
            return False
        try:
            changes = weights.changes()
        except Superseded as err:  # the version the engine holds is gone here (same host, read in place)
            log.info("vLLM worker %s: %s; version %d loads whole", self._member, err, weights.version)
            return False
        if any(c.indices is None for c in changes):
            log.info("vLLM worker %s: version %d changes a tensor a sparse patch cannot carry: full load",
                     self._member, weights.version)
            return False
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )

        patches = [CheckpointWeightPatch(c.name, c.shape, c.dtype, c.values, c.indices) for c in changes]
        try:
            if patches:
                with _no_mtp_check():
                    load_checkpoint_weight_patches(self.model, patches, validate_unique_indices=False)
        except (NotImplementedError, ValueError, TypeError, AttributeError) as err:
            self.patch_fallbacks += 1
            log.warning("vLLM worker %s: the model's loader does not take sparse patches (%s): version %d "
                        "is loaded in full", self._member, err, weights.version)
            return False
        self._patched = (len(patches), sum(c.values.numel() for c in changes))
        return True

    def _pin(self, min_version: int, timeout: float) -> int:
        assert self._sub is not None and self._bridge is not None
        since = self.version if self.patches else None  # the engine's version: what changed since loads as patches
        deadline = time.monotonic() + timeout

        async def enter() -> tuple[contextlib.AbstractAsyncContextManager[WeightStream], WeightStream]:
            assert self._sub is not None
            left = max(deadline - time.monotonic(), 0.001)
            manager = self._sub.stream(min_version=min_version, timeout=left, since=since)
            return manager, await manager.__aenter__()

        try:
            self._pinned = self._bridge.run(enter(), timeout + GRACE, f"waiting for version >= {min_version}")
        except ManifestMismatch as err:
            if not sliced.unslice(self, err):
                raise
            self._pinned = self._bridge.run(enter(), max(deadline - time.monotonic(), 0.001) + GRACE,
                                            f"waiting for version >= {min_version} as a whole member")
        return self._pinned[1].version

    def _finalize(self) -> None:
        """Finalize a started reload (layers not processed yet are processed now)."""
        if self._reloading:
            self._reloading = False
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

    def _release(self) -> str | None:
        """Finalize a started reload, then unpin the slot (in that order: the reload may still
        hold views of the slot for layers it processes at the end). Returns a problem when the
        version was read in place and the publisher wrote it again meanwhile (None otherwise)."""
        self._finalize()
        pinned, self._pinned = self._pinned, None
        if pinned is None or self._bridge is None:
            return None
        manager, weights = pinned
        weights.close()
        try:
            with contextlib.suppress(SyncTimeout, RuntimeError):
                self._bridge.run(manager.__aexit__(None, None, None), GRACE, "unpinning the receive slot")
        except Superseded as err:  # read in place and written again meanwhile: what was loaded is not it
            return str(err)
        return None


def _no_mtp_check() -> contextlib.AbstractContextManager[Any]:
    """vLLM's guard for partial loads into speculative (MTP) heads, where it exists."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:
        return contextlib.nullcontext()
    return disable_mtp_completeness_check()

