"""Host time of planning a CUDA graph's FlashInfer attention for one step: FlashInfer's own ``plan`` against the
graph wrapper's replan (``DecodeGraphWrapper._replan``: the cached planner called directly), by batch and tokens
per request, on the Qwen3-8B attention geometry (32 query heads, 8 KV heads, head dim 128, bf16, 16-token pages).

A verify step's layout is known only after the step before it is read back, so its plan sits on the critical path
between two steps (the device idles meanwhile); this measures that stretch. Each point: median host microseconds
of ``plan_attention`` over ``--repeats`` plans of layouts whose lengths change every plan, the device idle.

usage: python3 benchmarks/attention_plan.py [--batch 1,4,16,64] [--q-lens 1,8] [--context 548] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.kernels import AttentionGeometry, HostLayout, PagedAttentionMeta, get_backend  # noqa: E402

PAGE, HQ, HKV, D = 16, 32, 8, 128


def layouts(batch: int, q_len: int, context: int, count: int) -> list[PagedAttentionMeta]:
    """``count`` layouts of ``batch`` requests near ``context`` keys, each a token longer than the last."""
    dev, geometry = torch.device("cuda"), AttentionGeometry(HQ, HKV, D, torch.bfloat16, D ** -0.5)
    per = -(-(context + count + q_len) // PAGE)
    out = []
    for step in range(count):
        kv = [context + step + q_len + (i % 7) for i in range(batch)]
        pages = [list(range(i * per, i * per + -(-n // PAGE))) for i, n in enumerate(kv)]
        seq_lens = torch.zeros(batch, dtype=torch.int64, device=dev)  # placeholders: FlashInfer reads the host
        out.append(PagedAttentionMeta(query_start_loc=seq_lens, seq_lens=seq_lens, page_table=seq_lens[:, None],
                                      max_query_len=q_len, max_seq_len=0, causal=True, num_tokens=batch * q_len,
                                      page_size=PAGE, host=HostLayout([q_len] * batch, kv, pages), geometry=geometry))
    return out


def plan_us(fi, batch: int, q_len: int, context: int, repeats: int, flashinfer_plan: bool) -> float:
    dev = torch.device("cuda")
    per = -(-(context + repeats + q_len + 8) // PAGE)
    wrapper = fi.graph_wrapper(dev, batch, batch * per, q_len)
    metas = layouts(batch, q_len, context, repeats + 1)
    fi.plan_attention(metas[0], wrapper)  # resolves the module (the first plan is always FlashInfer's)
    times = []
    for meta in metas[1:]:
        if flashinfer_plan:
            wrapper.planned_geometry = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        fi.plan_attention(meta, wrapper)
        times.append(1e6 * (time.perf_counter() - start))
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,4,16,64")
    parser.add_argument("--q-lens", default="1,8")
    parser.add_argument("--context", type=int, default=548)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args()
    fi = get_backend("flashinfer")
    points = []
    for q_len in (int(q) for q in args.q_lens.split(",")):
        for batch in (int(b) for b in args.batch.split(",")):
            own = plan_us(fi, batch, q_len, args.context, args.repeats, flashinfer_plan=True)
            fast = plan_us(fi, batch, q_len, args.context, args.repeats, flashinfer_plan=False)
            point = {"batch": batch, "q_len": q_len, "flashinfer_plan_us": own, "replan_us": fast,
                     "replan_over_flashinfer": fast / own}
            points.append(point)
            print(json.dumps(point), flush=True)
    record = {"benchmark": "attention_plan", "date": date.today().isoformat(),
              "command": "python3 benchmarks/attention_plan.py " + shlex.join(sys.argv[1:]),
              "hardware": torch.cuda.get_device_name(), "torch": torch.__version__, "context": args.context,
              "geometry": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "page_size": PAGE, "dtype": "bfloat16"},
              "points": points}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
