"""The engine's side of running decode steps ahead (``ScheduledBatch.run_ahead``): it says so only when the next
step should be the same requests decoding one token more, and it keeps that step as it was launched (an arrival
joins the step after). The worker's side (graphs launched ahead, pinned read-back) is CUDA-only: tests/gpu."""

from configs import LLMConfig
from runtime.engine import Engine
from runtime.sampling_params import SamplingParams
from runtime.step_io import RequestStepResult, ScheduledBatch


class RecordingExecutor:
    """Answers at once (token 7 for every sampled request) and records every batch; it can run steps ahead."""

    runs_ahead = True

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.batches: list[ScheduledBatch] = []

    def execute(self, batch: ScheduledBatch) -> list[RequestStepResult]:
        self.batches.append(batch)
        return [RequestStepResult(r.request_id, [7] if r.sample else [], 0, []) for r in batch.requests]

    def describe(self) -> list[dict]:
        return [{}]

    def shutdown(self) -> None:
        pass


def engine(tmp_path) -> tuple[Engine, RecordingExecutor]:
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, max_position_embeddings=4096).save_pretrained(tmp_path)
    config = LLMConfig(model=str(tmp_path), num_pages=256, page_size=16, max_num_seqs=8, device="cpu",
                       dtype="float32")
    executor = RecordingExecutor(config.num_pages)
    return Engine(config, executor), executor


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_steady_greedy_decoding_runs_ahead_until_a_request_reaches_its_limit(tmp_path):
    eng, ex = engine(tmp_path)
    eng.add_request(list(range(10, 30)), greedy(6))
    eng.add_request(list(range(40, 45)), greedy(4))
    while eng.has_unfinished():
        eng.step()
    hints = [(len(b.requests), [len(r.token_ids) for r in b.requests], b.run_ahead) for b in ex.batches]
    assert hints[0][2] is False  # the prefill step: the next one is the first decode, not "one token more"
    # decode steps (each request's tokens 2, 3, 4, then the first's 5 and 6 alone) run ahead while the next step is
    # the same requests one token on: not the step after which the second has its 4 tokens (it finishes there),
    # nor the one after which the first has its 6
    assert [h[:2] for h in hints[1:]] == [(2, [1, 1])] * 3 + [(1, [1])] * 2
    assert [h[2] for h in hints[1:]] == [True, True, False, True, False]


def test_an_arrival_waits_one_step_when_the_step_was_launched_ahead(tmp_path):
    eng, ex = engine(tmp_path)
    eng.add_request(list(range(10, 30)), greedy(20))
    eng.step()  # prefill
    eng.step()  # the first decode step: the next one may be launched ahead
    assert ex.batches[-1].run_ahead
    late = eng.add_request(list(range(50, 60)), greedy(3))  # arrives while that next step runs
    eng.step()  # the step launched ahead: the running request alone, and it no longer runs ahead (a request waits)
    assert [r.request_id for r in ex.batches[-1].requests] != [late] and len(ex.batches[-1].requests) == 1
    assert not ex.batches[-1].run_ahead
    eng.step()  # now the arrival joins
    assert late in [r.request_id for r in ex.batches[-1].requests]


def test_sampled_or_drafted_requests_never_run_ahead(tmp_path):
    eng, ex = engine(tmp_path)
    eng.add_request(list(range(10, 30)), SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert not any(b.run_ahead for b in ex.batches)
