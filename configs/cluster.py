"""Replica layout on Ray: tensor parallelism, where the drafter runs, placement, timeouts."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from configs.engine import LLMConfig

PlacementStrategy = Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"]


class ParallelConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    tensor_parallel_size: Annotated[int, Field(ge=1)] = Field(
        default=1, description="Target shards, one GPU (or CPU process) each.")
    drafter: Literal["colocated", "separate"] = Field(
        default="colocated", description="colocated: the drafter runs in TP rank 0's process and reads its captured "
        "states in place (the only option on one GPU); separate: its own actor and GPU, fed over NCCL "
        "(needs tensor_parallel_size + 1 GPUs).")
    pipeline_drafter: bool = Field(
        default=False, description="With drafter='separate': the running requests form two groups that take turns, "
        "the drafter drafting one group's next blocks while the target verifies the other's, so neither GPU waits "
        "for the other. Each request then advances every other step: it pays where verifying half the batch costs "
        "about half the time (many requests). Exact-match verification only (use_rejection_sampling=False).")
    pipeline_drafter_min_batch: Annotated[int, Field(ge=1)] = Field(
        default=64, description="With pipeline_drafter: the pipeline runs while at least this many requests are "
        "running or waiting; below, the separate drafter drafts each step's requests in the same step (serially, "
        "every request advancing every step), since two half batches then cost about what the whole one does "
        "(a verify of few requests still reads every weight): on the Qwen3-8B shape the pipeline's bound over the "
        "colocated replica is 1.00 at 64 requests with a 1-layer drafter, 1.06 at 64 and 1.21 at 128 with 5 "
        "(benchmarks/results/2026-12-04-split-verify-costs-*). A switch costs one group's drafts for one step.")
    placement_strategy: PlacementStrategy | None = Field(
        default=None, description="Ray placement-group strategy; None: STRICT_PACK when the replica fits one node, "
        "PACK across nodes otherwise.")
    placement_group: Literal["own", "enclosing"] = Field(
        default="own", description="own: the replica reserves its placement group (cluster.LLM, dspark generate); "
        "enclosing: its actors go into the placement group the building process runs in, from bundle 1 on "
        "(a Serve replica whose deployment declares the bundles, so Serve's scheduler and autoscaler account for "
        "them; build_app sets this).")
    distributed_backend: Literal["auto", "nccl", "gloo"] = Field(
        default="auto", description="torch.distributed backend: auto is nccl on GPUs, gloo on CPUs.")
    allreduce_strategy: Literal["NCCL", "ONESHOT", "AUTO"] = Field(
        default="NCCL", description="How the tensor-parallel ranks sum their partial results (TensorRT-LLM's field "
        "and names): NCCL, torch.distributed's all-reduce on the replica's process group (gloo on a CPU replica), "
        "captured in the CUDA graphs; ONESHOT, one kernel over PyTorch symmetric memory in which every rank reads "
        "its peers' partial rows over NVLink (latency-bound messages up to 8 MiB, longer ones through NCCL; CUDA "
        "ranks on one host; an error naming the rank where it cannot run); AUTO, ONESHOT where every rank can run "
        "it, else NCCL (rank_info() says which and why).")
    init_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=300.0, description="Seconds to wait for placement, process-group setup and weight loading.")
    step_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=600.0, description="Seconds one step may take before the replica is declared failed and rebuilt.")
    idle_park_s: Annotated[float, Field(gt=0)] | None = Field(
        default=2.0, description="Seconds without a step after which the replica parks: its compiled step graph is "
        "torn down, since while it is armed every actor waits for the next step in a spinning read (a CPU core each, "
        "idle or not); the next step arms it again first (~0.1-0.2 s on a CPU host, plus the first executions' "
        "warmup). None: never park (the lowest latency after a pause, a core per actor always busy).")
    ray_address: str | None = Field(
        default=None, description="Ray cluster to join; None joins a running one (address 'auto') or starts a "
        "local one.")


class ReplicaConfig(BaseModel):
    """One replica: the engine settings and its layout on the cluster."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: LLMConfig
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)

    @model_validator(mode="after")
    def separate_needs_a_drafter(self) -> ReplicaConfig:
        if self.parallel.drafter == "separate" and self.engine.speculative_config is None:
            raise ValueError("parallel.drafter='separate' needs a speculative_config (there is no drafter to place)")
        check_pipelined_drafter(self.parallel, self.engine)
        check_allreduce_strategy(self.parallel, self.engine)
        return self


def check_allreduce_strategy(parallel: ParallelConfig, engine: LLMConfig) -> None:
    """``allreduce_strategy='ONESHOT'`` needs ranks to sum over (tensor_parallel_size > 1) and CUDA devices."""
    if parallel.allreduce_strategy != "ONESHOT":
        return
    if parallel.tensor_parallel_size == 1:
        raise ValueError("parallel.allreduce_strategy='ONESHOT' needs tensor_parallel_size > 1 (one rank sums "
                         "nothing); allowed here: 'NCCL' or 'AUTO'")
    if engine.device == "cpu":
        raise ValueError("parallel.allreduce_strategy='ONESHOT' runs on CUDA devices, engine.device is 'cpu'; "
                         "allowed on CPUs: 'NCCL' (gloo's all-reduce) or 'AUTO'")


def check_pipelined_drafter(parallel: ParallelConfig, engine: LLMConfig) -> None:
    """``pipeline_drafter`` needs a separate drafter and exact-match verification; errors name the fields."""
    if not parallel.pipeline_drafter:
        if "pipeline_drafter_min_batch" in parallel.model_fields_set:
            raise ValueError("parallel.pipeline_drafter_min_batch is read with pipeline_drafter=True only; set "
                             "pipeline_drafter=True (with drafter='separate') or leave it out")
        return
    if parallel.drafter != "separate":
        raise ValueError(f"parallel.pipeline_drafter=True needs parallel.drafter='separate', got "
                         f"{parallel.drafter!r} (a colocated drafter shares the target's GPU: nothing to overlap)")
    spec = engine.speculative_config
    if spec is not None and spec.use_rejection_sampling:
        raise ValueError("parallel.pipeline_drafter=True verifies by exact match only: set "
                         "speculative_config.use_rejection_sampling=False (rejection sampling would need the "
                         "drafter's features a step before it has drafted)")
