"""How a generation instance reaches its trainer ranks: ``TrainerAddress`` (a worker, shaped like
an RRef's ``rpc_async()`` proxy) and the two plain-RPC entry points it calls there,
``receive_samples`` (the sample stream: ``TrainerRank.receive``) and ``weights_for`` (the
weights of a version), which find the process's trainer role in ``LOCAL.roles``."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from controller.process_state import LOCAL
from workers.types import Sample


# ---- plain-RPC entry points: a generation instance reaches its trainer ranks through these,
# by worker name, never through an RRef. An RRef sent to its owner makes the owner send an
# RRef-protocol acknowledgement back to the sender, and the old weight push made the trainer
# call the joiner (fork requests, user deletes). When that peer has just died, the failed send
# raises a c10::Error inside torch's RRef callback (seen in a stress run) -- the likely way the
# trainer died in test_join_then_kill_loses_no_prompt. With plain functions the trainer only
# ever answers calls; it never starts one towards a generation process.
def receive_samples(samples: list[Sample]) -> int:
    return LOCAL.roles["trainer"].receive(samples)


def weights_for(version: int, dtype: str | None = None) -> dict[str, torch.Tensor]:
    return LOCAL.roles["trainer"].weights_for(version, dtype)


@dataclass(frozen=True)
class _TrainerCalls:
    to: object  # worker name or WorkerInfo
    timeout: float

    def receive(self, samples: list[Sample]):
        import torch.distributed.rpc as rpc

        return rpc.rpc_async(self.to, receive_samples, args=(samples,), timeout=self.timeout)

    def weights_for(self, version: int, dtype: str | None = None):
        import torch.distributed.rpc as rpc

        return rpc.rpc_async(self.to, weights_for, args=(version, dtype), timeout=self.timeout)


@dataclass(frozen=True)
class TrainerAddress:
    """A trainer rank as a generation instance holds it: its worker, plus the two calls an
    instance makes (``receive`` samples, ``weights_for`` a version), shaped like an RRef's
    ``rpc_async()`` proxy. ``of(rref)``: the address of an RRef's owner."""

    to: object  # worker name or WorkerInfo

    @classmethod
    def of(cls, trainer) -> "TrainerAddress":
        return trainer if isinstance(trainer, TrainerAddress) else cls(trainer.owner())

    def rpc_async(self, timeout: float = -1.0) -> _TrainerCalls:
        from torch.distributed.rpc.constants import UNSET_RPC_TIMEOUT

        return _TrainerCalls(self.to, UNSET_RPC_TIMEOUT if timeout < 0 else timeout)
