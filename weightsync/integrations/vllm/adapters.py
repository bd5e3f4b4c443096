"""LoRA adapters into a vLLM worker, in memory: each adapter version registered straight from the slot.

Every worker follows an adapter channel (weightsync.adapters) with a Subscriber of its own. One
``update_adapters`` per engine, in each worker:

1. pins the newest version of the channel that holds every adapter at the versions asked for (the
   workers of one replica agree on one, as for base weights);
2. checks every adapter version it does not hold yet against this engine before anything is
   registered: its modules exist in the model (leaf name among the engine's LoRA modules, the
   layer there), its factors' sizes are the base layer's (an adapter of another base), its rank is
   at most ``max_lora_rank``, the channel holds at most ``max_loras`` adapters and ``keep`` versions
   of each plus the one arriving fit ``max_cpu_loras`` (a new version is registered and proven
   before the oldest goes). One refusal refuses the update; nothing is registered and the
   versions held keep serving;
3. builds each as vLLM builds an adapter read from disk (``LoRAModel.from_lora_tensors``, from a
   copy of the slot's bytes: vLLM scales ``lora_B`` in place), registers it in the model's LoRA
   manager under :func:`adapter_id` and pins it there (the LRU cache never evicts it: an evicted
   adapter would be read again from its placeholder path, which does not exist);
4. proves what the engine now stores: every factor as the manager holds it (packed into
   ``qkv_proj`` and ``gate_up_proj`` where the model fuses them) equals the factor sent, cast to
   the LoRA dtype, ``lora_B`` times the adapter's scaling, computed as vLLM computes it. A factor
   that differs removes everything this update registered and fails it (``EngineMismatch``);
5. keeps the ``keep`` newest versions of each adapter and removes older ones (and every version
   of an adapter the channel no longer holds).

Requests name a version with :func:`weightsync.integrations.vllm.lora_request`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from weightsync.errors import EngineMismatch, WeightSyncError
from weightsync.format import adapters as fmt
from weightsync.format.adapters import AdapterEntry, AdapterSet

if TYPE_CHECKING:
    from weightsync.engine.handles import WeightStream

log = logging.getLogger("weightsync.vllm")

#: the path every weightsync LoRARequest carries: never read while the adapter is registered
PLACEHOLDER = "weightsync://adapter/{name}@{version}"


def adapter_id(name: str, version: int) -> int:
    """The LoRA int id ``name@version`` is registered under, in every worker of every engine."""
    return zlib.crc32(f"{name}@{version}".encode()) % 0x3FFFFFFF + 1


@dataclass
class AdapterInitInfo:
    """``init_adapters`` arguments: the adapter channel's address and name (as for base weights),
    its secret, ``timeout`` (joining takes at most twice it; the default bound of each update),
    ``keep`` (versions of each adapter held, default 2), ``member_id`` and ``transport``."""

    address: str
    channel: str
    secret: str | None = None
    timeout: float = 30.0
    keep: int = 2
    member_id: str | None = None
    transport: str = "auto"

    def __post_init__(self) -> None:
        from weightsync.integrations.vllm import replica

        replica.check_join(self.address, self.channel, self.timeout)
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {self.keep!r}")


class Refused(ValueError):
    """An adapter this engine cannot serve; nothing was registered."""


class AdapterTarget:
    """What one worker's model takes: its LoRA manager and the modules an adapter may name."""

    def __init__(self, model: torch.nn.Module) -> None:
        manager = getattr(model, "lora_manager", None)
        if manager is None:
            raise RuntimeError("this vLLM engine has no LoRA manager: start it with enable_lora=True "
                               "(and max_lora_rank, max_loras at least what the adapters need)")
        self.manager = manager
        self.config = manager.lora_config
        self.model = manager.model
        packed: dict[str, list[str]] = dict(getattr(manager, "packed_modules", {}))
        #: a module an adapter may name -> (the module of the engine that serves it, its index in a fused one)
        self.served: dict[str, tuple[str, int]] = {}
        for name in manager.modules:
            for i, part in enumerate(packed.get(name, [name])):
                self.served[part] = (name, i)
        mapper = getattr(self.model, "hf_to_vllm_mapper", None)
        self.mapper = None if mapper is None else mapper.get_rename_mapper()
        self.skip = getattr(self.model, "lora_skip_prefixes", None)

    def module(self, key: str) -> tuple[str, bool]:
        from vllm.lora.utils import parse_fine_tuned_lora_name

        return parse_fine_tuned_lora_name(key, self.mapper)

    def check(self, entry: AdapterEntry, factors: dict[str, torch.Tensor]) -> None:
        """Refused naming what this engine cannot serve of ``entry``."""
        from vllm.lora.peft_helper import PEFTHelper

        try:
            PEFTHelper.from_dict(entry.peft_config()).validate_legal(self.config)
        except ValueError as err:
            raise Refused(f"adapter {entry.name}@{entry.version}: {err}") from None
        absent = []
        for key, tensor in factors.items():
            module, is_a = self.module(key)
            if module not in self.served:
                absent.append(module)
                continue
            layer = self.manager.modules[self.served[module][0]]
            base = getattr(layer, "base_layer", layer)
            size = _sizes(base, self.served[module][1])
            have = tensor.shape[1] if is_a else tensor.shape[0]
            want = size[0] if is_a else size[1]
            if want is not None and have != want:
                raise Refused(f"adapter {entry.name}@{entry.version}: {key} has {'in' if is_a else 'out'} size "
                              f"{have}, the engine's {module} {want}: an adapter of another base model")
        if absent:
            raise Refused(f"adapter {entry.name}@{entry.version} names modules this engine's model does not have "
                          f"or cannot adapt: {sorted(set(absent))[:6]}")

    def build(self, entry: AdapterEntry, factors: dict[str, torch.Tensor]) -> Any:
        """The LoRAModel vLLM would make of ``entry`` read from disk (from copies of the slot's bytes)."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        helper = PEFTHelper.from_dict(entry.peft_config())
        return LoRAModel.from_lora_tensors(
            adapter_id(entry.name, entry.version), {k: t.clone() for k, t in factors.items()}, helper, device="cpu",
            dtype=self.config.lora_dtype, model_vocab_size=getattr(self.manager, "vocab_size", None),
            weights_mapper=self.mapper, skip_prefixes=self.skip)

    def prove(self, entry: AdapterEntry, factors: dict[str, torch.Tensor], scalings: dict[str, float]) -> str | None:
        """Does the manager store ``entry``'s factors as sent? The first difference, or None."""
        stored = self.manager.get_adapter(adapter_id(entry.name, entry.version))
        if stored is None:
            return f"adapter {entry.name}@{entry.version} is not registered after its registration"
        dtype = self.config.lora_dtype
        for key, sent in factors.items():
            module, is_a = self.module(key)
            served, index = self.served[module]
            weights = stored.loras.get(served) or stored.loras.get(module)
            if weights is None:
                return f"{entry.name}@{entry.version}: the engine holds nothing for {module}"
            held = weights.lora_a if is_a else weights.lora_b
            if isinstance(held, list):
                held = held[index]
            expected = sent.to(dtype=dtype, copy=True)
            if not is_a and scalings[module] != 1:
                expected *= scalings[module]  # as LoRALayerWeights.optimize() scales lora_B
            if held is None or held.shape != expected.shape or not torch.equal(held.cpu(), expected):
                return f"{entry.name}@{entry.version}: the engine's {'lora_A' if is_a else 'lora_B'} of {module} " \
                       "differs from the factor sent"
        return None


def _sizes(base: Any, index: int) -> tuple[int | None, int | None]:
    """(input size, output size) of part ``index`` of a base linear layer (None where unknown)."""
    inputs = getattr(base, "input_size", None)
    outputs = getattr(base, "output_sizes", None)
    out = outputs[index] if isinstance(outputs, (list, tuple)) and index < len(outputs) else \
        getattr(base, "output_size", None)
    return inputs, out


class AdapterHolder:
    """The adapter versions one worker holds in its engine, and the last update's cost."""

    def __init__(self, target: AdapterTarget, keep: int) -> None:
        self.target, self.keep = target, keep
        if keep + 1 > self.capacity:  # no adapter could ever be updated: say so at init_adapters
            raise Refused(f"keep={keep} versions of an adapter and the one arriving need max_cpu_loras >= "
                          f"{keep + 1}; this engine has max_cpu_loras={self.capacity}")
        self.held: dict[str, list[int]] = {}  # adapter -> versions registered, oldest first
        self.channel_version: int | None = None
        self.last: dict[str, Any] = {}
        self.failed: str | None = None

    @property
    def capacity(self) -> int:
        """Adapters the engine's LoRA cache holds (``max_cpu_loras``, by default ``max_loras``)."""
        return int(self.target.config.max_cpu_loras or self.target.config.max_loras)

    def after_register(self, lora: Any) -> None:
        """Called once ``lora`` is registered, before it is proven (a test-only subclass corrupts the
        engine's copy here)."""

    def apply(self, manifest: AdapterSet, pairs: list[tuple[str, torch.Tensor]], channel_version: int) -> None:
        """Register every adapter version of ``manifest`` not held yet (checked, built, proven), then
        drop what ``keep`` and the manifest no longer hold. Refused or EngineMismatch leave what was
        held before."""
        began = time.monotonic()
        config = self.target.config
        names = [e.name for e in manifest.adapters]
        if len(names) > config.max_loras:
            raise Refused(f"the channel holds {len(names)} adapters ({names[:6]}), more than this engine's "
                          f"max_loras={config.max_loras}")
        # a new version is registered (and proven) before the oldest goes: each adapter needs keep + 1
        need = len(names) * (self.keep + 1)
        if need > self.capacity:
            raise Refused(f"{len(names)} adapters x (keep={self.keep} versions + the one arriving) need {need} "
                          f"places in the LoRA cache, more than this engine's max_cpu_loras={self.capacity}")
        new = [e for e in manifest.adapters if e.version not in self.held.get(e.name, [])]
        built = []
        for entry in new:
            factors = fmt.of_adapter(pairs, entry)
            self.target.check(entry, factors)
            lora = self.target.build(entry, factors)
            scalings = {name: w.scaling for name, w in lora.loras.items()}
            built.append((entry, factors, lora, scalings))
        registered: list[int] = []
        try:
            for entry, factors, lora, scalings in built:
                self.target.manager.add_adapter(lora)
                registered.append(lora.id)
                self.target.manager._registered_adapters.pin(lora.id)
                self.after_register(lora)
                problem = self.target.prove(entry, factors, scalings)
                if problem is not None:
                    raise EngineMismatch(problem, version=channel_version)
        except BaseException:
            for lora_id in registered:
                self.target.manager.remove_adapter(lora_id)
            raise
        for entry in new:
            self.held.setdefault(entry.name, []).append(entry.version)
        for name in list(self.held):
            versions = self.held[name] if name in names else []
            drop, keep = versions[:-self.keep] if name in names else self.held[name], versions[-self.keep:]
            for version in drop:
                self.target.manager.remove_adapter(adapter_id(name, version))
            if keep:
                self.held[name] = keep
            else:
                del self.held[name]
        self.channel_version, self.failed = channel_version, None
        nbytes = sum(t.numel() * t.element_size() for _, factors, _, _ in built for t in factors.values())
        self.last = {"adapters": {e.name: e.version for e in new}, "seconds": time.monotonic() - began,
                     "nbytes": nbytes}
        log.info("adapters registered from channel version %d: %s", channel_version,
                 ", ".join(f"{e.name}@{e.version}" for e in new) or "none new")


class AdapterChannel:
    """One worker's adapter channel: its own Subscriber (on a loop thread of its own) and the adapter
    versions it registered in the engine."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, info: AdapterInitInfo) -> None:
        from weightsync.integrations.vllm import replica
        from weightsync.options import Deadlines
        from weightsync.transport.loopthread import LoopThread
        from weightsync.transport.subscriber import Subscriber

        # an engine without LoRA (merged mode only) registers nothing
        self.holder = AdapterHolder(AdapterTarget(model), info.keep) if hasattr(model, "lora_manager") else None
        rank, dp = replica.ranks(vllm_config)
        self.member = f"{info.member_id or f'vllm-{socket.gethostname()}-{os.getpid()}'}-dp{dp}-r{rank}"
        self.channel, self.timeout = info.channel, float(info.timeout)
        self.sub = Subscriber(info.channel, address=info.address, secret=info.secret, timeout=self.timeout,
                              member_id=self.member, backend="gloo", device="cpu", transport=info.transport)
        self.bridge = LoopThread(f"ws-vllm-lora-{self.member}")
        self._pinned: tuple[Any, WeightStream] | None = None
        try:
            self.bridge.run(self.sub.start(), Deadlines.joining(self.timeout) + replica.GRACE,
                            f"joining adapter channel {info.channel!r}")
        except BaseException:
            self.bridge.close()
            raise
        log.info("vLLM worker %s joined adapter channel %r at %s", self.member, info.channel, info.address)

    def info(self) -> dict[str, Any]:
        holder = self.holder
        if holder is None:
            return {"channel": self.channel, "merged_only": True}
        return {"channel": self.channel, "channel_version": holder.channel_version,
                "held": {name: list(versions) for name, versions in holder.held.items()},
                "last": holder.last, "failed": holder.failed}

    def pin_adapter(self, name: str, min_version: int, timeout: float) -> tuple[AdapterEntry, dict[str, torch.Tensor]]:
        """Pin the newest channel version holding adapter ``name`` at ``min_version`` or later (the
        replica's workers agree on one); its entry and factors (views of the slot, valid until
        :meth:`release`)."""
        from weightsync.integrations.vllm import replica

        fmt.check_name(name)
        replica.pin_agreed(lambda target, left: self._pin(target, left, {name: min_version}), self.release, 0,
                           timeout)
        assert self._pinned is not None
        pairs = list(self._pinned[1])
        entry = fmt.decode_manifest(dict(pairs)[fmt.MANIFEST]).entry(name)
        assert entry is not None  # _pin waited for it
        return entry, fmt.of_adapter(pairs, entry)

    def update(self, min_versions: dict[str, int], timeout: float | None) -> dict[str, list[int]]:
        """Register the adapter versions of the newest channel version that holds each adapter of
        ``min_versions`` at least at that version (the workers of the replica agree on one)."""
        from weightsync.integrations.vllm import replica

        holder = self.holder
        if holder is None:
            raise RuntimeError("this vLLM engine has no LoRA manager: start it with enable_lora=True to register "
                               "adapters, or merge them into its weights (update_merged)")
        for name, version in min_versions.items():
            fmt.check_name(name)
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise ValueError(f"adapter {name!r}: min version must be an int >= 0, got {version!r}")
        seconds = self.timeout if timeout is None else float(timeout)
        replica.pin_agreed(lambda target, left: self._pin(target, left, min_versions), self.release, 0, seconds)
        assert self._pinned is not None
        weights = self._pinned[1]
        try:
            pairs = list(weights)
            holder.apply(fmt.decode_manifest(dict(pairs)[fmt.MANIFEST]), pairs, weights.version)
        except (Refused, EngineMismatch) as err:
            holder.failed = str(err)
            log.error("vLLM worker %s: %s; the adapter versions it held still serve", self.member, err)
            raise
        finally:
            self.release()
        return {name: list(versions) for name, versions in holder.held.items()}

    def _pin(self, target: int, seconds: float, min_versions: dict[str, int]) -> int:
        from weightsync.errors import SyncTimeout
        from weightsync.integrations.vllm import replica

        deadline = time.monotonic() + seconds
        sub = self.sub

        async def enter(version: int, left: float) -> tuple[Any, WeightStream]:
            manager = sub.stream(min_version=version, timeout=left)
            return manager, await manager.__aenter__()

        while True:
            left = max(deadline - time.monotonic(), 0.001)
            self._pinned = self.bridge.run(enter(target, left), left + replica.GRACE,
                                           f"waiting for adapter channel version >= {target}")
            weights = self._pinned[1]
            manifest = fmt.decode_manifest(dict(weights)[fmt.MANIFEST])
            short = {n: v for n, v in min_versions.items()
                     if (e := manifest.entry(n)) is None or e.version < v}
            if not short:
                return weights.version
            self.release()
            if time.monotonic() >= deadline:
                newest = [f"{e.name}@{e.version}" for e in manifest.adapters]
                raise SyncTimeout(f"no version of adapter channel {self.channel!r} holds {short} within "
                                  f"{seconds:.3g}s (the newest holds {newest})",
                                  channel=self.channel, member=self.member)
            target = weights.version + 1

    def release(self) -> None:
        from weightsync.integrations.vllm import replica

        pinned, self._pinned = self._pinned, None
        if pinned is None:
            return
        manager, weights = pinned
        weights.close()
        with contextlib.suppress(WeightSyncError, RuntimeError):
            self.bridge.run(manager.__aexit__(None, None, None), replica.GRACE, "unpinning the adapter slot")

    def close(self) -> None:
        from weightsync.integrations.vllm import replica

        self.release()
        try:
            self.bridge.run(self.sub.aclose(), self.timeout + replica.GRACE, "leaving the adapter channel")
        except (WeightSyncError, OSError, RuntimeError):
            pass
        finally:
            self.bridge.close()
