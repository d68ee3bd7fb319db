"""Verification rules, filters, penalties and position-keyed noise, against brute-force loops."""

import torch

from runtime.sampling.noise import Stream, exponentials, uniform
from runtime.sampling.sampler import RowParams, apply_penalties, filtered_probs
from runtime.sampling.sampling_params import SamplingParams
from runtime.sampling.verify import accept_by_match, accept_by_rejection, residual_distribution


def test_accept_by_match_is_the_leading_agreement():
    drafts = torch.tensor([[3, 4, 5], [3, 9, 5], [1, 1, 1], [7, 7, 0]])
    target = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6], [2, 1, 1, 1], [7, 7, 7, 7]])
    num = torch.tensor([3, 3, 3, 2])
    assert accept_by_match(drafts, num, target).tolist() == [3, 1, 0, 2]


def test_accept_by_rejection_matches_a_loop():
    torch.manual_seed(0)
    b, k, v = 64, 4, 7
    p = torch.softmax(torch.randn(b, k + 1, v), -1)
    q = torch.softmax(torch.randn(b, k, v), -1)
    drafts = torch.randint(0, v, (b, k))
    num = torch.randint(0, k + 1, (b,))
    u = torch.rand(b, k)
    got = accept_by_rejection(drafts, num, p, q, u).tolist()
    for i in range(b):
        n = 0
        while n < num[i] and u[i, n] < min(1.0, (p[i, n, drafts[i, n]] / q[i, n, drafts[i, n]]).item()):
            n += 1
        assert got[i] == n


def test_residual_distribution():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.2, 0.6, 0.2], [0.2, 0.3, 0.5]])
    r = residual_distribution(p, q)
    torch.testing.assert_close(r[0], torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(r[1], p[1])  # no residual mass: p itself


def rows(*params, vocab=6):
    return RowParams.build(list(params), vocab, torch.device("cpu"))


def test_filters():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05, 0.0 + 1e-9]] * 4))
    probs = filtered_probs(logits, rows(SamplingParams(), SamplingParams(top_k=2), SamplingParams(top_p=0.7),
                                        SamplingParams(min_p=0.5)))
    torch.testing.assert_close(probs[1], torch.tensor([4 / 7, 3 / 7, 0, 0, 0, 0]))
    torch.testing.assert_close(probs[2], torch.tensor([4 / 7, 3 / 7, 0, 0, 0, 0]))  # 0.4 < 0.7, 0.7 is not
    torch.testing.assert_close(probs[3], torch.tensor([4 / 7, 3 / 7, 0, 0, 0, 0]))  # >= 0.5 * 0.4
    torch.testing.assert_close(probs[0].sum(), torch.tensor(1.0))
    greedy = filtered_probs(torch.tensor([[0.1, 2.0, 0.3]]), rows(SamplingParams(temperature=0), vocab=3))
    assert greedy.tolist() == [[0.0, 1.0, 0.0]]


def test_penalties_follow_vllm():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    counts = torch.tensor([[2.0, 0.0, 1.0, 0.0]])
    seen = torch.tensor([[True, True, True, False]])
    out = apply_penalties(logits, counts, seen, rows(SamplingParams(repetition_penalty=2.0, presence_penalty=0.5,
                                                                    frequency_penalty=0.25), vocab=4))
    assert out.tolist() == [[2.0 / 2 - 0.5 - 0.5, -4.0, 0.5 - 0.25 - 0.5, 0.5]]


def test_noise_is_a_pure_function_of_seed_position_and_stream():
    seeds, pos = torch.tensor([1, 1, 2, 1 << 40]), torch.tensor([5, 5, 5, 5])
    e = exponentials(seeds, pos, Stream.TARGET, 50)
    assert torch.equal(e[0], e[1]) and not torch.equal(e[0], e[2]) and not torch.equal(e[0], e[3])
    assert not torch.equal(e, exponentials(seeds, pos, Stream.DRAFT, 50))
    assert not torch.equal(e, exponentials(seeds, pos + 1, Stream.TARGET, 50))
    assert torch.equal(e[:2, :10], exponentials(seeds[:2], pos[:2], Stream.TARGET, 10))  # width-independent


def test_noise_is_uniform_enough():
    n = 20000
    u = uniform(torch.full((n,), 7), torch.arange(n), Stream.ACCEPT)
    assert 0 < u.min() and u.max() < 1
    hist = torch.histc(u, bins=10, min=0, max=1) / n
    assert (hist - 0.1).abs().max() < 0.01
    e = exponentials(torch.arange(4000), torch.zeros(4000, dtype=torch.long), Stream.TARGET, 8)
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03125, 0.03125, 0.0, 0.0])
    draws = (probs / e).argmax(-1)
    freq = torch.bincount(draws, minlength=8).float() / 4000
    assert (freq - probs).abs().max() < 0.03 and freq[6:].sum() == 0
