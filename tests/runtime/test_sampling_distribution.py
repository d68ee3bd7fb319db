"""Sampled output has the target's distribution, in both verification modes, with and without filters.

For N seeded requests we compare the empirical joint distribution of the first two generated tokens
with the exact one computed from transformers' logits. The second token is decided by verification
(draft 1 accepted, or the correction). The bound: E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / N), and TV
moves by at most 1/N per sample, so by McDiarmid it exceeds its mean by more than
sqrt(ln(1/delta) / (2N)) with probability < delta; we use delta = 1e-3 (+0.059 at N = 2000).
"""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import runtime.worker.runner
from configs import DSparkDecodingConfig
from runtime import LLM, SamplingParams

N = 2000
PROMPT = [5, 17, 33, 2, 90, 41]


def reference_filter(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Straightforward per-row filter, written independently of runtime.sampling.sampler."""
    probs = torch.softmax(logits / temperature, dim=-1)
    out = torch.zeros_like(probs)
    for row in range(probs.shape[0]):
        order = sorted(range(probs.shape[1]), key=lambda i: (-probs[row, i].item(), i))
        kept, mass = [], 0.0
        for rank, token in enumerate(order):
            if top_k > 0 and rank >= top_k:
                break
            if mass >= top_p:
                break
            kept.append(token)
            mass += probs[row, token].item()
        out[row, kept] = probs[row, kept]
    return out / out.sum(-1, keepdim=True)


def exact_joint(target_dir, temperature, top_k, top_p) -> dict[tuple[int, int], float]:
    model = AutoModelForCausalLM.from_pretrained(str(target_dir)).float().eval()
    with torch.no_grad():
        p1 = reference_filter(model(torch.tensor([PROMPT])).logits[0, -1:], temperature, top_k, top_p)[0]
        support = [t for t in range(p1.shape[0]) if p1[t] > 0]
        batch = torch.tensor([PROMPT + [t] for t in support])
        p2 = reference_filter(model(batch).logits[:, -1], temperature, top_k, top_p)
    return {(t1, t2): (p1[t1] * p2[i, t2]).item() for i, t1 in enumerate(support)
            for t2 in range(p2.shape[1]) if p2[i, t2] > 0}


def tv_bound(joint: dict, n: int, delta: float = 1e-3) -> float:
    mean = 0.5 * sum(math.sqrt(p * (1 - p) / n) for p in joint.values())
    return mean + math.sqrt(math.log(1 / delta) / (2 * n))


def empirical_tv(llm: LLM, joint: dict, params: dict) -> float:
    sampling = [SamplingParams(max_tokens=3, seed=seed, ignore_eos=True, **params) for seed in range(N)]
    counts: dict = {}
    for out in llm.generate([PROMPT] * N, sampling):
        key = tuple(out.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    keys = set(joint) | set(counts)
    return 0.5 * sum(abs(counts.get(k, 0) / N - joint.get(k, 0.0)) for k in keys)


FILTERS = {"t=1": dict(temperature=1.0), "top-k=5": dict(temperature=1.0, top_k=5),
           "top-p=0.8": dict(temperature=0.9, top_p=0.8)}


@pytest.fixture(scope="module")
def joints(near_bigram_target):
    return {name: exact_joint(near_bigram_target, f["temperature"], f.get("top_k", 0), f.get("top_p", 1.0))
            for name, f in FILTERS.items()}


@pytest.fixture(scope="module")
def drafter(near_bigram_target, make_drafter):
    """Knows the bigram part of the target but is over-confident (table x 3): q differs from p, overlaps it."""
    return make_drafter(near_bigram_target, 2, "vanilla", oracle=True, oracle_scale=3.0)


def speculative_llm(target, drafter, rejection: bool) -> LLM:
    spec = DSparkDecodingConfig(speculative_model=str(drafter), use_rejection_sampling=rejection)
    return LLM(str(target), speculative_config=spec, dtype="float32", device="cpu", num_pages=4096, page_size=4,
               max_num_seqs=512, max_num_batched_tokens=4096)


@pytest.mark.slow
@pytest.mark.parametrize("rejection", [False, True], ids=["exact-match", "rejection"])
@pytest.mark.parametrize("name", list(FILTERS))
def test_first_two_tokens_follow_the_target(near_bigram_target, drafter, joints, rejection, name):
    llm = speculative_llm(near_bigram_target, drafter, rejection)
    tv, bound = empirical_tv(llm, joints[name], FILTERS[name]), tv_bound(joints[name], N)
    metrics = llm.get_metrics()
    assert 0 < metrics["num_accepted_tokens"] < metrics["num_draft_tokens"]  # both paths exercised
    assert tv < bound, f"TV {tv:.3f} >= bound {bound:.3f}"


@pytest.mark.slow
def test_seeded_exact_match_equals_plain_sampling(near_bigram_target, make_drafter):
    """Noise is keyed by position: exact-match speculation reproduces plain seeded sampling exactly."""
    params = [SamplingParams(max_tokens=12, seed=s, temperature=1.0, top_p=0.9, ignore_eos=True) for s in range(40)]
    plain = LLM(str(near_bigram_target), dtype="float32", device="cpu", num_pages=512, page_size=4)
    spec = speculative_llm(near_bigram_target, make_drafter(near_bigram_target, 3, "vanilla", oracle=True), False)
    assert [o.token_ids for o in plain.generate([PROMPT] * 40, params)] == \
        [o.token_ids for o in spec.generate([PROMPT] * 40, params)]


@pytest.mark.slow
@pytest.mark.parametrize("wrong", ["rejection: accept everything", "rejection: no residual",
                                   "exact-match: accept everything"])
def test_a_wrong_sampler_fails_the_same_test(near_bigram_target, drafter, joints, monkeypatch, wrong):
    """The top-k=5 case (25 cells, the tightest bound): each wrong sampler lands well outside it."""
    if wrong == "rejection: accept everything":
        monkeypatch.setattr(runtime.worker.runner, "accept_by_rejection", lambda drafts, num_drafts, *a: num_drafts)
    elif wrong == "rejection: no residual":
        monkeypatch.setattr(runtime.worker.runner, "residual_distribution", lambda p, q: p)
    else:
        def commit_drafts_unchecked(drafts, num_drafts, target_tokens):
            committed = torch.cat([drafts, target_tokens[:, -1:]], dim=1)
            return committed.scatter(1, num_drafts[:, None], target_tokens.gather(1, num_drafts[:, None])), num_drafts

        monkeypatch.setattr(runtime.worker.runner, "commit_by_match", commit_drafts_unchecked)
    llm = speculative_llm(near_bigram_target, drafter, wrong.startswith("rejection"))
    name = "top-k=5"
    tv, bound = empirical_tv(llm, joints[name], FILTERS[name]), tv_bound(joints[name], N)
    assert tv > bound, f"the wrong sampler ({wrong}) passed: TV {tv:.3f} < bound {bound:.3f}"
