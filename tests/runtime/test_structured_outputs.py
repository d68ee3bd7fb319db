"""Structured outputs (``SamplingParams.structured_outputs``, xgrammar): every output the grammar completes is JSON
that fits the schema, greedy and sampled; a drafter changes no token (its drafts are verified against the masked
rows, so a draft the grammar refuses is rejected); bad schemas are refused naming the field."""

import json
import time

import numpy as np
import pytest

from runtime import LLM, SamplingParams, StructuredOutputs

ENGINE = dict(dtype="float32", device="cpu", num_pages=256, page_size=4)
PROMPTS = [[5, 6, 7], [9, 10], [11, 12, 13, 14], [3]]
SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}, "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}


def test_outputs_fit_the_schema_with_and_without_a_drafter(near_bigram_target, make_drafter):
    pytest.importorskip("xgrammar")
    wanted = StructuredOutputs(json=json.dumps(SCHEMA))
    greedy = SamplingParams(max_tokens=40, temperature=0, structured_outputs=wanted)
    plain = LLM(str(near_bigram_target), **ENGINE)
    outs = plain.generate(PROMPTS, greedy)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        assert value["a"] in ("x", "yy") and isinstance(value["b"], bool) and set(value) == {"a", "b"}
    drafter = make_drafter(near_bigram_target, 3, "vanilla", oracle=True)
    for rejection in (False, True):
        spark = LLM(str(near_bigram_target), speculative_config={"speculative_model": str(drafter),
                                                                 "use_rejection_sampling": rejection}, **ENGINE)
        assert [o.token_ids for o in spark.generate(PROMPTS, greedy)] == [o.token_ids for o in outs]
        assert spark.get_metrics()["num_draft_tokens"] > 0
        sampled = spark.generate(PROMPTS * 3, SamplingParams(max_tokens=40, temperature=1.0, seed=4,
                                                             structured_outputs=wanted))
        for out in sampled:
            assert out.finish_reason == "stop" and set(json.loads(out.text)) == {"a", "b"}
    # once the structured requests are done, a step looks at none of its entries for a grammar
    masked = []
    row_masks = plain.engine._grammar_backend.row_masks
    plain.engine._grammar_backend.row_masks = lambda *a: masked.append(a) or row_masks(*a)
    plain.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0))
    assert not masked and not plain.engine._structured
    objects = plain.generate(PROMPTS, SamplingParams(max_tokens=60, temperature=0,
                                                     structured_outputs=StructuredOutputs(json_object=True)))
    for out in objects:  # any JSON object (a random model may run out of tokens inside one: "length")
        assert out.text.startswith("{")
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)


def test_bad_structured_outputs_are_refused_naming_the_field(near_bigram_target):
    with pytest.raises(ValueError, match="exactly one of json"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="structured_outputs.json must be a JSON schema object"):
        StructuredOutputs(json="[1, 2")
    pytest.importorskip("xgrammar")
    llm = LLM(str(near_bigram_target), **ENGINE)
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs.json: xgrammar cannot compile"):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=StructuredOutputs(
            json=json.dumps({"type": "object", "properties": {"a": {"type": "no-such-type"}}}))))
    for bad, field in ((StructuredOutputs(regex="[unclosed"), "regex"),
                       (StructuredOutputs(grammar="root ::= "), "grammar")):
        with pytest.raises(ValueError, match=f"SamplingParams.structured_outputs.{field}: xgrammar cannot compile"):
            llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=bad))
    assert not llm.engine.sequences  # nothing was queued
    for kwargs, words in (({"json_object": True, "regex": "a"}, "exactly one of"), ({"choice": []}, "choice must be"),
                          ({"choice": ["a", ""]}, "choice must be"), ({"regex": ""}, "regex must be")):
        with pytest.raises(ValueError, match=words):
            StructuredOutputs(**kwargs)


def test_a_regex_a_choice_and_a_grammar_hold_the_output_with_and_without_a_drafter(near_bigram_target,
                                                                                    make_drafter):
    """vLLM's other structured outputs: a regex (the whole output matches it), a choice (the output is one of the
    strings), an EBNF grammar; a drafter changes no greedy token."""
    import re

    pytest.importorskip("xgrammar")
    plain = LLM(str(near_bigram_target), **ENGINE)
    drafter = make_drafter(near_bigram_target, 3, "vanilla", oracle=True)
    spark = LLM(str(near_bigram_target), speculative_config={"speculative_model": str(drafter)}, **ENGINE)
    choices = ("yes", "no way", 'say "hi"')
    for wanted, fits in ((StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,4}"),
                          lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
                         (StructuredOutputs(choice=choices), lambda t: t in choices),
                         (StructuredOutputs(grammar='root ::= "(" [a-c]+ ")"'),
                          lambda t: re.fullmatch(r"\([a-c]+\)", t))):
        greedy = SamplingParams(max_tokens=30, temperature=0, structured_outputs=wanted)
        outs = plain.generate(PROMPTS, greedy)
        for out in outs:
            assert out.finish_reason == "stop" and fits(out.text), (wanted, out.text)
        assert [o.token_ids for o in spark.generate(PROMPTS, greedy)] == [o.token_ids for o in outs]
        for out in spark.generate(PROMPTS, SamplingParams(max_tokens=30, temperature=1.0, seed=2,
                                                           structured_outputs=wanted)):
            assert out.finish_reason == "stop" and fits(out.text), (wanted, out.text)


def test_without_xgrammar_a_structured_request_is_refused_naming_what_to_install(near_bigram_target, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # (an import of it now fails, as where it is not installed)
    llm = LLM(str(near_bigram_target), **ENGINE)
    with pytest.raises(ValueError, match=r"SamplingParams.structured_outputs needs xgrammar.*dspark\[structured\]"):
        llm.generate(PROMPTS[:1], SamplingParams(structured_outputs=StructuredOutputs(json_object=True)))
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))[0].token_ids  # other requests are served


def test_a_grammar_compiled_beforehand_decodes_as_one_compiled_in_place(near_bigram_target):
    """``Engine.compile_grammar`` (what a server runs off the engine's thread) then ``add_request(grammar=...)``
    gives the tokens of a request whose grammar the engine compiles itself."""
    pytest.importorskip("xgrammar")
    llm = LLM(str(near_bigram_target), **ENGINE)
    params = SamplingParams(max_tokens=40, temperature=0, structured_outputs=StructuredOutputs(json=json.dumps(SCHEMA)))
    inline = llm.generate([PROMPTS[0]], params)[0].token_ids
    engine = llm.engine
    request = engine.add_request(PROMPTS[0], params, grammar=engine.compile_grammar(params))
    tokens = []
    while engine.has_unfinished():
        tokens = next((o.token_ids for o in engine.step() if o.request_id == request), tokens)
    assert tokens == inline


@pytest.mark.parametrize("field,value", [("regex", "a" * 70_000), ("choice", ["b" * 40_000, "c" * 40_000]),
                                         ("grammar", "root ::= " + '"x" | ' * 20_000 + '"y"')])
def test_a_structured_output_too_large_to_compile_is_refused_naming_the_limit(field, value):
    with pytest.raises(ValueError, match=rf"structured_outputs\.{field} is [\d,]+ characters; at most 65,536"):
        StructuredOutputs(**{field: value})


class _SlowRowsBackend:
    """A grammar backend allowing every token whose rows take ``seconds`` for matchers marked slow (a stand-in for a
    grammar slow to mask; ``time.sleep`` releases the GIL as xgrammar's mask filling does)."""

    def __init__(self, vocab: int, seconds: float):
        self.words, self.seconds = (vocab + 31) // 32, seconds

    def matcher(self, wanted, compiled=None):
        return {"slow": wanted.regex == "slow", "broken": wanted.regex == "broken"}

    def row_masks(self, matcher, drafts):
        if matcher["broken"]:
            raise RuntimeError("the matcher is corrupt")
        if matcher["slow"]:
            time.sleep(self.seconds)
        return np.full((1 + len(drafts), self.words), -1, dtype=np.int32)

    @staticmethod
    def accepted(matcher, tokens):
        return len(tokens), False


@pytest.mark.parametrize("speculative", [False, True])
def test_a_grammar_slow_to_mask_delays_only_its_own_request(near_bigram_target, make_drafter, speculative):
    """A structured request whose token masks take 0.4 s a step sits steps out while the others go on at their own
    pace (masks are computed off the engine's thread, a step waits for them a bounded time); every output is the
    one it has alone."""
    from runtime.sampling.grammar_masks import GrammarMaskJobs

    spec = {"speculative_config": {"speculative_model": str(make_drafter(near_bigram_target, 3, "vanilla"))}} \
        if speculative else {}
    llm = LLM(str(near_bigram_target), **ENGINE, **spec)
    engine = llm.engine
    backend = _SlowRowsBackend(engine.vocab_size, 0.4)
    engine._grammar_backend, engine._mask_jobs = backend, GrammarMaskJobs(backend)
    greedy = SamplingParams(max_tokens=24, temperature=0)
    alone = [o.token_ids for o in llm.generate(PROMPTS[:2], SamplingParams(max_tokens=24, temperature=0))]
    slow = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0,
                                                         structured_outputs=StructuredOutputs(regex="slow")))
    fast = engine.add_request(PROMPTS[1], greedy)
    tokens, longest, fast_done_at = {}, 0.0, None
    began = time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
            if out.request_id == fast and out.finished:
                fast_done_at = time.perf_counter() - began
        if fast_done_at is None:
            longest = max(longest, time.perf_counter() - t)
    assert tokens[fast] == alone[1] and tokens[slow] == alone[0][:3]
    assert longest < 0.2, longest  # no step of the fast request waited for the slow grammar's 0.4 s
    assert fast_done_at < 1.2, fast_done_at  # (the slow request needs at least 3 x 0.4 s)


def test_a_grammar_whose_masks_fail_fails_its_request_alone(near_bigram_target):
    """A mask job that raises (the grammar library's fault on one matcher) ends that request with an error naming
    it; the other requests of its steps decode as they do alone."""
    from runtime.sampling.grammar_masks import GrammarMaskJobs

    llm = LLM(str(near_bigram_target), **ENGINE)
    engine = llm.engine
    alone = llm.generate(PROMPTS[1:3], SamplingParams(max_tokens=12, temperature=0))
    backend = _SlowRowsBackend(engine.vocab_size, 0.0)
    engine._grammar_backend, engine._mask_jobs = backend, GrammarMaskJobs(backend)
    broken = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0,
                                                           structured_outputs=StructuredOutputs(regex="broken")))
    others = [engine.add_request(p, SamplingParams(max_tokens=12, temperature=0)) for p in PROMPTS[1:3]]
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished[broken].finish_reason == "error" and "the matcher is corrupt" in finished[broken].error
    assert [finished[r].token_ids for r in others] == [o.token_ids for o in alone]
