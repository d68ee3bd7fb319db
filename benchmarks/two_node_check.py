"""A replica spanning two Ray nodes against the single-process engine: the multi-node rehearsal's check.

Run by ``benchmarks/two_node_rehearsal.sh`` once two Ray nodes are up (one host, disjoint GPU sets, or two hosts):
builds the test suite's near-bigram target (fp32) and an oracle DSpark drafter, decodes the same greedy prompts
with ``runtime.LLM`` in this process and with a ``cluster.LLM`` replica of ``--tensor-parallel-size`` shards (and
``--drafter``) on the cluster at ``--ray-address``, placed to span the nodes (SPREAD), and checks the outputs are
equal token for token. Then, if one node can hold the whole replica, the same replica on one node (STRICT_PACK):
the cost of crossing nodes is the spanning replica's wall ms per generated token over the one-node replica's
(``crossing_vs_one_node``; at this model size mostly the round trips). Writes which node each rank ran on.
Exits 1 if an output differs or the spanning replica did not span two nodes.

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
from cluster.placement.plan import PlacementError  # noqa: E402
from configs import DSparkDecodingConfig  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402
from tests import builders  # noqa: E402

PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [100, 3], list(range(20, 51)), [7] * 12]


def timed_generate(llm, params) -> tuple[list[list[int]], float]:
    llm.generate(PROMPTS[:1], params)  # untimed: first-call costs
    start = time.perf_counter()
    outputs = [o.token_ids for o in llm.generate(PROMPTS, params)]
    return outputs, 1e3 * (time.perf_counter() - start) / sum(len(o) for o in outputs)


def replica_run(target: Path, spec, engine: dict, params, tp: int, drafter: str, strategy: str,
                ray_address: str | None) -> tuple[list[list[int]], float, list[dict]]:
    """One replica placed with ``strategy``: its outputs, wall ms per generated token and where each rank ran."""
    with ReplicaLLM(str(target), speculative_config=spec, tensor_parallel_size=tp, drafter=drafter,
                    placement_strategy=strategy, ray_address=ray_address, **engine) as llm:
        got, ms = timed_generate(llm, params)
        ranks = [{k: info.get(k) for k in ("rank", "role", "node", "hostname")} for info in llm.rank_info()]
    return got, ms, ranks


def check(root: Path, device: str, tp: int, drafter: str, ray_address: str | None) -> dict:
    """The rehearsal's record (see the module doc); ``ray_address`` None: the cluster this process is connected to."""
    target = builders.save_target(root / "target", "qwen3", seed=4, residual_scale=0.6)
    config = builders.drafter_config(target, block_size=3, markov_rank=builders.VOCAB)
    tensors = builders.drafter_tensors(config)
    builders.make_oracle(tensors, config, builders.bigram_table(target))
    spec = DSparkDecodingConfig(speculative_model=str(builders.save_drafter(root / "drafter", config, tensors)))
    engine = dict(dtype="float32", device=device, num_pages=256, page_size=16, kernel_backend="torch")
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    want, local_ms = timed_generate(LLM(str(target), speculative_config=spec, **engine), params)
    got, replica_ms, ranks = replica_run(target, spec, engine, params, tp, drafter, "SPREAD", ray_address)
    record = {"device": device, "tensor_parallel_size": tp, "drafter": drafter, "ranks": ranks,
              "nodes": len({r["node"] for r in ranks}), "outputs_equal": got == want,
              "single_process_ms_per_token": local_ms, "replica_ms_per_token": replica_ms}
    try:
        one, one_ms, one_ranks = replica_run(target, spec, engine, params, tp, drafter, "STRICT_PACK", ray_address)
    except PlacementError as exc:  # no node holds the whole replica: nothing to compare against on this cluster
        record["one_node"] = f"not measured: {exc}"
        return record
    record.update(one_node_ranks=one_ranks, one_node_outputs_equal=one == want, one_node_ms_per_token=one_ms,
                  crossing_vs_one_node=replica_ms / one_ms)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ray-address", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--drafter", default="colocated", choices=["colocated", "separate"])
    args = parser.parse_args()
    record = {"benchmark": "two_node_check", "date": str(date.today()), "command": "python3 " + shlex.join(sys.argv),
              **check(Path(tempfile.mkdtemp(prefix="dspark-two-nodes-")), args.device, args.tensor_parallel_size,
                      args.drafter, args.ray_address)}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    ok = record["outputs_equal"] and record["nodes"] >= 2 and record.get("one_node_outputs_equal", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
