"""``StopCriteria.cut`` (a step's tokens at once) gives what appending them one by one with ``check`` gives."""

import random

from runtime.sampling_params import SamplingParams
from runtime.sequence import Sequence
from runtime.stops import StopCriteria


def one_by_one(stops: StopCriteria, seq: Sequence, tokens: list[int]) -> tuple[int, str | None]:
    appended = []
    for token in tokens:
        seq.output_token_ids.append(token)
        appended.append(token)
        reason = stops.check(seq)
        if reason is not None:
            break
    else:
        reason = None
    del seq.output_token_ids[len(seq.output_token_ids) - len(appended):]
    return len(appended), reason


def test_cut_equals_checking_each_token():
    rng = random.Random(0)
    for _ in range(3000):
        eos = frozenset(rng.sample(range(12), rng.randint(0, 2)))
        stops = StopCriteria(eos, None, max_model_len=rng.randint(20, 40))
        params = SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=rng.random() < 0.3,
                                stop_token_ids=tuple(rng.sample(range(12), rng.randint(0, 2))))
        prompt = [rng.randrange(12) for _ in range(rng.randint(1, 15))]
        seq = Sequence("r", prompt, params, 0, arrival=0)
        room = min(params.max_tokens, stops.max_model_len - len(prompt)) - 1  # a running request has room left
        if room < 0:
            continue
        seq.output_token_ids = [rng.randrange(12, 20) for _ in range(rng.randint(0, room))]  # no stop so far
        tokens = [rng.randrange(12) for _ in range(rng.randint(0, 8))]
        assert stops.cut(seq, tokens) == one_by_one(stops, seq, tokens), (prompt, seq.output_token_ids, tokens)
