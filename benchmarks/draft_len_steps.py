"""Is an engine's step time a property of its draft length, or of the engine build? Each draft length built alone,
twice, in a shuffled order.

A trained-pair run found the tuning engines' step times far from smooth in the draft length (at 4 requests: k = 1,
3, 7 about 1.0 ms, k = 2, 4, 5, 6 about 1.45 ms) and the tuned engine, K = 7 like the fixed one, 1.8x slower than
it, its host phases all slower alike. This builds a random-weight target of the trained pair's shape (512 wide, 8
layers, vocab 4096; a one-layer drafter of block 7, drafting k through a ``draft_len_schedule`` as the bench's
tuning engines do) once per (draft length, repeat), in a shuffled order, with an autoregressive
engine first and last (drift), and times ``--steps`` steps of ``--batch`` requests with ``dspark bench``'s own
timer: the step, the graphed forward and draft alone on the device, and the host phases. Random drafts accept
nothing, so every step verifies a full block of k: a slow length shows on every build of it, a slow build on one.

A draft length of 0 builds the DSpark engine with a schedule that drafts nothing at this batch: its drafter idles,
its context kept by every step (a trained 3072 x 24 pair on an H200: such a tuned engine at 256 requests
stepped in 10.9 ms against the autoregressive engine's 6.9, its steps neither graphed as plain decodes nor launched
ahead; since then its decode graph appends the context and runs ahead, and ``draft_len`` 0 should step as fast).
``--hidden``/``--layers``: a wider target of the GPU recipe's proportions (head_dim 64, two query heads per key/value
head, MLP 3x wide), e.g. 3072 24 for the 2.7B pair's.

usage: python3 benchmarks/draft_len_steps.py [--draft-lens 1,2,3,4,5,6,7] [--repeats 2] [--batch 4]
                                             [--hidden 512 --layers 8] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shlex
import sys
import tempfile
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import time_steps  # noqa: E402
from runtime import LLM  # noqa: E402

PAIR_SHAPE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)


def pair_shape(hidden: int, layers: int) -> dict:
    """The GPU recipe's target proportions at ``hidden`` x ``layers`` (512 x 8: ``PAIR_SHAPE``)."""
    heads = hidden // 64
    return {**PAIR_SHAPE, "hidden_size": hidden, "intermediate_size": 3 * hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": max(heads // 2, 1)}


def write_pair(root: Path, shape: dict = PAIR_SHAPE) -> tuple[Path, Path]:
    """config-only target and one-layer drafter directories of the trained pair's shape (load_format='dummy')."""
    from transformers import Qwen3Config

    target, drafter = root / "target", root / "drafter"
    Qwen3Config(**shape, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16").save_pretrained(str(target))
    config = json.loads((target / "config.json").read_text())
    layers = shape["num_hidden_layers"]
    config.update(architectures=["Qwen3DSparkModel"], num_target_layers=layers, num_hidden_layers=1, block_size=7,
                  mask_token_id=4095, target_layer_ids=[1, layers // 2, layers - 2], markov_rank=256,
                  markov_head_type="vanilla",
                  enable_confidence_head=True, confidence_head_with_markov=True, layer_types=["full_attention"])
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text(json.dumps(config))
    return target, drafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-lens", default="1,2,3,4,5,6,7")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="requests decoding together (more than 1)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="the KV cache on the GPU (a 3072 x 24 "
                        "target at 256 requests needs ~32)")
    parser.add_argument("--hidden", type=int, default=512, help="the target's width (a multiple of 64)")
    parser.add_argument("--layers", type=int, default=8, help="the target's layers (4 or more)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a float32 smoke run")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.batch < 2:
        parser.error("--batch: a draft_len_schedule starts at max_draft_len for one request; give 2 or more")
    if args.hidden < 64 or args.hidden % 64 or args.layers < 4:
        parser.error(f"--hidden {args.hidden} --layers {args.layers}: a positive multiple of 64, and 4 layers or more")
    shape = pair_shape(args.hidden, args.layers)
    target, drafter = write_pair(Path(tempfile.mkdtemp()), shape)
    builds: list[int | None] = [k for k in (int(k) for k in args.draft_lens.split(",")) for _ in range(args.repeats)]
    random.Random(args.seed).shuffle(builds)
    builds = [None] + builds + [None]  # None: autoregressive, first and last
    gpu = args.device == "cuda"
    common = dict(dtype="bfloat16" if gpu else "float32", device=args.device, max_num_seqs=args.batch,
                  kv_cache_memory=int(args.kv_cache_gib * 2**30) if gpu else (256 << 20), max_model_len=4096,
                  load_format="dummy")
    points = []
    for order, k in enumerate(builds):
        # as dspark bench --tune-schedule builds them: the drafter's block of 7, a schedule drafting k at this batch
        spec = {"speculative_model": str(drafter), "max_draft_len": 7, "load_format": "dummy",
                **({"draft_len_schedule": {1: 7, args.batch: k}} if k < 7 else {})} if k is not None else None
        llm = LLM(str(target), speculative_config=spec, **common)
        time_steps(llm, args.batch, 64, 2, 1, shape["vocab_size"], seed=0)  # first-call costs
        timing = time_steps(llm, args.batch, 64, args.steps, 5, shape["vocab_size"], seed=1)
        point = {"order": order, "draft_len": k, "drafter": k is not None,
                 **{name: value for name, value in timing.items()
                    if isinstance(value, float) and name != "tokens_per_s"}}
        points.append(point)
        print(json.dumps({key: round(v, 4) if isinstance(v, float) else v for key, v in point.items()}), flush=True)
        llm.engine.executor.shutdown()
        del llm
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
    record = {"benchmark": "draft_len_steps", "date": date.today().isoformat(),
              "command": "python3 benchmarks/draft_len_steps.py " + shlex.join(sys.argv[1:]),
              "hardware": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__, "shape": shape,
              "batch": args.batch, "points": points}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
