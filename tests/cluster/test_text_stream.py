"""Streaming text (``cluster.serve.text.TextStream``): incremental decoding sends, step by step, exactly the text a
full decode gives, holds back what may still become a stop string or a partial character, and never takes back
what it sent."""

import random

import pytest
from transformers import AutoTokenizer

from cluster.serve.text import TextStream
from runtime.engine.outputs import RequestOutput
from tests import builders


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    builders.save_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def output(new_ids, finished_text=None):
    """A delta output (what the server streams from): this step's tokens only."""
    return RequestOutput(request_id="r", prompt_token_ids=[1], token_ids=list(new_ids), text=finished_text or "",
                         finish_reason="length" if finished_text is not None else None, new_token_ids=list(new_ids))


def stream(tokenizer, ids, steps, stop=None):
    """The deltas of ``ids`` committed in chunks of ``steps`` tokens, the last output finished."""
    text = TextStream(tokenizer, stop)
    sent, at = [], 0
    for size in steps:
        end = min(at + size, len(ids))
        sent.append(text.delta(output(ids[at:end])))
        at = end
    final = tokenizer.decode(ids, skip_special_tokens=True)
    sent.append(text.delta(output(ids[at:], final)))
    return sent, final


def test_incremental_deltas_add_up_to_the_full_decode(tokenizer):
    rng = random.Random(0)
    texts = ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n", "héllo wörld ✓ done", "a  b\tc"]
    for text in texts:
        ids = tokenizer.encode(text)
        for _ in range(20):
            steps = [rng.randint(1, 4) for _ in range(len(ids))]
            sent, final = stream(tokenizer, ids, steps)
            assert "".join(sent) == final == text
            running = "".join(sent[:-1])
            assert final.startswith(running) and "\ufffd" not in running


def test_random_token_ids_never_take_back_text(tokenizer):
    rng = random.Random(1)
    for _ in range(30):
        ids = [rng.randint(3, 299) for _ in range(rng.randint(1, 40))]
        sent, final = stream(tokenizer, ids, [rng.randint(1, 3) for _ in range(len(ids))])
        assert "".join(sent) == final


def test_a_possible_stop_string_is_held_back_until_the_end(tokenizer):
    text = TextStream(tokenizer, ["STOP"])
    ids = tokenizer.encode("abc STOP")
    first_ids = tokenizer.encode("abc STO")
    assert ids[:len(first_ids)] == first_ids
    first = text.delta(output(first_ids))  # "STO" may still become the stop string
    assert first == "abc "
    assert text.delta(output(ids[len(first_ids):], "abc ")) == ""  # it did: the finished text is cut there
