"""Profile engine steps on one GPU (torch.profiler): where a decode step's time goes.

usage: python benchmarks/profile_step.py [--speculative] [--rows N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.replica_step_time import TARGET, build  # noqa: E402
from configs import DSparkDecodingConfig  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--speculative", action="store_true")
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target, drafter = build(Path(tmp), 4)
        spec = DSparkDecodingConfig(speculative_model=str(drafter)) if args.speculative else None
        llm = LLM(str(target), speculative_config=spec, dtype="bfloat16", device="cuda", kv_cache_memory=8 << 30)
        prompts = torch.randint(3, TARGET["vocab_size"], (16, 128)).tolist()
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        for p in prompts:
            llm.engine.add_request(p, params)
        for _ in range(5):
            llm.engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                llm.engine.step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.rows))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
