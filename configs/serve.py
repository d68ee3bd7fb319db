"""``ServeArgs``: the validated ``args`` of the Serve application (also a KubeRay ``serveConfigV2`` entry)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from configs.cluster import ParallelConfig, check_allreduce_strategy, check_pipelined_drafter
from configs.engine import LLMConfig
from configs.hub_ids import is_hub_id


class AutoscalingOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    min_replicas: Annotated[int, Field(ge=0)] = Field(default=1, description="Fewest replicas kept up.")
    max_replicas: Annotated[int, Field(ge=1)] = Field(default=1, description="Most replicas started.")
    target_ongoing_requests: Annotated[float, Field(gt=0)] = Field(
        default=32, description="Ongoing requests per replica the autoscaler aims for.")

    @model_validator(mode="after")
    def ordered(self) -> AutoscalingOptions:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"autoscaling: min_replicas ({self.min_replicas}) must be <= max_replicas "
                             f"({self.max_replicas})")
        return self


class DeploymentOptions(BaseModel):
    """Ray Serve deployment options of the one deployment (each replica owns a whole dspark replica)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_replicas: Annotated[int, Field(ge=1)] = Field(default=1, description="Replicas when not autoscaling.")
    autoscaling: AutoscalingOptions | None = Field(default=None, description="Autoscale replicas; exclusive "
                                                   "with num_replicas > 1.")
    max_ongoing_requests: Annotated[int, Field(ge=1)] = Field(
        default=256, description="Requests one replica handles at once; Serve queues the rest.")
    max_queued_requests: Annotated[int, Field(ge=-1)] = Field(
        default=2048, description="Requests Serve's proxy queues before answering 503 itself (plain text); -1 = "
        "unbounded. Keep it well above max_ongoing_requests: the replica's own 429 is the backpressure.")
    max_waiting_requests: Annotated[int, Field(ge=1)] = Field(
        default=128, description="Requests a replica's scheduler may hold unstarted before answering 429 "
        "with Retry-After; below max_ongoing_requests, so clients get the 429 before Serve's queue fills.")
    graceful_shutdown_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=60, description="Seconds a stopping replica lets in-flight requests finish.")
    health_check_period_s: Annotated[float, Field(gt=0)] = Field(default=10, description="Seconds between checks.")
    health_check_timeout_s: Annotated[float, Field(gt=0)] = Field(default=60, description="A check's deadline.")
    ray_actor_options: dict[str, float | int | str] = Field(
        default_factory=lambda: {"num_cpus": 1}, description="Resources of the Serve replica actor itself "
        "(the driver); the model actors are placed by the replica's own placement group.")

    @model_validator(mode="after")
    def replicas_or_autoscaling(self) -> DeploymentOptions:
        if self.autoscaling is not None and self.num_replicas != 1:
            raise ValueError("deployment: set num_replicas or autoscaling, not both")
        if self.max_waiting_requests >= self.max_ongoing_requests:
            raise ValueError(f"deployment.max_waiting_requests ({self.max_waiting_requests}) must be below "
                             f"max_ongoing_requests ({self.max_ongoing_requests}): a replica never holds more than "
                             "max_ongoing_requests requests, so its 429 could never be sent")
        return self


class ServeArgs(BaseModel):
    """Arguments of ``cluster.serve:build_app`` (and of ``dspark serve``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: LLMConfig = Field(description="The model, drafter and engine budgets.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Replica layout on the cluster.")
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions, description="Serve options.")
    served_model_name: str | None = Field(default=None, description="The model name clients send; default: the "
                                          "model directory's name.")
    api_key: str | None = Field(default=None, description="If set, every route but /health and /metrics requires "
                                "'Authorization: Bearer <api_key>' (checked before the body is read; the scheme is "
                                "case-insensitive, the key compared in constant time).")
    max_body_bytes: Annotated[int, Field(ge=1024)] | None = Field(
        default=None, description="The largest request body taken (a larger one gets a 413 before it is read); "
        "None: 16 MiB, or 128 bytes a token of max_model_len where that is more.")
    stall_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=10.0, description="/health answers 503 (code stalled) while the engine has not finished a step "
        "for this long (a hung device or a step that never ends), so Serve and balancers see it.")
    grammar_compile_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=10.0, description="A structured request's grammar (response_format, structured_outputs, tools with "
        "tool_choice required) is compiled off the engine's thread and must compile within this, else the request "
        "gets a 400 naming this limit; other requests never wait for it.")
    route_prefix: str = Field(default="/", description="Where the app is mounted.")
    max_n: Annotated[int, Field(ge=1, le=128)] = Field(default=16, description="Most samples one request may ask "
                                                      "for (n); more is a 400 naming n.")
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        default=None, description="How chat's tool_choice auto (OpenAI's default when tools are given) tells the "
        "model's tool calls from its text: hermes, <tool_call>{\"name\", \"arguments\"}</tool_call> blocks "
        "(Hermes, Qwen2.5 and Qwen3 chat templates); llama3_json, an answer of {\"name\", \"parameters\"} "
        "objects separated by ';' (Llama 3.1-3.3); none: such a request is a 400 naming tool_choice.")

    @model_validator(mode="after")
    def separate_needs_a_drafter(self) -> ServeArgs:
        if self.parallel.drafter == "separate" and self.engine.speculative_config is None:
            raise ValueError("parallel.drafter='separate' needs engine.speculative_config")
        check_pipelined_drafter(self.parallel, self.engine)
        check_allreduce_strategy(self.parallel, self.engine)
        return self

    @property
    def model_name(self) -> str:
        """The name clients send: served_model_name, else a Hub id as given, else the model directory's name."""
        if self.served_model_name:
            return self.served_model_name
        return self.engine.model if is_hub_id(self.engine.model) else self.engine.model.rstrip("/").rsplit("/", 1)[-1]
