"""``LLMConfig``: what one engine serves and how much it may hold (target, KV pages, batching)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from configs.speculative import DSparkDecodingConfig, MoeBackend

DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
KernelBackend = Literal["auto", "torch", "flashinfer"]
DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class LLMConfig(BaseModel):
    """One engine: the target checkpoint, an optional DSpark drafter, KV and batching budgets."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="Target checkpoint: a local Hugging Face directory (config.json, "
                       "safetensors, tokenizer) or a Hub model ID ('org/name', downloaded into the Hub cache; "
                       "HF_HUB_OFFLINE=1 uses the cache only). Families: qwen3, llama.")
    revision: str | None = Field(default=None, description="Hub revision (branch, tag or commit) of model when it "
                                 "is a Hub id; None: main.")
    tokenizer: str | None = Field(default=None, description="Tokenizer directory or Hub id; None uses the model's.")
    tokenizer_revision: str | None = Field(default=None, description="Hub revision of tokenizer when it is a Hub "
                                           "id; None: main.")
    speculative_config: DSparkDecodingConfig | None = Field(
        default=None, description="DSpark drafter settings; None decodes autoregressively.")
    dtype: DTypeName = Field(default="auto", description="Weights and activations: auto (float32 on CPU, "
                             "bfloat16 on CUDA), float32, bfloat16, float16.")
    device: str = Field(default="auto", description="auto (cuda if available, else cpu), cpu, cuda, cuda:N.")
    max_model_len: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="Longest prompt + output in tokens; None uses the model's "
        "max_position_embeddings.")
    page_size: Annotated[int, Field(gt=0)] = Field(default=16, description="Tokens per KV page.")
    num_pages: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="KV pages per cache (target, and drafter context); exclusive with "
        "kv_cache_memory.")
    kv_cache_memory: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="Bytes per process for KV pages (target and drafter-context layers share one "
        "page table); exclusive with num_pages. Default: 1 GiB on CPU, 90% of free memory on CUDA.")
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | None = Field(
        default=None, description="vLLM's: the fraction of the GPU's total memory this process may use in all; the KV "
        "pages get what it leaves once the weights are loaded (fraction x total - memory in use). CUDA devices only; "
        "exclusive with num_pages and kv_cache_memory.")
    max_num_seqs: Annotated[int, Field(gt=0)] = Field(default=64, description="Requests decoding at once.")
    max_num_batched_tokens: Annotated[int, Field(gt=0)] = Field(
        default=2048, description="Target tokens per step (prefill chunks + K+1 per decoding request).")
    moe_backend: MoeBackend = Field(
        default="AUTO", description="Expert kernels of the target's MoE layers (qwen3_moe), resolved on each rank: "
        "VANILLA (per-expert loop, the reference), DENSEGEMM (grouped GEMMs, CUDA-graph safe; CPU, or CUDA bf16 on "
        "Hopper+), TRITON (fused Triton expert GEMMs, CUDA-graph safe; CUDA bf16/fp16), AUTO (the fastest that "
        "runs: TRITON, else DENSEGEMM, else VANILLA). The reference's other names are valid values; a "
        "rank that cannot run one raises an error naming the rank, the backend and why. Dense targets: AUTO only.")
    kernel_backend: KernelBackend = Field(
        default="auto", description="Kernels: torch (the reference, any device), flashinfer (CUDA: FlashInfer "
        "paged attention and fused Triton kernels; an error if it cannot run), or auto (flashinfer on a CUDA "
        "device where flashinfer and triton import, torch otherwise; the choice is logged and in rank_info).")
    load_format: Literal["auto", "dummy"] = Field(
        default="auto", description="auto reads the target's safetensors; dummy initializes random weights from "
        "config.json alone (benchmarks of a model shape, as vLLM's load_format='dummy').")
    enforce_eager: bool = Field(
        default=False, description="Never use CUDA graphs. Otherwise, with the flashinfer kernels on one GPU, "
        "decode and verify steps replay graphs captured per batch-size bucket (capture time and memory are "
        "logged).")
    piecewise_cuda_graphs: bool = Field(
        default=True, description="Where CUDA graphs are used on one GPU, the steps no whole-step graph serves "
        "(prompt chunks beside decoding requests, long or ragged chunks; up to 2048 tokens) replay the target's "
        "forward as graphs captured per token bucket, cut at each layer's attention, which runs eagerly with the "
        "step's own plan (vLLM's piecewise graphs). False: those steps run eagerly. Outputs are the same either "
        "way; capture time and memory are in rank_info (piecewise_graphs).")
    seed: int = Field(default=0, description="Seed of the engine's generator for unseeded sampled requests.")
    enable_prefix_caching: bool = Field(
        default=True, description="Reuse the KV pages (and drafter context) of a prompt prefix another request "
        "computed: full pages keyed by their tokens and everything before them, reference-counted, evicted least "
        "recently used when pages run short. Outputs are the same with and without it.")
    enable_mixed_prefill: bool = Field(
        default=True, description="Let a step feed prompt chunks beside decoding requests (vLLM's chunked-prefill "
        "batching). False: a step either computes prompts (new requests, prompt chunks) or decodes and verifies, a "
        "prefill step followed by a decode step while requests decode (SGLang's default): each kind replays a CUDA "
        "graph, where a mixed step runs eagerly (on an H200 at 64 requests 1.7-2.4x the graphed verify step). "
        "Outputs are the same either way.")
    generation_config: Literal["auto", "none"] = Field(
        default="auto", description="Default sampling parameters: auto (vLLM's default) takes what the model's "
        "generation_config.json sets (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as "
        "max_tokens) for every request that leaves them unset; none keeps the engine's own (temperature 1, no "
        "filters, max_tokens 16 in Python, as OpenAI's API).")
    logprobs_mode: Literal["raw", "processed"] = Field(
        default="raw", description="What a request's logprobs are: raw (the target model's log-softmax, before "
        "penalties, temperature and filters; vLLM's default) or processed (the distribution each token was drawn "
        "from: after penalties, temperature and top-k/top-p/min-p; for greedy requests the penalized "
        "log-softmax).")

    @field_validator("device")
    @classmethod
    def validate_device(cls, v: str) -> str:
        if not DEVICE_PATTERN.match(v):
            raise ValueError(f"device must be one of auto, cpu, cuda, cuda:N; got {v!r}")
        return v

    @model_validator(mode="after")
    def validate_budgets(self) -> LLMConfig:
        budgets = [name for name in ("num_pages", "kv_cache_memory", "gpu_memory_utilization")
                   if getattr(self, name) is not None]
        if len(budgets) > 1:
            raise ValueError(f"{' and '.join(budgets)} are mutually exclusive: give one KV budget")
        if self.gpu_memory_utilization is not None and self.device == "cpu":
            raise ValueError("gpu_memory_utilization needs a CUDA device (device is cpu); give kv_cache_memory")
        spec = self.speculative_config
        if spec is not None and spec.speculative_model is None:
            raise ValueError("speculative_config.speculative_model must name the drafter checkpoint")
        if spec is not None and (spec.max_draft_len or 0) + 1 > self.max_num_batched_tokens:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must hold one decoding "
                             f"request's max_draft_len + 1 = {(spec.max_draft_len or 0) + 1} tokens")
        return self
