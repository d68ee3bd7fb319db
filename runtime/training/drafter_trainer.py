"""``train_drafter``: the DeepSpec recipe on a frozen target.

Per step: the target (transformers, frozen) runs the batch once, giving the captured layer outputs and its final
hidden states, whose LM-head outputs at the labelled positions are its distributions (or both come from a cache the
target filled once: ``target_cache``, a folder, or ``target_cache_in_memory``); random anchors on supervised tokens
open blocks ``[anchor, MASK...]``; the drafter predicts every block in one pass (embedding and LM head are the
target's, frozen); the Markov head is teacher-forced; the loss is DeepSpec's. Checkpoints (drafter + optimizer +
step + seconds trained) are written every ``save_every`` steps, at ``max_seconds`` and at the end; a rerun resumes
from them. With ``time_budget_s`` the learning-rate schedule runs over whichever of ``steps`` and the budget ends
first.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from configs.training import DrafterTrainConfig
from runtime.kernels import get_backend
from runtime.models.drafter import DrafterSpec, DSparkDrafter
from runtime.models.target import validate_capture_layers
from runtime.training.blocks import attention_mask, block_inputs, block_labels, sample_anchors
from runtime.training.checkpoint import draft_config, save_drafter
from runtime.training.data import batches, read_rows, tokenize
from runtime.training.data_parallel import STATS_FILE, agreed_max, average_gradients, everyone_agrees, rank_and_world
from runtime.training.forward import block_hidden, confidence_logits, teacher_forced_logits
from runtime.training.loss import LossWeights, dspark_loss
from runtime.training.precision import autocast
from runtime.training.schedule import warmup_cosine
from runtime.training.target_states import CachedTarget, DeviceTarget, LiveTarget, open_state_cache
from runtime.worker.devices import resolve_device

log = logging.getLogger(__name__)
STATE_FILE = "trainer_state.pt"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_layer_ids(num_layers: int, count: int = 5) -> list[int]:
    """Up to ``count`` evenly spaced ids in 0..num_layers-2 (the last layer cannot be captured)."""
    last = num_layers - 2
    count = min(count, last + 1)
    return sorted({round(i * last / max(count - 1, 1)) for i in range(count)})


def mask_token_for(tokenizer, vocab_size: int, requested: int | None) -> int:
    if requested is not None:
        mask = requested
    elif "<mask>" in tokenizer.get_vocab():
        mask = tokenizer.convert_tokens_to_ids("<mask>")
    else:
        mask = len(tokenizer)
    if not 0 <= mask < vocab_size:
        raise ValueError(f"mask_token_id {mask} is outside the target vocabulary (0..{vocab_size - 1}); give "
                         "--mask-token-id (an unused id, or add a '<mask>' token to the tokenizer)")
    return mask


def build_drafter(config: dict, device: torch.device, dtype: torch.dtype, seed: int) -> DSparkDrafter:
    spec = DrafterSpec(block_size=config["block_size"], mask_token_id=config["mask_token_id"],
                       target_layer_ids=tuple(config["target_layer_ids"]), markov_rank=config["markov_rank"],
                       markov_head_type=config["markov_head_type"],
                       enable_confidence_head=config["enable_confidence_head"],
                       confidence_head_with_markov=config["confidence_head_with_markov"])
    torch.manual_seed(seed)
    with torch.device(device):
        drafter = DSparkDrafter(Qwen3Config(**config), spec, get_backend("torch"))
    for name, p in drafter.named_parameters():
        if name.endswith("norm.weight"):
            continue
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.zeros_(p)
    if drafter.markov_head is not None:
        torch.nn.init.zeros_(drafter.markov_head.markov_w2.weight)  # start as DFlash; the head learns a correction
    return drafter.to(dtype)


@dataclass
class Clock:
    """Seconds trained, summed over resumed runs of one ``--out``. ``time_fraction`` (the share of the time budget
    used, 0 without one) is set by the training loop from the value every data-parallel rank agrees on, so all
    ranks follow the same learning rate."""

    budget_s: float | None
    before_s: float = 0.0  # trained by earlier runs of the same --out
    started: float = field(default_factory=time.monotonic)
    time_fraction: float = 0.0

    def run_seconds(self) -> float:
        return time.monotonic() - self.started

    def seconds(self) -> float:
        return self.before_s + self.run_seconds()


def lr_lambda(steps: int, warmup_ratio: float, clock: Clock) -> Callable[[int], float]:
    warmup = max(int(steps * warmup_ratio), 1)
    return lambda s: warmup_cosine(s, steps, warmup, clock.time_fraction)


@dataclass
class Run:
    """Everything one training run holds."""

    target: torch.nn.Module
    states: LiveTarget | CachedTarget | DeviceTarget  # the target's captured and final states of a batch
    drafter: DSparkDrafter
    config: dict  # the drafter's config.json
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    clock: Clock
    step: int
    data: Iterator
    generator: torch.Generator


def prepare(cfg: DrafterTrainConfig, rank: int) -> Run:
    """Load the frozen target, build (or resume) the drafter and its optimizer, and the data stream."""
    from runtime.models.hub import resolve_checkpoint

    device = resolve_device(cfg.device)
    target_dir = resolve_checkpoint(cfg.target, "target")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=DTYPES[cfg.target_dtype]).to(device).eval()
    target.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    tconf = target.config.to_dict()
    layer_ids = cfg.target_layer_ids or default_layer_ids(tconf["num_hidden_layers"])
    validate_capture_layers(layer_ids, tconf["num_hidden_layers"])
    config = draft_config(tconf, block_size=cfg.block_size, mask_token_id=mask_token_for(
        tokenizer, tconf["vocab_size"], cfg.mask_token_id), target_layer_ids=layer_ids,
        num_draft_layers=cfg.num_draft_layers, markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
        confidence_head=cfg.confidence_head, confidence_head_with_markov=cfg.confidence_head_with_markov,
        num_anchors=cfg.num_anchors)
    drafter = build_drafter(config, device, DTYPES[cfg.dtype], cfg.seed)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    clock = Clock(cfg.time_budget_s)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.steps, cfg.warmup_ratio, clock))
    step, clock.before_s = resume(Path(cfg.out), drafter, optimizer, scheduler, config)
    if step == 0 and cfg.init_from is not None:
        initialize_from(Path(cfg.init_from), drafter, config)
    examples = tokenize(read_rows(cfg.data), tokenizer, cfg.max_len, tokenizer.eos_token_id)
    if not examples:
        raise ValueError(f"data: {cfg.data} gave no sequence with two supervised tokens")
    seed = cfg.seed + step + 7919 * rank  # a resumed run, and each data-parallel rank, draws new batches
    states = LiveTarget(target, layer_ids)
    if cfg.target_cache is not None:
        states = open_state_cache(states, examples, Path(cfg.target_cache), target_dir, device,
                                  next(drafter.parameters()).dtype, progress=rank == 0)
    elif cfg.target_cache_in_memory:
        with autocast(cfg.autocast, device):  # (the target's forward as a live step runs it)
            states = DeviceTarget(states, examples, progress=rank == 0)
    data = batches(examples, min(cfg.batch_size, len(examples)), seed, tokenizer.pad_token_id or 0)
    clock.started = time.monotonic()  # loading and the state cache are not training time
    clock.time_fraction = 0.0 if cfg.time_budget_s is None else clock.before_s / cfg.time_budget_s
    return Run(target, states, drafter, config, optimizer, scheduler, clock, step, data,
               torch.Generator(device="cpu").manual_seed(seed))


def train_drafter(cfg: DrafterTrainConfig, progress: bool = True) -> dict:
    """Train (or resume) a drafter; returns the last logged statistics plus ``step`` and ``seconds``.

    Inside an initialized ``torch.distributed`` group (Ray Train's workers) it is data parallel: each rank
    draws its own batches and anchors, gradients are averaged before every step, rank 0 writes checkpoints.
    """
    rank, world = rank_and_world()
    run, out = prepare(cfg, rank), Path(cfg.out)
    weights = LossWeights(cfg.ce_weight, cfg.l1_weight, cfg.confidence_weight, cfg.loss_decay)
    device = next(run.drafter.parameters()).device
    stats, step_stats = {}, {}
    bar = tqdm(total=cfg.steps, initial=run.step, desc="train-drafter", disable=not progress or rank != 0)
    while run.step < cfg.steps and run.clock.time_fraction < 1:
        ids, loss_mask, attn, rows = next(run.data)  # on the host
        anchors, keep = sample_anchors(loss_mask * attn, cfg.num_anchors, run.generator)  # host RNG, no device sync
        ids, loss_mask, attn, anchors, keep = (t.to(device) for t in (ids, loss_mask, attn, anchors, keep))
        with autocast(cfg.autocast, device):
            captured, final = run.states(ids, attn, rows)
            loss, step_stats = drafter_step(run.target, run.drafter, ids, loss_mask, attn, anchors, keep, captured,
                                            final, cfg, run.config, weights)
        run.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        average_gradients(run.drafter, world)
        torch.nn.utils.clip_grad_norm_(run.drafter.parameters(), cfg.grad_clip)
        run.optimizer.step()
        if cfg.time_budget_s is not None:
            run.clock.time_fraction = agreed_max(run.clock.seconds(), world, device) / cfg.time_budget_s
        run.scheduler.step()
        run.step += 1
        bar.update(1)
        if run.step % cfg.log_every == 0 or run.step == cfg.steps:
            stats = {name: float(value) for name, value in step_stats.items()}  # the only device sync of a step
            bar.set_postfix(loss=f"{stats['loss']:.3f}", accept=f"{stats['accept_len']:.2f}")
            log.info("step %d %s", run.step, json.dumps({k: round(v, 4) for k, v in stats.items()}))
        timed_out = everyone_agrees(cfg.max_seconds is not None and run.clock.run_seconds() > cfg.max_seconds,
                                    world, device)
        spent = run.clock.time_fraction >= 1  # the time budget is used up: the schedule has annealed to 0
        if rank == 0 and (run.step % cfg.save_every == 0 or run.step == cfg.steps or timed_out or spent):
            save(out, run.drafter, run.optimizer, run.scheduler, run.config, run.step, run.clock.seconds())
        if timed_out or spent:
            break
    bar.close()
    last = stats or {name: float(value) for name, value in step_stats.items()}
    result = {**last, "step": run.step, "seconds": run.clock.run_seconds(), "seconds_in_all": run.clock.seconds(),
              "finished": run.step >= cfg.steps or run.clock.time_fraction >= 1,
              "last_lr": run.optimizer.param_groups[0]["lr"]}
    if rank == 0 and cfg.calibration_data is not None:
        result["calibration"] = calibrate(cfg, device)
        log.info("calibration %s", json.dumps(result["calibration"]))
    if rank == 0:
        (out / STATS_FILE).write_text(json.dumps(result))
    return result


def calibrate(cfg: DrafterTrainConfig, device: torch.device) -> dict:
    """Fit the saved drafter's confidence temperatures on ``cfg.calibration_data`` (held out) through the engine."""
    from transformers import AutoTokenizer

    from runtime.training.calibration import calibrate_drafter
    from runtime.training.distill import dataset_prompts

    prompts = dataset_prompts(cfg.calibration_data, AutoTokenizer.from_pretrained(cfg.target), cfg.calibration_prompts)
    return calibrate_drafter(cfg.target, cfg.out, prompts, cfg.block_size, cfg.calibration_tokens, device=str(device),
                             dtype=cfg.target_dtype)


def drafter_step(target, drafter: DSparkDrafter, ids, loss_mask, attn, anchors, keep, captured, final,
                 cfg: DrafterTrainConfig, config: dict, weights: LossWeights):
    """Every block of the batch through the drafter -> (loss, stats).

    ids, loss_mask, attn [N, L]; anchors, keep [N, A] from ``sample_anchors``; captured [N, L, m*d] and final
    [N, L, d], the frozen target's states of the batch (``LiveTarget``/``CachedTarget``); all on the drafter's device.
    The target's distributions are its LM head on ``final`` at the labelled positions only.
    """
    n, length = ids.shape
    block = cfg.block_size
    block_ids, block_pos = block_inputs(ids, anchors, keep, block, config["mask_token_id"])
    labels, target_index, mask = block_labels(ids, loss_mask * attn, anchors, keep, block)
    embeds = target.get_input_embeddings()(block_ids).to(next(drafter.parameters()).dtype)
    hidden = block_hidden(drafter, embeds, block_pos, captured.to(embeds.dtype),
                          attention_mask(anchors, keep, length, block))
    a = anchors.shape[1]
    hidden4 = hidden.view(n, a, block, -1)
    base = target.lm_head(hidden4.to(target.lm_head.weight.dtype)).float()
    prev = torch.cat([block_ids.view(n, a, block)[:, :, :1], labels[:, :, :-1]], dim=2)
    draft_logits = teacher_forced_logits(drafter, base, prev, hidden4)
    with torch.no_grad():
        at = final[torch.arange(n, device=ids.device)[:, None, None], target_index.clamp_min(0)]  # [N, A, B, d]
        target_logits = target.lm_head(at.to(target.lm_head.weight.dtype))  # (the loss reads it as float32)
    return dspark_loss(draft_logits, target_logits, labels, mask, confidence_logits(drafter, hidden4, prev), weights)


def save(out: Path, drafter, optimizer, scheduler, config: dict, step: int, seconds: float) -> None:
    save_drafter(out, drafter, config)
    torch.save({"step": step, "seconds": seconds, "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, out / STATE_FILE)


STRUCTURE_KEYS = ("block_size", "target_layer_ids", "markov_rank", "markov_head_type", "num_hidden_layers",
                  "enable_confidence_head", "hidden_size", "vocab_size")


def initialize_from(source: Path, drafter: DSparkDrafter, config: dict) -> None:
    """The weights of the trained drafter in ``source`` (any dtype) into ``drafter``; its config must describe the
    same structure (a drafter of other block size, capture layers, heads or target is an error naming the keys)."""
    config_path, weights = source / "config.json", source / "model.safetensors"
    if not (config_path.is_file() and weights.is_file()):
        raise ValueError(f"init_from: {source} holds no drafter (config.json and model.safetensors)")
    saved = json.loads(config_path.read_text())
    changed = sorted(k for k in STRUCTURE_KEYS if saved.get(k) != config.get(k))
    if changed:
        raise ValueError(f"init_from: {source} is a drafter with different {changed} "
                         f"({', '.join(f'{k}={saved.get(k)!r}, not {config.get(k)!r}' for k in changed)})")
    param = next(drafter.parameters())
    state = {k: v.to(param.dtype) for k, v in load_file(str(weights), device=str(param.device)).items()}
    drafter.load_state_dict(state)


def resume(out: Path, drafter, optimizer, scheduler, config: dict) -> tuple[int, float]:
    """Load a previous run's weights and optimizer from ``out``; returns its step and seconds trained (0, 0.0
    without one)."""
    state_path = out / STATE_FILE
    if not state_path.is_file():
        return 0, 0.0
    saved = json.loads((out / "config.json").read_text())
    changed = {k for k in STRUCTURE_KEYS if saved.get(k) != config.get(k)}
    if changed:
        raise ValueError(f"out: {out} holds a run with different {sorted(changed)}; use another --out")
    drafter.load_state_dict(load_file(str(out / "model.safetensors"), device=str(next(drafter.parameters()).device)))
    state = torch.load(state_path, map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"]), float(state.get("seconds", 0.0))
