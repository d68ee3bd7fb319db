"""Step-by-step cross-check of the engine's speculative decoding against a reference loop of DeepSpec's evaluator.

The reference follows deepseek-ai/DeepSpec's ``generate_decoding_sample`` (batch 1, greedy): prefill, the first
token from the target, then per step: the drafter's block ``[anchor, MASK...]`` over the target's captured states of
every token before the anchor, a greedy Markov chain over the block, the target over ``[anchor, drafts]``, accept
while the drafts equal the target's argmax, commit them and the target's next token; stop at EOS or the token limit.
It is written here with transformers' target (no KV cache: the whole sequence each step) and the training forward of
the drafter (``runtime.training.forward.block_hidden``: dense masked attention), none of the engine's paged kernels,
schedulers or caches. For each prompt it reports the acceptance length of every verify step from both, and whether
the tokens and the step lengths agree. fp32 on the CPU.

usage: python benchmarks/reference_crosscheck.py --drafter smollm2-dspark --prompts 4 --max-tokens 64 --out x.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def reference_generate(hf, drafter, prompt: list[int], max_tokens: int, eos: int) -> tuple[list[int], list[int]]:
    """DeepSpec's greedy loop; returns (output tokens, acceptance length of each verify step)."""
    import torch

    from runtime.training.blocks import attention_mask, block_inputs
    from runtime.training.forward import block_hidden, greedy_block

    spec, block = drafter.spec, drafter.spec.block_size
    seq = list(prompt)
    with torch.no_grad():
        seq.append(int(hf(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        lengths: list[int] = []
        while len(seq) - len(prompt) < max_tokens and seq[-1] != eos:
            anchor = len(seq) - 1
            ids = torch.tensor([seq])
            hidden_states = hf(input_ids=ids, output_hidden_states=True).hidden_states
            captured = torch.cat([hidden_states[i + 1] for i in spec.target_layer_ids], dim=-1)
            anchors, keep = torch.tensor([[anchor]]), torch.tensor([[True]])
            block_ids, block_pos = block_inputs(ids, anchors, keep, block, spec.mask_token_id)
            hidden = block_hidden(drafter, hf.get_input_embeddings()(block_ids), block_pos, captured,
                                  attention_mask(anchors, keep, len(seq), block))[0]  # [K, d]
            drafts = greedy_block(drafter, hf.lm_head, hidden, torch.tensor([seq[anchor]]))
            target = hf(input_ids=torch.tensor([seq + drafts])).logits[0, anchor:].argmax(-1).tolist()  # [K+1]
            accepted = 0
            while accepted < block and drafts[accepted] == target[accepted]:
                accepted += 1
            committed = drafts[:accepted] + [target[accepted]]
            if eos in committed:  # DeepSpec cuts at EOS; an EOS among the drafts counts without a bonus
                committed = committed[:committed.index(eos) + 1]
            room = max_tokens - (len(seq) - len(prompt))
            committed = committed[:room]
            seq += committed
            lengths.append(len(committed))
    return seq[len(prompt):], lengths


def engine_generate(llm, prompt: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
    """The engine's greedy output and the committed length of each of its verify steps with drafts."""
    import dataclasses

    from runtime import SamplingParams
    from runtime.engine.metrics import SpecMetrics

    lengths: list[int] = []

    class Recording(SpecMetrics):
        __slots__ = ()

        def record(self, num_drafted: int, num_accepted: int) -> None:
            if num_drafted:
                lengths.append(num_accepted + 1)
            super().record(num_drafted, num_accepted)

    kept = llm.engine.metrics
    llm.engine.metrics = Recording(**{f.name: getattr(kept, f.name) for f in dataclasses.fields(kept)})
    try:
        out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))[0]
    finally:
        llm.engine.metrics = kept
    return out.token_ids, lengths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--prompts", type=int, default=4, help="first turns of the evaluation sets, taken in turn")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.e2e_bench import real_prompts
    from configs import DSparkDecodingConfig
    from runtime import LLM
    from runtime.kernels import get_backend
    from runtime.models.loader import load_drafter

    llm = LLM(args.model, speculative_config={"speculative_model": args.drafter, "speculation_guard": False},
              dtype="float32", device="cpu",
              num_pages=1024, page_size=16, max_num_seqs=1)
    hf = AutoModelForCausalLM.from_pretrained(llm.config.model, dtype=torch.float32).eval()
    spec = DSparkDecodingConfig(**llm.config.speculative_config.model_dump(exclude_unset=True))
    drafter = load_drafter(spec, hf.config, get_backend("torch"), torch.float32, torch.device("cpu"))
    eos = llm.tokenizer.eos_token_id
    rows = []
    for prompt in real_prompts(llm.tokenizer, args.prompts):
        ref_tokens, ref_lengths = reference_generate(hf, drafter, prompt, args.max_tokens, eos)
        eng_tokens, eng_lengths = engine_generate(llm, prompt, args.max_tokens)
        # At the token limit the engine drafts only what fits (a last step with one token left drafts nothing, and is
        # no verify step), where DeepSpec verifies a whole block and cuts after: the last steps may differ there
        at_limit = len(ref_tokens) == args.max_tokens and ref_tokens[-1] != eos
        common = len(eng_lengths) - 1 if at_limit else len(ref_lengths)
        rows.append({"prompt_tokens": len(prompt), "tokens_agree": ref_tokens == eng_tokens,
                     "step_lengths_agree": ref_lengths[:common] == eng_lengths[:common] and
                     (at_limit or len(ref_lengths) == len(eng_lengths)), "ended_at_token_limit": at_limit,
                     "reference_lengths": ref_lengths,
                     "engine_lengths": eng_lengths,
                     "reference_tau": sum(ref_lengths) / max(len(ref_lengths), 1),
                     "engine_tau": sum(eng_lengths) / max(len(eng_lengths), 1)})
        print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("_lengths")}), flush=True)
    record = {"kind": "reference_crosscheck", "model": args.model, "drafter": args.drafter,
              "date": datetime.date.today().isoformat(),
              "command": "python benchmarks/reference_crosscheck.py " + shlex.join(sys.argv[1:] if argv is None
                                                                                   else argv),
              "all_agree": all(r["tokens_agree"] and r["step_lengths_agree"] for r in rows), "prompts": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
