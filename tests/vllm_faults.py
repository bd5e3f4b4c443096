"""A weight-transfer engine that maps tensors wrong, on purpose: what the checks after a load and the
drill (``weightsync.integrations.vllm.verify``) must catch. Test-only, registered as
``"weightsync-faults"`` the way vLLM loads any backend: :func:`install` writes a one-entry-point
distribution (``vllm.general_plugins``) into a folder and puts it on ``PYTHONPATH``, so every vLLM
process (the engine core and its workers start afresh) registers it too.

``init_info["fault"]``: ``"skip:NAME"`` leaves checkpoint tensor NAME out of every load (a loader
that skips a tensor); ``"swap:A,B"`` hands A's tensor to the model under B's name and B's under A's
(a loader that sends tensors to the wrong parameters; every parameter is still written);
``"corrupt:once"`` / ``"corrupt:always"`` flips bits of the engine's final norm weight after the
first load / after every load (the engine's memory corrupted after its load).

``collective_rpc("weight_transfer_engine", args=("fault", {"fault": "corrupt-adapter"}))`` arms
the adapter fault: the next adapter version registered has one bit of its first ``lora_B`` flipped
in the engine's copy, before the proof (the engine's memory corrupted after registration).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from weightsync.integrations.vllm.worker import WeightsyncEngine, WeightsyncInitInfo

NAME = "weightsync-faults"


@dataclass
class FaultyInitInfo(WeightsyncInitInfo):
    fault: str = ""


class FaultyEngine(WeightsyncEngine):
    init_info_cls = FaultyInitInfo  # type: ignore[assignment]
    fault = ""

    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        super().init_transfer_engine(init_info)
        self.fault = getattr(init_info, "fault", "")

    def __call__(self, what: str = "info", payload: dict | None = None) -> object:
        if what == "fault":
            self.fault = (payload or {})["fault"]
            return None
        if what == "adapters_init":
            answer = super().__call__(what, payload)
            assert self.adapters is not None
            self.adapters.holder.after_register = self._corrupt_adapter  # type: ignore[method-assign]
            return answer
        return super().__call__(what, payload)

    def _corrupt_adapter(self, lora: object) -> None:
        if self.fault == "corrupt-adapter":
            self.fault = ""
            weights = next(iter(lora.loras.values()))  # type: ignore[attr-defined]
            b = weights.lora_b[0] if isinstance(weights.lora_b, list) else weights.lora_b
            b.view(torch.int32).view(-1)[0] ^= 0x00400000  # a mantissa bit of its first element

    def _after_load(self) -> None:
        kind, _, arg = self.fault.partition(":")
        if kind == "corrupt" and (arg == "always" or not getattr(self, "_corrupted", False)):
            self._corrupted = True
            with torch.no_grad():
                norm = dict(self.model.named_parameters())["model.norm.weight"]
                norm.view(torch.int32)[0] ^= 0x00400000  # a mantissa bit of its first element

    def _tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        kind, _, arg = self.fault.partition(":")
        if kind == "skip":
            return ((n, t) for n, t in weights if n != arg)
        if kind == "swap":
            a, b = arg.split(",")
            return (({a: b, b: a}.get(n, n), t) for n, t in weights)
        return weights


def register() -> None:
    from vllm.distributed.weight_transfer import factory

    try:
        factory.WeightTransferEngineFactory.register_engine(NAME, "tests.vllm_faults", "FaultyEngine")
    except ValueError:
        pass  # already registered in this process


def install(folder: Path) -> None:
    """Make this engine a vLLM plugin for this process and every process it starts."""
    info = folder / "weightsync_test_faults-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: weightsync-test-faults\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{NAME} = tests.vllm_faults:register\n")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, str(folder))
    register()
