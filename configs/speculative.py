"""``DSparkDecodingConfig``: TensorRT-LLM's DSpark API, field by field, plus documented extensions.

The model is frozen and complete once validated: fields left ``None`` that the
drafter checkpoint knows (``max_draft_len``, ``block_size``, ``mask_token_id``,
``target_layer_ids``, ``markov_rank``, ``markov_head_type``) are read from its
``config.json`` during validation, explicit values winning, and the embedded-draft
probe runs once right then. Both results travel with the object when it is pickled
(to a Ray actor, say), which therefore never touches the checkpoint for them again.

Extensions beyond the reference page (marked "Extension" in their descriptions):
``confidence_threshold`` and ``draft_len_for_batch_size()``.
"""

from __future__ import annotations

import bisect
import enum
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from configs.checkpoint import draft_metadata, probe_draft_is_embedded, read_model_config

MoeBackend = Literal[
    "AUTO", "CUTLASS", "CUTEDSL", "CUTEDSL_FC12", "TRTLLM", "DEEPGEMM", "DENSEGEMM",
    "VANILLA", "TRITON", "MARLIN", "MEGAMOE_DEEPGEMM", "MEGAMOE_CUTEDSL",
]
AttentionBackend = Literal["AUTO", "VANILLA", "TRTLLM", "CUTEDSL"]
MarkovHeadType = Literal["vanilla", "gated", "rnn"]
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# Fields the checkpoint may fill when left None (DESIGN.md section 4).
RESOLVED_FIELDS = ("block_size", "mask_token_id", "target_layer_ids", "markov_rank", "markov_head_type")


class AdvancedSamplingMode(str, enum.Enum):
    """Which sampling filters the deployment compiles in (TensorRT-LLM's enum)."""

    FULL = "FULL"
    NO_TOPK = "NO_TOPK"
    NO_TOPP = "NO_TOPP"
    NO_TOPK_NO_TOPP = "NO_TOPK_NO_TOPP"

    @property
    def allows_top_k(self) -> bool:
        return self in (AdvancedSamplingMode.FULL, AdvancedSamplingMode.NO_TOPP)

    @property
    def allows_top_p(self) -> bool:
        return self in (AdvancedSamplingMode.FULL, AdvancedSamplingMode.NO_TOPK)

    @property
    def allows_min_p(self) -> bool:
        return self is AdvancedSamplingMode.FULL


class SpeculativeDecodingMode(str, enum.Enum):
    """The speculative method a config selects; dspark implements one."""

    DSPARK = "DSPARK"

    def support_dynamic_draft_len(self) -> bool:
        return False


def scheduled_draft_len(schedule: dict[int, int], batch_size: int) -> int:
    """The draft length a ``draft_len_schedule`` gives ``batch_size`` requests: the value of the first key >= the
    batch size (keys are upper bounds), 0 above the largest. Keys in any order."""
    keys = sorted(schedule)
    i = bisect.bisect_left(keys, batch_size)
    return schedule[keys[i]] if i < len(keys) else 0


class DSparkDecodingConfig(BaseModel):
    """Configuration for DSpark speculative decoding: TensorRT-LLM's ``DSparkDecodingConfig`` API, field by field."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    max_draft_len: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="The maximum number of draft tokens (K). If None, the drafter's block size.")
    max_total_draft_tokens: int | None = Field(
        default=None, description="Draft tokens in the draft tree. DSpark drafts a linear chain, so this "
        "defaults to and must equal max_draft_len.")
    speculative_model: str | Path | None = Field(
        default=None, description="The drafter checkpoint (DeepSpec layout), or the target itself for a draft "
        "embedded under mtp.*: a Hugging Face Hub model ID (e.g. 'org/name', downloaded into the Hub cache; "
        "HF_HUB_OFFLINE=1 uses the cache only) or a local directory.")
    revision: str | None = Field(
        default=None, description="Extension. The Hub revision (branch, tag or commit) of speculative_model when "
        "it is a Hub id; None: main.")
    moe_backend: MoeBackend | None = Field(
        default=None, description="MoE backend for the draft model's MoE layers; None inherits the target's.")
    max_concurrency: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="Speculation is disabled at batch sizes above this value. Mutually "
        "exclusive with draft_len_schedule.")
    draft_len_schedule: dict[int, int] | None = Field(
        default=None, description="Batch-size upper bound -> draft length, e.g. {4: 4, 8: 2, 32: 1}: batch "
        "1-4 drafts 4, 5-8 drafts 2, 9-32 drafts 1, 33+ drafts 0 (speculation off).")
    load_format: str | None = Field(
        default=None, description="How the drafter weights are loaded: 'auto' or 'safetensors' (the "
        "checkpoint's safetensors files; the default) or 'dummy' (random weights, for benchmarks).")
    acceptance_rate_window_size: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="Window (N) of speculating steps for the rolling acceptance rate; None or 0 "
        "disables the acceptance gate.")
    acceptance_rate_threshold: Annotated[float, Field(ge=0.0, le=1.0)] | None = Field(
        default=None, description="Speculation is disabled for good once the rolling mean of "
        "accepted/drafted over the last N speculating steps falls below this value.")
    use_rejection_sampling: bool = Field(
        default=False, description="Non-greedy batches: True verifies with rejection sampling against the "
        "draft probabilities; False (default) accepts a draft only if it equals the target's sampled token.")
    allow_advanced_sampling: bool = Field(
        default=False, description="DEPRECATED no-op kept for compatibility; setting it warns.")
    advanced_sampling_mode: AdvancedSamplingMode = Field(
        default=AdvancedSamplingMode.FULL, description="Sampling filters compiled in: FULL (top-k, top-p, "
        "min-p), NO_TOPK, NO_TOPP, NO_TOPK_NO_TOPP. Requests using a filter left out are rejected.")
    enable_penalty: bool = Field(
        default=False, description="Allow repetition/presence/frequency penalties; while off, a request "
        "asking for one is rejected at admission.")
    mask_token_id: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="Token id of the MASK slots of a draft block. If None, from the checkpoint.")
    target_layer_ids: list[int] | None = Field(
        default=None, description="Target decoder layers whose outputs the drafter reads (-1 = embedding "
        "output), strictly increasing, never the last layer. If None, from the checkpoint.")
    block_size: Annotated[int, Field(gt=0)] | None = Field(
        default=None, description="Draft slots per block; must equal max_draft_len. If None, from the "
        "checkpoint.")
    markov_rank: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="Rank of the Markov head; 0 disables it (DFlash). If None, from the "
        "checkpoint (0 when it has none).")
    markov_head_type: MarkovHeadType | None = Field(
        default=None, description="Sequential head type. If None, from the checkpoint, else 'vanilla'.")
    decoding_type: Literal["DSpark"] = Field(default="DSpark", description="Discriminator; always 'DSpark'.")
    attention_backend: AttentionBackend = Field(
        default="AUTO", description="Block-decode attention kernel for a standalone drafter: AUTO (the "
        "engine's kernel backend), VANILLA (pure torch), TRTLLM (FlashInfer trtllm-gen, SM100/SM103 only), "
        "CUTEDSL (MLA drafters only). A backend that cannot run is an error.")
    confidence_threshold: Annotated[float, Field(ge=0.0, le=1.0)] | None = Field(
        default=None, description="Extension. Propose only the leading drafts whose confidence-head "
        "probability is >= this value (per position, DeepSpec's rule); None proposes the whole block.")
    enable_confidence_scheduling: bool = Field(
        default=False, description="TensorRT-LLM 1.4's name. Each step verifies only what pays: every request's "
        "draft survival (cumulative product of its calibrated confidences) against the step-time table, the verify "
        "budget maximizing expected committed tokens per second (capacity from the previous step's confidences, "
        "so it stays lossless); the survivals are corrected online per draft position by what the engine's own "
        "verifications accepted. Needs a drafter with a confidence head.")
    confidence_cost_table_path: str | None = Field(
        default=None, description="TensorRT-LLM 1.4's name. A step-time table (JSON: batch_sizes, token_counts, "
        "step_ms; written by dspark bench --profile-steps) to start from; None: the engine profiles its own steps "
        "at startup. Either way the table keeps learning from the steps the engine serves.")
    confidence_calibration_path: str | None = Field(
        default=None, description="TensorRT-LLM 1.4's name. Per-position confidence temperatures (JSON: "
        "temperatures) fitted on held-out data; None: the drafter config's confidence_temperatures, else 1.")
    confidence_min_predicted_gain: Annotated[float, Field(ge=0.0)] = Field(
        default=0.04, description="TensorRT-LLM 1.4's name. Verify drafts only when the predicted tokens per "
        "second beat verifying none by at least this fraction; trim a step's verifies below whole blocks only "
        "when that beats verifying every draft by at least this fraction. (Whether to draft at all takes no "
        "margin: drafting is held off at a batch size only where the best verify is believed slower than plain "
        "decoding.)")

    speculation_guard: bool = Field(
        default=True, description="Extension. Speculate only where it pays, learned online: a request whose drafts "
        "stop paying for their verify stops verifying them (probed again after 8, 16, ... 512 steps), and a batch "
        "where drafting pays for nobody runs plain decode steps (the whole batch probed likewise); prices come from "
        "the engine's own step times. Lossless: whole blocks are dropped before their verify, from past acceptance "
        "only. A seeded sampled request always verifies its blocks (its tokens must not depend on the batch). Works "
        "with or without a confidence head; off while drafting is pipelined. Turn it off to measure a fixed draft "
        "length.")

    _draft_is_embedded: bool = PrivateAttr(default=False)
    _probed: bool = PrivateAttr(default=False)

    # ---- validators -----------------------------------------------------------------------------

    @model_validator(mode="before")
    @classmethod
    def resolve_from_checkpoint(cls, data: Any) -> Any:
        """Fill fields left None from the drafter's config.json (JSON metadata only)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "sa_config" in data:
            raise ValueError("sa_config: suffix-automaton drafting is not part of dspark; DSpark drafts come "
                             "from the drafter checkpoint (remove the key)")
        if data.get("allow_advanced_sampling"):
            warnings.warn("allow_advanced_sampling is deprecated and has no effect: non-greedy sampling is "
                          "detected per request", DeprecationWarning, stacklevel=3)
        hf_config = read_model_config(data["speculative_model"]) if data.get("speculative_model") else None
        if hf_config is not None:
            found = draft_metadata(hf_config)
            for field in RESOLVED_FIELDS:
                if data.get(field) is None and field in found:
                    data[field] = found[field]
            if data.get("markov_rank") is None:
                data["markov_rank"] = 0
            _check_layers_against_target(data.get("target_layer_ids"), found.get("num_target_layers"))
        if data.get("markov_head_type") is None and (data.get("markov_rank") or 0) > 0:
            data["markov_head_type"] = "vanilla"
        if data.get("max_draft_len") is None:
            data["max_draft_len"] = data.get("block_size")
        if data.get("block_size") is None and isinstance(data.get("max_draft_len"), int):
            data["block_size"] = data["max_draft_len"] or None
        if data.get("max_total_draft_tokens") is None:
            data["max_total_draft_tokens"] = data.get("max_draft_len")
        return data

    @field_validator("draft_len_schedule")
    @classmethod
    def validate_draft_len_schedule_and_sort(cls, v: dict[int, int] | None) -> dict[int, int] | None:
        """Keys >= 1, values >= 0, returned sorted by key (the lookup bisects)."""
        if v is None:
            return None
        if not v:
            raise ValueError("draft_len_schedule must not be empty (use None for no schedule)")
        for batch_size, draft_len in v.items():
            if batch_size < 1:
                raise ValueError(f"draft_len_schedule: batch-size keys must be >= 1, got {batch_size}")
            if draft_len < 0:
                raise ValueError(f"draft_len_schedule: draft lengths must be >= 0, got {draft_len}")
        return dict(sorted(v.items()))

    @field_validator("target_layer_ids")
    @classmethod
    def validate_target_layer_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return None
        if not v:
            raise ValueError("target_layer_ids must not be empty")
        if any(layer < -1 for layer in v):
            raise ValueError(f"target_layer_ids must be >= -1 (-1 is the embedding output), got {v}")
        if any(b <= a for a, b in zip(v, v[1:])):
            raise ValueError(f"target_layer_ids must be strictly increasing, got {v}")
        return list(v)

    @field_validator("load_format")
    @classmethod
    def validate_load_format(cls, v: str | None) -> str | None:
        if v is not None and v not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)} or None, got {v!r}")
        return v

    @model_validator(mode="after")
    def set_max_total_draft_tokens(self) -> DSparkDecodingConfig:
        """A linear chain: ``max_total_draft_tokens`` defaults to ``max_draft_len`` (filled before
        validation, the model being frozen) and must equal it."""
        if self.max_total_draft_tokens != self.max_draft_len:
            raise ValueError(f"max_total_draft_tokens ({self.max_total_draft_tokens}) must equal "
                             f"max_draft_len ({self.max_draft_len}): DSpark drafts a linear chain")
        return self

    @model_validator(mode="after")
    def validate_lengths(self) -> DSparkDecodingConfig:
        k = self.max_draft_len
        if self.block_size is not None and k is not None and self.block_size != k:
            raise ValueError(f"block_size ({self.block_size}) must equal max_draft_len ({k}): slot j of a "
                             "block proposes draft j+1, so a different length changes what the drafter learned")
        if self.draft_len_schedule is not None and k is not None:
            smallest = next(iter(self.draft_len_schedule))
            if self.draft_len_schedule[smallest] != k:
                raise ValueError(f"draft_len_schedule[{smallest}] (the smallest batch-size key) must equal "
                                 f"max_draft_len={k}, got {self.draft_len_schedule[smallest]}")
            too_long = {b: d for b, d in self.draft_len_schedule.items() if d > k}
            if too_long:
                raise ValueError(f"draft_len_schedule: draft lengths must be in 0..max_draft_len={k}, "
                                 f"got {too_long}")
        return self

    @model_validator(mode="after")
    def validate_confidence_scheduling(self) -> DSparkDecodingConfig:
        """The scheduler's files exist, and none of its knobs is set while it is off (it would be ignored)."""
        for name in ("confidence_cost_table_path", "confidence_calibration_path"):
            value = getattr(self, name)
            if value is None:
                continue
            if not self.enable_confidence_scheduling:
                raise ValueError(f"{name} is set but enable_confidence_scheduling is False: set it True or drop "
                                 f"{name}")
            if not Path(value).is_file():
                raise ValueError(f"{name}: {value} is not a file")
        if "confidence_min_predicted_gain" in self.model_fields_set and not self.enable_confidence_scheduling:
            raise ValueError("confidence_min_predicted_gain is set but enable_confidence_scheduling is False")
        if self.enable_confidence_scheduling and self.confidence_threshold is not None:
            raise ValueError("enable_confidence_scheduling and confidence_threshold both trim the proposal: use one")
        return self

    @model_validator(mode="after")
    def validate_max_concurrency_and_draft_len_schedule_mutually_exclusive(self) -> DSparkDecodingConfig:
        if self.max_concurrency is not None and self.draft_len_schedule is not None:
            raise ValueError("max_concurrency and draft_len_schedule are mutually exclusive: use "
                             "max_concurrency for an on/off cutoff, draft_len_schedule for lengths by batch size")
        return self

    @model_validator(mode="after")
    def validate_rejection_sampling_config(self) -> DSparkDecodingConfig:
        """TensorRT-LLM silently turns rejection sampling off under SA-enhanced drafting.

        dspark has no SA drafting (``sa_config`` is refused above), so no draft is ever
        overridden after the drafter proposed it and ``use_rejection_sampling`` is always
        honoured as given; this validator only warms the embedded-draft probe, once per object
        (pydantic re-runs after-validators when a config object is nested into another config).
        """
        if not self._probed:
            self._draft_is_embedded = probe_draft_is_embedded(self.speculative_model)
            self._probed = True
        return self

    # ---- the reference page's methods and properties --------------------------------------------

    def get_runtime_tokens_per_gen_step(self, runtime_draft_len: int) -> int:
        """Target tokens per decoding request for a step drafting ``runtime_draft_len`` tokens."""
        return 1 + runtime_draft_len

    def num_capture_layers(self) -> int:
        """How many target layers' hidden states are captured for the drafter."""
        return len(self.target_layer_ids or ())

    def supports_backend(self, backend: str) -> bool:
        """dspark is a PyTorch engine."""
        return backend == "pytorch"

    @property
    def tokens_per_gen_step(self) -> int:
        """K+1: the anchor plus K drafts; the target never sees MASK fillers."""
        return 1 + (self.max_total_draft_tokens or 0)

    @property
    def is_linear_tree(self) -> bool:
        return self.max_draft_len == self.max_total_draft_tokens

    @property
    def spec_dec_mode(self) -> SpeculativeDecodingMode:
        return SpeculativeDecodingMode.DSPARK

    @property
    def draft_is_embedded_in_target(self) -> bool:
        """True when the draft is the ``mtp.*`` namespace of the target checkpoint.

        Probed once, when the config was validated (see ``configs.checkpoint``); the
        value is part of the pickled object, so actors never probe again.
        """
        return self._draft_is_embedded

    @property
    def uses_external_draft_model(self) -> bool:
        """A standalone drafter checkpoint (not the target's ``mtp.*`` layers)."""
        return self.speculative_model is not None and not self._draft_is_embedded

    @property
    def uses_replacement_heads(self) -> bool:
        """DSpark checkpoints are whole drafters, never replacement MTP heads."""
        return False

    @property
    def needs_separate_draft_weights(self) -> bool:
        return self.uses_external_draft_model or self.uses_replacement_heads

    @property
    def is_resolved(self) -> bool:
        """Every field the drafter needs is known (from the user or the checkpoint)."""
        return all(getattr(self, f) is not None for f in ("max_draft_len", "mask_token_id", "target_layer_ids"))

    def draft_len_for_batch_size(self, batch_size: int) -> int:
        """Extension: the draft length to use when ``batch_size`` requests decode together.

        Schedule keys are upper bounds (the value of the first key >= batch size);
        above the largest key, 0. With ``max_concurrency``: ``max_draft_len`` up to it,
        0 above. Without either: ``max_draft_len``.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        k = self.max_draft_len or 0
        if self.draft_len_schedule is not None:
            return scheduled_draft_len(self.draft_len_schedule, batch_size)
        if self.max_concurrency is not None and batch_size > self.max_concurrency:
            return 0
        return k


def _check_layers_against_target(layer_ids: list[int] | None, num_target_layers: int | None) -> None:
    if layer_ids is None or num_target_layers is None:
        return
    last = int(num_target_layers) - 1
    bad = [layer for layer in layer_ids if not -1 <= layer < last]
    if bad:
        raise ValueError(f"target_layer_ids {list(layer_ids)}: each id must be in -1..{last - 1} for a "
                         f"{num_target_layers}-layer target (the last layer {last} is refused: its HF hidden "
                         f"state is final-normed), got {bad}")
