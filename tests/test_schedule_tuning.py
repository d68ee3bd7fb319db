"""``dspark bench --tune-schedule``'s choice: the fastest draft length per concurrency, in the engine's format."""

import pytest

from bench.schedule_tuning import Candidate, accepted_schedule, best_draft_lengths, projected_tau, schedule_from
from configs import DSparkDecodingConfig

ACCEPT = [0.69, 0.48, 0.34, 0.25, 0.18, 0.13, 0.10]


def test_projected_tau_adds_the_first_k_acceptance_rates():
    assert projected_tau(ACCEPT, 0) == 1.0
    assert projected_tau(ACCEPT, 2) == pytest.approx(2.17)
    with pytest.raises(ValueError, match="7 positions, not 8"):
        projected_tau(ACCEPT, 8)


def test_the_fastest_length_per_concurrency_becomes_a_schedule_the_engine_accepts():
    # step times shaped like one run on an H200: verify cost grows with batch x (k + 1) tokens
    step_ms = {1: {0: 5.5, 1: 6.0, 3: 6.2, 7: 6.7}, 4: {0: 5.7, 1: 6.2, 3: 6.5, 7: 7.1},
               16: {0: 6.1, 1: 6.9, 3: 7.6, 7: 8.6}, 64: {0: 7.8, 1: 9.6, 3: 12.5, 7: 19.2},
               256: {0: 17.1, 1: 30.0, 3: 45.0, 7: 84.0}}
    candidates = [Candidate(c, k, ms, projected_tau(ACCEPT, k))
                  for c, by_k in step_ms.items() for k, ms in by_k.items()]
    best = best_draft_lengths(candidates)
    assert {c: b.draft_len for c, b in best.items()} == {1: 7, 4: 7, 16: 7, 64: 3, 256: 0}
    schedule = schedule_from({c: b.draft_len for c, b in best.items()}, 7)
    assert schedule == {16: 7, 64: 3}  # 1 and 4 merge into 16; above 64 the engine drafts nothing
    spec = DSparkDecodingConfig(speculative_model="/unused", max_draft_len=7, block_size=7,
                                draft_len_schedule=schedule)
    assert [spec.draft_len_for_batch_size(b) for b in (1, 16, 17, 64, 65, 300)] == [7, 7, 3, 3, 0, 0]
    # never slower than autoregressive at a measured point: the chosen length beats or is k = 0
    for c, b in best.items():
        assert b.tokens_per_s >= Candidate(c, 0, step_ms[c][0], 1.0).tokens_per_s


def test_another_length_must_beat_max_draft_len_by_the_margin_and_a_schedule_must_start_at_max_draft_len():
    """One run at 256 requests: 5 drafts measured 0.5% faster than 7 in the tuning rounds and lost 6% in the sweep.
    Within 2% the untuned length stays; beyond it the fastest wins (ties among the others: the shorter)."""
    measured = [Candidate(256, 0, 4.170, 1.0), Candidate(256, 5, 10.967, 4.151), Candidate(256, 7, 13.947, 5.252)]
    assert best_draft_lengths(measured)[256].draft_len == 7
    assert best_draft_lengths(measured, margin=0.0)[256].draft_len == 5
    best = best_draft_lengths([Candidate(1, 0, 5.0, 1.0), Candidate(1, 3, 10.0, 2.0)])
    assert best[1].draft_len == 3  # a tie: the longest stays
    best = best_draft_lengths([Candidate(1, 0, 4.8, 1.0), Candidate(1, 1, 7.2, 1.5), Candidate(1, 3, 10.0, 2.0)])
    assert best[1].draft_len == 0  # 4% faster than 3 drafts (1 draft ties with it: the shorter wins)
    with pytest.raises(ValueError, match="fastest draft length is 0, not max_draft_len=3"):
        schedule_from({1: 0, 4: 0}, 3)
    assert schedule_from({1: 3, 8: 3}, 3) == {8: 3}


def test_the_accepted_schedule_starts_at_max_draft_len_and_says_what_that_costs():
    """One run's finding: one request decodes fastest without drafts, busier steps with 5 of 7. The engine accepts
    only a schedule starting at max_draft_len, so that is the tuned engine (and the confidence scheduler's cap),
    with the finding recorded, rather than no tuned engine at all."""
    candidates = [Candidate(1, 0, 0.69, 1.0), Candidate(1, 7, 1.50, 1.83), Candidate(64, 0, 1.69, 1.0),
                  Candidate(64, 5, 2.47, 2.78), Candidate(64, 7, 3.78, 3.14), Candidate(256, 5, 5.36, 2.75),
                  Candidate(256, 7, 9.61, 3.16)]
    best = best_draft_lengths(candidates)
    schedule, finding = accepted_schedule(best, candidates, 7)
    assert schedule == {1: 7, 256: 5}
    assert finding.startswith("at concurrency 1 the fastest draft length is 0, but a schedule starts at "
                              "max_draft_len=7") and "(0.84x its tokens/s); decoding without a drafter" in finding
    DSparkDecodingConfig(speculative_model="x", max_draft_len=7, draft_len_schedule=schedule)  # the engine's rule
    trained_longer = [Candidate(1, 0, 1.0, 1.0), Candidate(1, 7, 1.2, 2.5)] + candidates[5:]  # drafting pays at 1
    assert accepted_schedule(best_draft_lengths(trained_longer), trained_longer, 7) == ({1: 7, 256: 5}, None)


def test_the_written_fragment_is_a_serve_config(tmp_path, qwen3_target, make_drafter):
    """What --tune-schedule writes for a --model-shape (no paths) serves with the pair given as flags."""
    import json
    from pathlib import Path

    from cluster.cli import MODEL_FLAGS, SERVE_FLAGS, build_parser, serve_args

    fragment = tmp_path / "tuned.json"
    record = json.loads((Path(__file__).parent / "data" / "tuned-schedule-qwen3-8b.json")
                        .read_text())
    spec = record["engine"]["speculative_config"]
    spec.update(max_draft_len=3, draft_len_schedule={"16": 3, "64": 1})  # the test drafter's block is 3
    fragment.write_text(json.dumps(record))
    drafter = make_drafter(qwen3_target, 3)
    args = build_parser().parse_args(["serve", "--config", str(fragment), "--model", str(qwen3_target),
                                      "--speculative-model", str(drafter)])
    parsed = serve_args(args, {**MODEL_FLAGS, **SERVE_FLAGS}).engine.speculative_config
    assert parsed.draft_len_schedule == {16: 3, 64: 1} and parsed.speculative_model == str(drafter)
    assert [parsed.draft_len_for_batch_size(b) for b in (1, 17, 65)] == [3, 1, 0]
