"""``cluster.LLM``: the runtime engine with its models on a Ray replica (TP shards + a drafter)."""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

import ray

from cluster.executor import RayExecutor, ReplicaFailure
from configs import DSparkDecodingConfig, ReplicaConfig, validate
from configs.cluster import ParallelConfig
from runtime.engine import llm as runtime_llm
from runtime.engine.core import Engine
from runtime.engine.outputs import RequestOutput
from runtime.models.hub import resolve_hub_ids
from runtime.sampling.sampling_params import SamplingParams

log = logging.getLogger(__name__)
PARALLEL_FIELDS = set(ParallelConfig.model_fields)


def connect_ray(address: str | None) -> None:
    """Join the given cluster; with no address, a running one ('auto') if there is one, else start a local one."""
    if ray.is_initialized():
        return
    if address is not None:
        ray.init(address=address)
        return
    try:
        ray.init(address="auto")
        log.info("dspark: joined the running Ray cluster")
    except ConnectionError:
        ray.init()
        log.info("dspark: no running Ray cluster found; started a local one")


class LLM:
    """Same ``generate`` / ``get_metrics`` as ``runtime.LLM``, with the models on Ray actors.

    Keyword arguments: the fields of ``configs.ParallelConfig`` (``tensor_parallel_size``, ``drafter``,
    ``placement_strategy``, ``distributed_backend``, timeouts, ``ray_address``) and of ``configs.LLMConfig``.
    The speculative config is validated here, in the driver: the drafter's checkpoint metadata is read
    and the embedded-draft probe runs once, and actors receive the resolved config.
    """

    def __init__(self, model: str, speculative_config: DSparkDecodingConfig | dict | None = None, **kwargs):
        parallel = {k: kwargs.pop(k) for k in list(kwargs) if k in PARALLEL_FIELDS}
        engine = {"model": str(model), "speculative_config": speculative_config, **kwargs}
        self._open(validate(ReplicaConfig, {"engine": engine, "parallel": parallel}, "cluster.LLM"))

    @classmethod
    def from_config(cls, config: ReplicaConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._open(config)
        return llm

    def _open(self, config: ReplicaConfig) -> None:
        # Hub ids resolve here, in the driver, once: actors receive local paths
        self.config = config.model_copy(update={"engine": resolve_hub_ids(config.engine)})
        connect_ray(config.parallel.ray_address)
        self.engine: Engine | None = None
        self._start()

    def _start(self, metrics=None) -> None:
        self.engine = Engine(self.config.engine, RayExecutor(self.config))
        if metrics is not None:
            self.engine.metrics = metrics

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: runtime_llm.Prompts,
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Like ``runtime.LLM.generate``. If an actor dies or hangs mid-step, every in-flight request fails
        with ``ReplicaFailure`` and the replica is rebuilt (new placement group and process group)."""
        if self.engine is None:
            raise RuntimeError("this LLM was shut down")
        try:
            return runtime_llm.generate(self.engine, prompts, sampling_params, use_tqdm)
        except ReplicaFailure as exc:
            failed = self.engine.abort_all()
            self.rebuild()
            raise ReplicaFailure(f"{exc}; {failed} in-flight request(s) failed; the replica was rebuilt") from exc

    def chat(self, messages, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             tools: list[dict] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Like ``runtime.LLM.chat`` (vLLM's): conversations through the chat template, then ``generate``."""
        return self.generate(runtime_llm.chat_prompts(self.engine, messages, tools, add_generation_prompt,
                                                      continue_final_message, chat_template_kwargs), sampling_params,
                             use_tqdm)

    def stream(self, prompt: str | Seq[int] | dict, params: SamplingParams | None = None):
        """Yield the request's snapshot after every step that committed tokens for it (the last one finished)."""
        request_id = self.engine.add_request(runtime_llm.token_ids(self.engine, prompt),
                                             params or self.engine.default_sampling_params())
        while True:
            for out in self.engine.step():
                if out.request_id == request_id:
                    yield out
                    if out.finished:
                        return

    def rebuild(self, reason: BaseException | None = None) -> None:
        """Replace the replica's actors (new placement group and process group); counters carry over."""
        if reason is not None:
            log.warning("dspark: rebuilding the replica after: %s", reason)
        metrics = self.engine.metrics
        self.engine.executor.shutdown()
        self._start(metrics)

    def health(self, timeout_s: float = 30.0) -> list[dict]:
        """Ask every actor; raises ``ReplicaFailure`` if one is dead or does not answer within ``timeout_s``."""
        return self.engine.executor.health(timeout_s)

    def get_default_sampling_params(self) -> SamplingParams:
        """Like ``runtime.LLM.get_default_sampling_params``."""
        return self.engine.default_sampling_params()

    def get_metrics(self) -> dict:
        return self.engine.get_metrics()

    def rank_info(self) -> list[dict]:
        """One dict per actor: rank, role, node, device, moe_backend, ... (with confidence scheduling, target rank
        0's also holds the engine's step-time table, ``runtime.engine.llm.rank_info``)."""
        return runtime_llm.rank_info(self.engine)

    def shutdown(self) -> None:
        """Kill the replica's actors and remove its placement group."""
        if self.engine is not None:
            self.engine.abort_all()
            self.engine.executor.shutdown()
            self.engine = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
