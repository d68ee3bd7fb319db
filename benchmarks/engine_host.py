"""The engine's own host work per step, without models: ``python benchmarks/engine_host.py [--profile]``.

An ``Engine`` steps over an executor that answers at once with canned results (autoregressive: one token per
request; DSpark: K=7 drafts proposed, 3 accepted; ``--confidence`` adds DSpark with confidence scheduling, the
drafts' confidences falling along the block and a flat step-cost table, so the scheduler trims), so what is timed is only the driver's Python: scheduling,
the step's plain data, committing tokens, stop checks and output snapshots. That work runs on the host while the
GPU waits (the engine prepares a step only after the previous one's tokens are read back), so on a GPU it adds to
every step (``dspark bench``'s ``host_schedule_ms`` and ``host_commit_ms`` are these phases). Runs on any CPU.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs import LLMConfig  # noqa: E402
from runtime.engine.core import Engine  # noqa: E402
from runtime.engine.executor import ExecutorBase  # noqa: E402
from runtime.sampling.sampling_params import SamplingParams  # noqa: E402
from runtime.scheduling.step_io import RequestStepResult, ScheduledBatch  # noqa: E402

VOCAB = 50_000


class CannedExecutor(ExecutorBase):
    """Answers every step at once: each sampled request commits ``accepted`` drafts plus one token and gets a
    block of ``draft_len`` next drafts."""

    def __init__(self, num_pages: int, draft_len: int, accepted: int, confidence: bool = False):
        self.num_pages, self.draft_len, self.accepted, self.confidence = num_pages, draft_len, accepted, confidence
        self.counter = 0

    def execute(self, batch: ScheduledBatch) -> list[RequestStepResult]:
        results = []
        for r in batch.requests:
            if not r.sample:
                results.append(RequestStepResult(r.request_id, [], 0, []))
                continue
            self.counter += 1
            a = min(self.accepted, r.num_drafts)
            tokens = [(self.counter * 7 + i) % (VOCAB - 10) + 5 for i in range(a + 1)]
            drafts = [(self.counter * 11 + i) % (VOCAB - 10) + 5 for i in range(batch.num_next_drafts)]
            # confidences falling along the block (0.9, 0.8, ...), a little different per request
            confidence = [max(0.05, 0.9 - 0.1 * i - 0.01 * (self.counter % 5)) for i in range(len(drafts))] \
                if self.confidence else None
            results.append(RequestStepResult(r.request_id, tokens, a, drafts, next_draft_confidence=confidence))
        return results

    def describe(self) -> list[dict]:
        return [{"draft_confidence_head": self.confidence}]

    def shutdown(self) -> None:
        pass


def model_dir(root: Path) -> Path:
    """A config.json only (the engine reads metadata; the canned executor has no weights)."""
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, max_position_embeddings=65536).save_pretrained(root)
    return root


def cost_table(root: Path) -> Path:
    """A step-cost table where a step costs 1 ms plus 0.05 ms per token fed: verifying a low-confidence draft
    does not pay, so the scheduler trims blocks (its ranking and ragged steps are timed)."""
    tokens = [1, 8, 64, 512, 2048, 8192]
    path = root / "step-costs.json"
    path.write_text(json.dumps({"batch_sizes": [1, 64, 256], "token_counts": tokens,
                                "step_ms": [[1.0 + 0.05 * t for t in tokens]] * 3}))
    return path


def measure(root: Path, requests: int, context: int, speculative: bool, steps: int, profile: bool,
            output_kind: str = "delta", confidence: bool = False) -> dict:
    spec = {"speculative_model": str(root), "max_draft_len": 7} if speculative else None
    if confidence:
        spec.update(enable_confidence_scheduling=True, confidence_cost_table_path=str(cost_table(root)))
    max_tokens = 8 * (steps + 16)  # every request still decoding when the timing ends
    config = LLMConfig(model=str(root), speculative_config=spec,
                       num_pages=requests * ((context + max_tokens) // 16 + 2) + 64,
                       page_size=16, max_num_seqs=requests, max_num_batched_tokens=max(8192, requests * 8),
                       device="cpu", dtype="float32")
    engine = Engine(config, CannedExecutor(config.num_pages, 7 if speculative else 0, 3, confidence))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=output_kind)
    for i in range(requests):
        engine.add_request([(i * 13 + j) % (VOCAB - 10) + 5 for j in range(context)], params)
    while engine.num_waiting:  # prefill everything
        engine.step()
    for _ in range(5):
        engine.step()
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    for _ in range(steps):
        engine.step()
    if profiler:
        profiler.disable()
    ms = 1e3 * (time.perf_counter() - start) / steps
    kind = "confidence" if confidence else "dspark" if speculative else "ar"
    row = {"requests": requests, "context": context, "engine": kind,
           "output_kind": output_kind, "host_ms_per_step": round(ms, 4)}
    if confidence:
        row["verified_per_request"] = round(engine.get_metrics()["confidence_scheduling"][
            "mean_verify_budget_per_request"], 2)
    if profiler:
        stats = pstats.Stats(profiler).sort_stats("tottime")
        row["top"] = [f"{f[0].split('/')[-1]}:{f[1]}:{f[2]} {v[2] * 1e3 / steps:.4f} ms"
                      for f, v in sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:12]]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", default="1,64,256", help="comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--profile", action="store_true", help="also list the functions with the most own time")
    parser.add_argument("--output-kind", default="delta", choices=("cumulative", "delta", "final_only"),
                        help="the requests' SamplingParams.output_kind (the server streams deltas)")
    parser.add_argument("--confidence", action="store_true", help="also DSpark with confidence scheduling")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    kinds = [(False, False), (True, False)] + ([(True, True)] if args.confidence else [])
    with tempfile.TemporaryDirectory() as tmp:
        root = model_dir(Path(tmp))
        for speculative, confidence in kinds:
            for requests in (int(r) for r in args.requests.split(",")):
                rows.append(measure(root, requests, args.context, speculative, args.steps, args.profile,
                                    args.output_kind, confidence))
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"benchmark": "engine_host", "command": " ".join(sys.argv),
                                              "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
