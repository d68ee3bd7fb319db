"""Ray actors of a replica: ``TargetShard`` (one TP rank) and ``Drafter`` (a separate drafter).

They construct a ``runtime.worker.worker.Worker`` and forward to it; no algorithm lives here.
"""

from __future__ import annotations

import os
import socket

from cluster.dispatch import BatchDecoder, encode_any, encode_results
from configs import LLMConfig
from runtime.engine.heap import freeze_long_lived, unfreeze_long_lived
from runtime.worker.worker import Worker, WorkerPlan


class _WorkerActor:
    def __init__(self, config: LLMConfig, plan: WorkerPlan):
        self.worker = Worker(config, plan)
        self.decoder = BatchDecoder()

    def rendezvous(self) -> str:
        """``tcp://ip:port`` on this node with a free port, for the replica's process group."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{_node_ip()}:{port}"

    def join(self, init_method: str, backend: str, timeout_s: float, allreduce_strategy: str = "NCCL") -> None:
        self.worker.join(init_method, backend, timeout_s, allreduce_strategy)

    def load(self) -> int:
        return self.worker.load()

    def allocate(self, num_pages: int) -> None:
        self.worker.allocate(num_pages)
        freeze_long_lived(f"worker actor {os.getpid()}")  # loaded and captured: this process now only steps

    def execute(self, wire):
        """One step from the driver's delta (``cluster.dispatch``); a target rank's results go back as tuples, a
        separate drafter's proposals as they are, each pickled into one bytes object for the channel."""
        results = self.worker.execute(self.decoder.decode(wire))
        return encode_results(results) if isinstance(results, list) else encode_any(results)

    def start_profile(self, steps: int, trace: str | None = None) -> None:
        self.worker.start_profile(steps, trace)

    def profile_result(self) -> dict | None:
        return self.worker.profile_result()

    def info(self) -> dict:
        import ray

        return {**self.worker.info(), "node": ray.get_runtime_context().get_node_id(), "hostname": socket.gethostname(),
                "pid": os.getpid()}

    def health(self) -> bool:
        return True

    def shutdown(self) -> None:
        self.worker.shutdown()
        unfreeze_long_lived()


class TargetShard(_WorkerActor):
    """One tensor-parallel shard of the target (rank 0 also holds a colocated drafter)."""


class Drafter(_WorkerActor):
    """The drafter on its own GPU (``drafter="separate"``)."""


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()
