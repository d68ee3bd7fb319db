"""A replica spanning two Ray nodes against the single-process engine: the multi-node rehearsal's check.

Run by ``benchmarks/two_node_rehearsal.sh`` once two Ray nodes are up (one host, disjoint GPU sets, or two hosts):
builds the test suite's near-bigram target (fp32) and an oracle DSpark drafter, decodes the same greedy prompts
with ``runtime.LLM`` in this process and with a ``cluster.LLM`` replica of ``--tensor-parallel-size`` shards (and
``--drafter``) on the cluster at ``--ray-address``, and checks the outputs are equal token for token. Writes which
node each rank ran on and the wall ms per generated token of both (the cost of crossing nodes, at this size mostly
the round trips). Exits 1 if the outputs differ or the replica did not span two nodes.

usage: python3 benchmarks/two_node_check.py --ray-address HOST:PORT --out FILE.json [--device cuda|cpu]
       [--tensor-parallel-size 2] [--drafter colocated|separate]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster import LLM as ReplicaLLM  # noqa: E402
from configs import DSparkDecodingConfig  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402
from tests import builders  # noqa: E402

PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [100, 3], list(range(20, 51)), [7] * 12]


def timed_generate(llm, params) -> tuple[list[list[int]], float]:
    llm.generate(PROMPTS[:1], params)  # untimed: first-call costs
    start = time.perf_counter()
    outputs = [o.token_ids for o in llm.generate(PROMPTS, params)]
    return outputs, 1e3 * (time.perf_counter() - start) / sum(len(o) for o in outputs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ray-address", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--drafter", default="colocated", choices=["colocated", "separate"])
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dspark-two-nodes-"))
    target = builders.save_target(root / "target", "qwen3", seed=4, residual_scale=0.6)
    config = builders.drafter_config(target, block_size=3, markov_rank=builders.VOCAB)
    tensors = builders.drafter_tensors(config)
    builders.make_oracle(tensors, config, builders.bigram_table(target))
    drafter = builders.save_drafter(root / "drafter", config, tensors)
    spec = DSparkDecodingConfig(speculative_model=str(drafter))
    engine = dict(dtype="float32", device=args.device, num_pages=256, page_size=16, kernel_backend="torch")
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    want, local_ms = timed_generate(LLM(str(target), speculative_config=spec, **engine), params)
    with ReplicaLLM(str(target), speculative_config=spec, tensor_parallel_size=args.tensor_parallel_size,
                    drafter=args.drafter, ray_address=args.ray_address, **engine) as llm:
        got, replica_ms = timed_generate(llm, params)
        ranks = [{k: info.get(k) for k in ("rank", "role", "node", "hostname")} for info in llm.rank_info()]
    nodes = len({r["node"] for r in ranks})
    record = {"benchmark": "two_node_check", "date": str(date.today()), "command": "python3 " + shlex.join(sys.argv),
              "device": args.device, "tensor_parallel_size": args.tensor_parallel_size, "drafter": args.drafter,
              "ranks": ranks, "nodes": nodes, "outputs_equal": got == want,
              "single_process_ms_per_token": local_ms, "replica_ms_per_token": replica_ms}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    return 0 if got == want and nodes >= 2 else 1


if __name__ == "__main__":
    sys.exit(main())
