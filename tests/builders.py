"""Tiny checkpoints for tests: the product's known pairs (``runtime.training.known_pairs``: transformers targets, a
byte-level BPE tokenizer, DeepSpec drafters written by name from the checkpoint layout), and the tests' own helpers
(transformers' greedy output, an embedded checkpoint, the packed steps an engine ran)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.training.known_pairs import (CHAT_TEMPLATE, CORPUS, HIDDEN, MASK_ID, VOCAB, bigram_table,  # noqa: F401
                                          drafter_config, drafter_tensors, make_oracle, save_drafter, save_target,
                                          save_tokenizer, target_config)


def hf_greedy(target_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers generate(do_sample=False), one prompt at a time, fp32 CPU."""
    from transformers import AutoModelForCausalLM

    return greedy_generate(AutoModelForCausalLM.from_pretrained(str(target_dir)).float().eval(), prompts,
                           max_new_tokens)


def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """``model.generate(do_sample=False)`` of a loaded transformers model, one prompt at a time."""
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(prompt):].tolist())
    return outs


EMBEDDED_LAST_STAGE = ("norm.", "markov_head.", "confidence_head.")


def save_embedded_target(path: Path, target_dir: Path, drafter_dir: Path, stage_layers: dict[int, int] | None = None,
                         window: int | None = None) -> Path:
    """The target of ``target_dir`` carrying the drafter of ``drafter_dir`` in its ``mtp.<s>.*`` namespace (the
    embedded layout: stage 0 ``main_proj``/``main_norm``, stage blocks under the target's layer names, the last
    stage ``norm`` and the heads; ``dspark_*`` keys in config.json; a weight index, which the probe reads).

    ``stage_layers`` {stage: target layer} takes those stages' blocks from the target's own layers (an MoE
    target's stages are its MoE blocks) instead of the drafter's layers."""
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(target_dir, path)
    target = load_file(str(path / "model.safetensors"))
    drafter_config = json.loads((drafter_dir / "config.json").read_text())
    drafter = load_file(str(drafter_dir / "model.safetensors"))
    stages = drafter_config["num_hidden_layers"]
    last = stages - 1
    for name, tensor in drafter.items():
        if name.startswith(("embed_tokens.", "lm_head.")):
            continue
        if name == "fc.weight":
            target["mtp.0.main_proj.weight"] = tensor
        elif name == "hidden_norm.weight":
            target["mtp.0.main_norm.weight"] = tensor
        elif name.startswith(EMBEDDED_LAST_STAGE):
            target[f"mtp.{last}.{name}"] = tensor
        else:
            stage, rest = name.removeprefix("layers.").split(".", 1)
            if int(stage) not in (stage_layers or {}):
                target[f"mtp.{stage}.{rest}"] = tensor
    for stage, layer in (stage_layers or {}).items():
        prefix = f"model.layers.{layer}."
        for name in [n for n in target if n.startswith(prefix)]:
            target[f"mtp.{stage}.{name.removeprefix(prefix)}"] = target[name].clone()
    save_file({k: v.contiguous() for k, v in target.items()}, str(path / "model.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        name: "model.safetensors" for name in target}}))
    config = json.loads((path / "config.json").read_text())
    config.update(dspark_block_size=drafter_config["block_size"], dspark_noise_token_id=drafter_config["mask_token_id"],
                  dspark_target_layer_ids=drafter_config["target_layer_ids"],
                  dspark_markov_rank=drafter_config["markov_rank"],
                  dspark_markov_head_type=drafter_config["markov_head_type"])
    if window is not None:
        config["dspark_window_size"] = window
    (path / "config.json").write_text(json.dumps(config))
    return path


def record_packed_steps(llm) -> list[tuple[int, list[int]]]:
    """Wrap ``llm``'s executor so that every packed verify step it runs (``ScheduledBatch.packed``) appends
    (its budget, each request's verified draft count) to the list returned."""
    steps: list[tuple[int, list[int]]] = []
    execute = llm.engine.executor.execute

    def recorded(batch):  # (a step's device waits passed on to the engine)
        run = execute(batch)
        results = (yield from run) if inspect.isgenerator(run) else run
        if batch.packed is not None:
            steps.append((batch.packed.budget, [r.num_verified for r in results]))
        return results

    llm.engine.executor.execute = recorded
    return steps
