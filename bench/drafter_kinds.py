"""``dspark bench --drafter-kinds``: speculation that never costs, measured on pairs whose worth is known by
construction (``runtime.training.known_pairs``: a pure bigram target, whose greedy next token is
``f(x) = argmax table[x]``), with the engine's defaults (the speculation guard on) against our AR engine and
against DSpark with every block verified (``speculation_guard: false``), per drafter kind and concurrency:

- ``untrained``: a random drafter (almost nothing accepted);
- ``weak``: the oracle drafter (it proposes ``f``'s chain) with 30% of its table's rows wrong (acceptance in between);
- ``good``: the oracle drafter (every draft accepted);
- ``mixed``: the oracle drafter with the rows of every token outside one basin of ``f`` wrong, and half the requests
  prompted into that basin (they accept every draft: the chain never leaves it), half outside (they accept none).

A fourth engine, ``undrafted``, is DSpark that never drafts (``Engine.forced_draft_len`` 0): what a DSpark engine's
plain step costs beside AR's, the floor of what the guard can reach (a plain step still extends the drafter's
context, so that a probe or a return to drafting finds it whole).

Each engine serves a steady load (``SteadyLoad``): ``c`` greedy requests of ``tokens`` tokens (end of sequence
ignored), each replaced by a new one of its class when it finishes, the first ones of staggered lengths so that
requests finish one after another. A kind's engines freeze their long-lived objects out of the garbage collector's
scans once built, as a server does (``runtime.engine.heap``). Each (kind, concurrency) runs an untimed warmup
of ``seconds`` per engine (allocations; the guard learns, as a long-lived serving engine has), then ``rounds``
rounds, each the four engines back to back for ``seconds`` each, each round in another order. Ratios are per
round (paired), reported as the median with the rounds' range. Each row records ``drafter_kind``, ``concurrency``,
``ar_tokens_per_s`` and ``dspark_tokens_per_s`` (the engine's defaults, no hand-set schedule).

On a CPU this measures the decisions, not a GPU's step costs: a tiny model's steps are mostly host time, so the
drafting step's relative cost differs from a GPU's. Absolute tokens/s count only from a GPU run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BLOCK = 7  # K = 7 drafts a block (block_size = max_draft_len)
KINDS = ("untrained", "weak", "good", "mixed")


def basins(successor: list[int]) -> list[int]:
    """[V] the cycle each token's chain under ``successor`` ends in, named by the cycle's smallest token."""
    found: dict[int, int] = {}
    for start in range(len(successor)):
        path, x = [], start
        while x not in found and x not in path:
            path.append(x)
            x = successor[x]
        if x in found:
            name = found[x]
        else:  # a new cycle: from x around back to x
            cycle, y = [x], successor[x]
            while y != x:
                cycle.append(y)
                y = successor[y]
            name = min(cycle)
        for token in path:
            found[token] = name
    return [found[x] for x in range(len(successor))]


def build(root: Path, kind: str, target: Path, table: torch.Tensor, good_tokens: set[int]) -> Path:
    """The drafter of ``kind`` for ``target`` (``table``: its bigram logits [V, V])."""
    import torch

    from runtime.training import known_pairs

    rank = known_pairs.VOCAB if kind != "untrained" else 16  # (an oracle's Markov head is the whole table)
    config = known_pairs.drafter_config(target, block_size=BLOCK, markov_rank=rank, head_type="vanilla",
                                        confidence=True)
    tensors = known_pairs.drafter_tensors(config, seed=1)
    if kind != "untrained":
        drafted = table.clone()
        if kind == "weak":
            wrong = torch.rand(len(table), generator=torch.Generator().manual_seed(3)) < 0.3
        elif kind == "mixed":
            wrong = torch.tensor([x not in good_tokens for x in range(len(table))])
        else:
            wrong = torch.zeros(len(table), dtype=torch.bool)
        rows = wrong.nonzero().flatten()
        drafted[rows, table[rows].argmax(-1)] = -1e4  # those rows propose their second best: never the target's
        known_pairs.make_oracle(tensors, config, drafted)
    return known_pairs.save_drafter(root / f"drafter-{kind}", config, tensors)


class SteadyLoad:
    """``c`` requests decoding at all times: one that finishes (``tokens`` tokens) is replaced by a new request of its
    class (for ``mixed``: the same basin), so the batch's mix stays as set, as under a steady serving load. The first
    ``c`` requests ask for ``tokens / c``, ``2 tokens / c``, ... ``tokens``: they finish one after another, so the
    replacements' ages stay spread as a steady load's are (requests that all began together would finish together,
    and a timed window would read a different share of prefill bursts at each phase)."""

    def __init__(self, llm, kind: str, c: int, tokens: int, good: list[int], bad: list[int], seed: int):
        import torch

        from runtime import SamplingParams

        self.engine, self.kind, self.good, self.bad = llm.engine, kind, good, bad
        self.params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, output_kind="delta")
        self.generator = torch.Generator().manual_seed(seed)
        self.classes: dict[str, int] = {}
        for i in range(c):
            self.add(i % 2, max(1, -(-tokens * (i + 1) // c)))

    def add(self, klass: int, tokens: int | None = None) -> None:
        """A new request of ``klass`` (``tokens``: its length, default the load's)."""
        import torch

        from runtime.training import known_pairs

        pool = (self.good if klass == 0 else self.bad) if self.kind == "mixed" else self.good + self.bad
        body = torch.randint(3, known_pairs.VOCAB - 1, (15,), generator=self.generator).tolist()
        last = pool[int(torch.randint(len(pool), (1,), generator=self.generator))]
        params = self.params if tokens is None else dataclasses.replace(self.params, max_tokens=tokens)
        self.classes[self.engine.add_request(body + [last], params)] = klass

    def run(self, seconds: float) -> float:
        """Steps for ``seconds`` of wall time -> output tokens per second."""
        tokens, began = 0, time.perf_counter()
        while time.perf_counter() - began < seconds:
            for out in self.engine.step():
                tokens += len(out.new_token_ids)
                if out.finish_reason is not None:
                    self.add(self.classes.pop(out.request_id))
        return tokens / (time.perf_counter() - began)

    def close(self) -> None:
        self.engine.abort_all()


def measure_kinds(kinds: list[str], concurrency: list[int], tokens: int = 64, rounds: int = 5, seconds: float = 1.0,
                  device: str = "cpu", command: str = "", out: str | None = None) -> dict:
    """The record of every (kind, concurrency): see the module docstring. ``out``: rewritten after each row (a run
    cut short keeps its rows). torch and the engine are imported here: the CLI that offers this loads without them."""
    import torch

    from runtime import LLM
    from runtime.engine.heap import freeze_long_lived, unfreeze_long_lived
    from runtime.training import known_pairs

    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"drafter kinds: unknown {unknown}; choose from {', '.join(KINDS)}")
    root = Path(tempfile.mkdtemp())
    # (heads of 64: the smallest FlashInfer's attention kernels serve, so the pair runs on a GPU's fast path too)
    target = known_pairs.save_target(root / "target", "qwen3", seed=5, residual_scale=0.0, head_dim=64)
    table = known_pairs.bigram_table(target)  # [V, V]
    named = basins(table.argmax(-1).tolist())
    largest = max(set(named), key=named.count)
    good = [x for x in range(3, known_pairs.VOCAB - 1) if named[x] == largest]
    bad = [x for x in range(3, known_pairs.VOCAB - 1) if named[x] != largest]
    dtype = "float32" if device == "cpu" else "bfloat16"
    engine = {"dtype": dtype, "device": device, "max_num_seqs": max(concurrency),
              "max_model_len": 16 + tokens + 2 * BLOCK, "kv_cache_memory": 1 << 30}
    ar = LLM(str(target), **engine)
    rows = []
    hardware = torch.cuda.get_device_name() if device.startswith("cuda") else f"cpu ({os.cpu_count()} cores)"
    record = {"benchmark": "speculation_guard", "date": str(date.today()), "hardware": hardware,
              "host": platform.node(), "torch": torch.__version__, "command": command,
              "max_draft_len": BLOCK, "tokens": tokens, "rounds": rounds, "seconds": seconds,
              "target": "pure bigram (runtime.training.known_pairs, residual 0, heads of 64)",
              "engine": {k: ar.rank_info()[0][k] for k in ("device", "dtype", "kernel_backend", "cuda_graphs")},
              "rows": rows}
    for kind in kinds:
        drafter = build(root, kind, target, table, set(good))
        spec = {"speculative_model": str(drafter), "max_draft_len": BLOCK}
        engines = {"ar": ar, "guarded": LLM(str(target), speculative_config=spec, **engine),
                   "fixed": LLM(str(target), speculative_config={**spec, "speculation_guard": False}, **engine),
                   "undrafted": LLM(str(target), speculative_config={**spec, "speculation_guard": False}, **engine)}
        # the guard's floor: a DSpark engine that never drafts (the engine's profiling knob: a block of 0 every
        # step) still keeps the drafter's context, step by step
        engines["undrafted"].engine.forced_draft_len = 0
        # as a server does once started: the collector's full scans skip the engines' long-lived objects, so no timed
        # window holds a pause that walks them (runtime.engine.heap)
        freeze_long_lived(f"the {kind} engines")
        for c in concurrency:
            rows.append(_measure(engines, kind, c, tokens, rounds, seconds, good, bad))
            print(json.dumps({k: rows[-1][k] for k in ("drafter_kind", "concurrency", "dspark_vs_ar", "fixed_vs_ar",
                                                       "undrafted_vs_ar")}), flush=True)
            if out:
                Path(out).write_text(json.dumps(record, indent=1) + "\n")
        unfreeze_long_lived()  # (the kind's engines' reference cycles can go)
        for name in ("guarded", "fixed", "undrafted"):
            engines[name].shutdown()
    return record


def _measure(engines: dict, kind: str, c: int, tokens: int, rounds: int, seconds: float, good: list[int],
             bad: list[int]) -> dict:
    """One (kind, concurrency) row: every engine warmed up, then ``rounds`` alternating rounds."""
    loads = {name: SteadyLoad(llm, kind, c, tokens, good, bad, seed=c) for name, llm in engines.items()}
    for load in loads.values():  # warmup: allocations, and the guard learns (a serving engine is long-lived)
        load.run(seconds)
    timed = {name: [] for name in engines}
    names = list(loads)
    for r in range(rounds):  # each round in another order (a host's drift favours no engine)
        for name in names[r % len(names):] + names[:r % len(names)]:
            timed[name].append(loads[name].run(seconds))
    for load in loads.values():
        load.close()
    guarded = [g / a for g, a in zip(timed["guarded"], timed["ar"])]
    fixed = [f / a for f, a in zip(timed["fixed"], timed["ar"])]
    undrafted = [u / a for u, a in zip(timed["undrafted"], timed["ar"])]
    return {"drafter_kind": kind, "concurrency": c,
            "ar_tokens_per_s": round(statistics.median(timed["ar"]), 1),
            "dspark_tokens_per_s": round(statistics.median(timed["guarded"]), 1),
            "dspark_fixed_tokens_per_s": round(statistics.median(timed["fixed"]), 1),
            "dspark_vs_ar": round(statistics.median(guarded), 3),
            "dspark_vs_ar_range": [round(min(guarded), 3), round(max(guarded), 3)],
            "fixed_vs_ar": round(statistics.median(fixed), 3),
            "fixed_vs_ar_range": [round(min(fixed), 3), round(max(fixed), 3)],
            "undrafted_vs_ar": round(statistics.median(undrafted), 3),
            "fixed_mean_acceptance_length": engines["fixed"].get_metrics()["mean_acceptance_length"],
            "guard": {k: v for k, v in engines["guarded"].get_metrics()["speculation_guard"].items()
                      if k not in ("buckets", "prompt_buckets")}}
