"""The trainer side for code written against vLLM's trainer API.

``WeightTransferTrainerFactory.trainer_init(WeightsyncTrainerInitInfo(rank=r, address=...),
client=..., source=...)`` on every trainer rank; rank 0 hosts a :class:`weightsync.Publisher`
and points the workers at it. ``send_weights()`` materializes the source (a gather for FSDP,
on every rank, as vLLM's other backends do), puts it as the next version, then drives the
workers' start / update / finish. Code that can ``await`` should use the Publisher directly:
``put`` returns as soon as the snapshot is taken, which this synchronous round trip does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from weightsync.errors import WeightSyncError
from weightsync.integrations.vllm.replica import GRACE
from weightsync.transport.loopthread import LoopThread
from weightsync.transport.publisher import Publisher


@dataclass
class WeightsyncTrainerInitInfo(TrainerInitInfo):
    """Where rank 0's publisher listens and what the workers are told.

    ``address`` is bound as given (``"0.0.0.0:29600"`` for every interface); ``advertise``,
    if set, is the ``"host:port"`` the workers dial instead of ``pub.address``.
    """

    backend: ClassVar[str] = "weightsync"
    address: str = "127.0.0.1:0"
    channel: str = "policy"
    secret: str | None = None
    timeout: float = 30.0
    advertise: str | None = None


class WeightsyncTrainerEngine(TrainerWeightTransferEngine[WeightsyncTrainerInitInfo]):
    init_info_cls = WeightsyncTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None, is_sender: bool,
                 info: WeightsyncTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info
        self.version = 0
        self.publisher: Publisher | None = None
        self._bridge: LoopThread | None = None

    @classmethod
    def trainer_init(cls, init_info: WeightsyncTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> WeightsyncTrainerEngine:
        if source is None:
            raise ValueError("the weightsync trainer engine needs a WeightSource (e.g. ModuleSource(model))")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if engine.is_sender:
            engine._start()
        return engine

    def _start(self) -> None:
        info = self.info
        self._bridge = LoopThread(f"ws-vllm-trainer-{info.channel}")
        pub = Publisher(info.channel, address=info.address, secret=info.secret, timeout=info.timeout)
        self._bridge.run(pub.start(), info.timeout + GRACE, f"starting channel {info.channel!r}")
        self.publisher = pub
        worker_info: dict[str, Any] = {"address": info.advertise or pub.address, "channel": info.channel,
                                       "timeout": info.timeout}
        if info.secret is not None:
            worker_info["secret"] = info.secret
        self.client.init_weight_transfer_engine(worker_info)

    def send_weights(self) -> None:
        """Put the source as the next version and have every worker load it (bounded)."""
        assert self.source is not None
        tensors = {name: tensor.detach() for name, tensor in self.source}  # every rank: it may gather
        self.version += 1
        if not self.is_sender:
            return
        assert self._bridge is not None and self.publisher is not None
        pub, info = self.publisher, self.info
        self._bridge.run(pub.put(tensors, version=self.version), info.timeout + GRACE,
                         f"putting version {self.version}")
        self.client.start_weight_update()
        self.client.update_weights({"min_version": self.version, "timeout": info.timeout})
        self.client.finish_weight_update(str(self.version))

    def shutdown(self) -> None:
        pub, bridge, self.publisher, self._bridge = self.publisher, self._bridge, None, None
        if bridge is None:
            return
        try:
            if pub is not None:
                bridge.run(pub.aclose(), 3 * self.info.timeout + GRACE, "closing the channel")
        except WeightSyncError:
            pass
        finally:
            bridge.close()
