"""The tool-call parsers: hermes (calls between <tool_call> tags, content before them) and llama3_json (an answer of
JSON calls); text that does not parse kept as written; streamed in any split, the same content and calls as parsing
the whole answer."""

import json
import random

from cluster.serve.tool_parsers import PARSER_KINDS, HermesStream, Llama3JsonStream, parse_hermes, parse_llama3_json

CALLS = ('Let me check. <tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
         '<tool_call>\n{"name": "clock", "arguments": {"zone": "UTC"}}\n</tool_call>')


def test_calls_and_the_content_before_them():
    content, calls = parse_hermes(CALLS)
    assert content == "Let me check."
    assert [(n, json.loads(a)) for n, a in calls] == [("weather", {"city": "Oslo", "days": 2}),
                                                      ("clock", {"zone": "UTC"})]
    assert parse_hermes("<tool_call>{\"name\": \"clock\", \"arguments\": {}}</tool_call>")[0] is None
    for text in ("plain text", "<tool_call>{\"name\": \"clock\", \"argu",  # cut mid-call
                 "<tool_call>not json</tool_call>", "<tool_call>[1, 2]</tool_call>",
                 "<tool_call>{\"name\": 3}</tool_call>", CALLS + "\n<tool_call>{\"name\""):
        assert parse_hermes(text) == (text, [])


def test_a_stream_in_any_split_sends_what_parsing_the_whole_answer_gives():
    rng = random.Random(0)
    for text in (CALLS, "no calls here <tool_", "<tool_call>{\"name\": \"clock\", \"argu", "a < b <tool_callx"):
        for _ in range(50):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(8, len(text) - 1))))
            stream, sent = HermesStream(), ""
            for a, b in zip([0] + cuts, cuts + [len(text)]):
                sent += stream.feed(text[a:b])
                assert "<tool_call>" not in sent
            rest, calls = stream.finish()
            content, whole_calls = parse_hermes(text)
            assert calls == whole_calls
            assert sent + rest == (text if not calls else text[:text.find("<tool_call>")])
            if calls:
                assert (sent + rest).strip() == content


LLAMA = ('<|python_tag|>{"name": "weather", "parameters": {"city": "Oslo", "days": 2}}; '
         '{"name": "clock", "arguments": {"zone": "UTC"}}')


def test_llama3_json_calls_and_text():
    content, calls = parse_llama3_json(LLAMA)
    assert content is None and [(n, json.loads(a)) for n, a in calls] == [("weather", {"city": "Oslo", "days": 2}),
                                                                          ("clock", {"zone": "UTC"})]
    assert parse_llama3_json(' {"name": "clock", "parameters": {}}')[1] == [("clock", "{}")]
    for text in ("plain text", '{"name": "clock", "param', '{"name": "clock", "parameters": {}} and then text',
                 '{"name": 3, "parameters": {}}', '{"name": "clock", "parameters": []}', "[1, 2]", "<|python_tag|>x"):
        assert parse_llama3_json(text) == (text, [])
    assert set(PARSER_KINDS) == {"hermes", "llama3_json"}


def test_a_llama3_json_stream_in_any_split_sends_what_parsing_the_whole_answer_gives():
    rng = random.Random(1)
    for text in (LLAMA, " " + LLAMA[len("<|python_tag|>"):], "Sure, here it is.", "<b>not a tag</b>",
                 '{"name": "clock", "param'):
        for _ in range(50):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(8, len(text) - 1))))
            stream, sent = Llama3JsonStream(), ""
            for a, b in zip([0] + cuts, cuts + [len(text)]):
                sent += stream.feed(text[a:b])
            rest, calls = stream.finish()
            content, whole_calls = parse_llama3_json(text)
            assert calls == whole_calls
            assert sent + rest == ("" if calls else text)
            assert not (calls and sent)  # an answer of calls sends no content
