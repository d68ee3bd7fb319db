"""Training settings: the DeepSpec drafter recipe and a small target trained from scratch."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from configs.speculative import MarkovHeadType

Autocast = Literal["off", "bfloat16"]
AUTOCAST_HELP = ("Mixed precision: 'bfloat16' runs the forward passes under torch.autocast (weights, gradients "
                 "and optimizer state keep their dtype); 'off' computes in the weights' dtype.")


class DrafterTrainConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    target: str = Field(description="Frozen target checkpoint (Hugging Face directory with its tokenizer).")
    data: str = Field(description="JSONL rows ({'prompt','response'} or {'text'}) or a folder of *.py files.")
    out: str = Field(description="Output directory: the drafter in the DeepSpec layout, plus trainer_state.pt.")
    block_size: Annotated[int, Field(gt=0)] = Field(default=4, description="Draft slots per block (K).")
    num_draft_layers: Annotated[int, Field(gt=0)] = Field(default=1, description="Drafter decoder layers.")
    target_layer_ids: list[int] | None = Field(default=None, description="Captured target layers; default: up to "
                                               "5 evenly spaced in 0..num_layers-2.")
    markov_rank: Annotated[int, Field(ge=0)] = Field(default=64, description="Markov head rank; 0 = DFlash.")
    markov_head_type: MarkovHeadType = Field(default="vanilla", description="vanilla, gated or rnn.")
    confidence_head: bool = Field(default=True, description="Train a confidence head.")
    confidence_head_with_markov: bool = Field(default=True, description="Confidence reads W1[x_{k-1}] too.")
    mask_token_id: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="MASK token; default: the tokenizer's '<mask>', else the first id past it.")
    max_len: Annotated[int, Field(gt=1)] = Field(default=512, description="Tokens per training sequence.")
    batch_size: Annotated[int, Field(gt=0)] = Field(default=8, description="Sequences per step.")
    num_anchors: Annotated[int, Field(gt=0)] = Field(default=64, description="Blocks sampled per sequence.")
    steps: Annotated[int, Field(gt=0)] = Field(default=1000, description="Optimizer steps (a resumed run continues "
                                               "to this total).")
    max_seconds: Annotated[float, Field(gt=0)] | None = Field(default=None, description="Stop (and save) after "
                                                              "this wall time; a rerun resumes.")
    time_budget_s: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="Train for at most this wall time in all (summed over resumed runs): the "
        "learning-rate schedule runs over whichever of steps and this budget ends first, so a run the budget ends "
        "has warmed up and annealed to 0 by then. None: steps alone.")
    lr: Annotated[float, Field(gt=0)] = Field(default=6e-4, description="Peak learning rate (AdamW).")
    warmup_ratio: Annotated[float, Field(ge=0, lt=1)] = Field(default=0.04, description="Linear warmup share.")
    weight_decay: Annotated[float, Field(ge=0)] = Field(default=0.0, description="AdamW weight decay.")
    grad_clip: Annotated[float, Field(gt=0)] = Field(default=1.0, description="Gradient-norm clip.")
    ce_weight: Annotated[float, Field(ge=0)] = Field(default=0.1, description="Cross-entropy weight.")
    l1_weight: Annotated[float, Field(ge=0)] = Field(default=0.9, description="L1(p_draft - p_target) weight.")
    confidence_weight: Annotated[float, Field(ge=0)] = Field(default=1.0, description="Confidence BCE weight.")
    loss_decay: Annotated[float, Field(gt=0)] = Field(default=4.0, description="Slot k weighs exp(-k / decay).")
    device: str = Field(default="auto", description="auto, cpu, cuda, cuda:N.")
    dtype: Literal["float32", "bfloat16"] = Field(default="float32", description="Drafter parameter dtype.")
    target_dtype: Literal["float32", "bfloat16"] = Field(default="float32", description="Dtype the frozen target "
                                                         "is loaded in (bfloat16 halves its memory; use it on GPUs).")
    autocast: Autocast = Field(default="off", description=AUTOCAST_HELP)
    seed: int = Field(default=0, description="Seed of initialization, data order and anchors.")
    init_from: str | None = Field(
        default=None, description="A trained drafter (DeepSpec layout) of the same shape to start from instead of "
        "random weights, e.g. to train one further on new answers; its optimizer state is not kept (the schedule "
        "warms up again); a rerun that resumes from --out's checkpoint continues that one. None: random weights.")
    log_every: Annotated[int, Field(gt=0)] = Field(default=50, description="Steps between log lines.")
    save_every: Annotated[int, Field(gt=0)] = Field(default=500, description="Steps between checkpoints.")
    target_cache: str | None = Field(
        default=None, description="Folder for the target's states of every training example (captured layers and "
        "final hidden, bfloat16, about (m+1) x hidden x 2 bytes a token): filled by one pass of the target before the "
        "first step, reused by later runs on the same examples, layers and target; each step then reads the batch's "
        "states instead of running the target (for CPUs, where the target's forward dominates a step). None: the "
        "target runs on every batch (or target_cache_in_memory).")
    target_cache_in_memory: bool = Field(
        default=False, description="Hold the target's states of every training example in the training device's "
        "memory instead of a folder (about (m+1) x hidden x 2 bytes a token there, at most 60% of what the device has "
        "free before training; more is an error): filled by one pass of the target before the first step, then each "
        "batch's states are a gather on the device (for GPUs, where it saves the target's forward of every epoch "
        "after the first). Not with target_cache.")
    calibration_data: str | None = Field(
        default=None, description="Held-out JSONL prompts (prompt, messages or prompt_ids rows): after training, "
        "the drafter drafts greedily on them through the engine and a confidence temperature per position is "
        "fitted (minimizing the calibration error of the survival products) into config.json as "
        "confidence_temperatures, which confidence scheduling reads; None: no calibration.")
    calibration_prompts: Annotated[int, Field(gt=0)] = Field(default=64, description="Prompts of "
                                                              "calibration_data used.")
    calibration_tokens: Annotated[int, Field(gt=0)] = Field(default=64, description="Greedy tokens per "
                                                             "calibration prompt.")

    @model_validator(mode="after")
    def one_state_cache(self) -> DrafterTrainConfig:
        if self.target_cache is not None and self.target_cache_in_memory:
            raise ValueError("target_cache and target_cache_in_memory: give one (a folder, or the device's memory)")
        return self


class TargetTrainConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    out: str = Field(description="Output Hugging Face directory (weights, config, tokenizer).")
    data: str | None = Field(default=None, description="Folder of *.py files; default: this interpreter's "
                             "standard library sources.")
    vocab_size: Annotated[int, Field(ge=260)] = Field(default=2048, description="Byte-level BPE vocabulary.")
    hidden_size: Annotated[int, Field(gt=0)] = Field(default=256, description="Model width.")
    num_layers: Annotated[int, Field(gt=1)] = Field(default=6, description="Decoder layers.")
    num_heads: Annotated[int, Field(gt=0)] = Field(default=4, description="Attention heads.")
    num_kv_heads: Annotated[int, Field(gt=0)] = Field(default=2, description="Key/value heads.")
    intermediate_size: Annotated[int, Field(gt=0)] | None = Field(default=None, description="MLP width; default 3x.")
    max_len: Annotated[int, Field(gt=1)] = Field(default=256, description="Tokens per training sequence.")
    max_corpus_bytes: Annotated[int, Field(gt=0)] = Field(default=8 << 20, description="Source bytes read.")
    heldout_every: Annotated[int, Field(ge=2)] = Field(default=20, description="Every n-th file is held out.")
    batch_size: Annotated[int, Field(gt=0)] = Field(default=16, description="Sequences per step.")
    steps: Annotated[int, Field(gt=0)] = Field(default=2000, description="Optimizer steps.")
    max_seconds: Annotated[float, Field(gt=0)] | None = Field(default=None, description="Stop after this wall "
                                                              "time; the learning rate reaches 0 by then.")
    lr: Annotated[float, Field(gt=0)] = Field(default=3e-3, description="Peak learning rate.")
    autocast: Autocast = Field(default="off", description=AUTOCAST_HELP)
    device: str = Field(default="auto", description="auto, cpu, cuda, cuda:N.")
    seed: int = Field(default=0, description="Seed.")
