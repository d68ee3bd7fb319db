"""The Serve app on local Ray (CPU), driven with the official openai client and raw HTTP."""

import asyncio
import json
import os
import socket
import threading
import time

import httpx
import openai
import pytest
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from cluster.serve import build_app
from configs import DSparkDecodingConfig
from runtime import LLM as LocalLLM
from runtime import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.slow]
PROMPTS = ["def add(a, b):", "for i in range(10):", "The quick brown fox"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_args(target, drafter, **extra):
    return {"model": str(target), "dtype": "float32", "device": "cpu", "num_pages": 512, "page_size": 4,
            "max_model_len": 256, "speculative_config": {"speculative_model": str(drafter), "speculation_guard": False},
            **extra}


@pytest.fixture(scope="module")
def server(near_bigram_target, make_drafter, tmp_path_factory):
    drafter = make_drafter(near_bigram_target, 4, "vanilla", oracle=True)
    hub = tmp_path_factory.mktemp("hub")  # an offline Hugging Face cache the replicas' processes read
    saved = {k: os.environ.get(k) for k in ("HF_HUB_CACHE", "HF_HUB_OFFLINE")}
    os.environ.update(HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}})
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"engine": engine_args(near_bigram_target, drafter), "served_model_name": "tiny",
                             "tool_call_parser": "hermes"}), name="main", route_prefix="/")
        serve.run(build_app({"engine": engine_args(near_bigram_target, drafter, max_num_seqs=1),
                             "served_model_name": "tiny", "api_key": "sesame", "max_body_bytes": 65536,
                             "stall_timeout_s": 3, "deployment": {"max_waiting_requests": 1}}),
                  name="small", route_prefix="/small")
    except BaseException:  # a failed start must not leave its cluster to every later test's ray.init
        stop_cluster(saved)
        raise
    base = f"http://127.0.0.1:{port}"
    # (the speculation guard off in both: the tests compare their draft counts, which the guard learns from timings)
    local = LocalLLM(str(near_bigram_target), speculative_config=DSparkDecodingConfig(speculative_model=str(drafter),
                                                                                      speculation_guard=False),
                     dtype="float32", device="cpu", num_pages=512, page_size=4, max_model_len=256)
    yield {"base": base, "client": openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0),
           "local": local, "hub": hub}
    stop_cluster(saved)


def stop_cluster(saved_env: dict) -> None:
    """Serve and Ray down, and the environment variables the fixture set back as they were."""
    serve.shutdown()
    ray.shutdown()
    for key, value in saved_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def reference(server, prompt: str, max_tokens: int):
    return server["local"].generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))[0]


def test_models(server):
    assert [m.id for m in server["client"].models.list().data] == ["tiny"]
    import importlib.metadata

    assert httpx.get(f"{server['base']}/version", timeout=30).json() == {"version": importlib.metadata.version("dspark")}
    assert server["client"].models.retrieve("tiny").id == "tiny"
    card = httpx.get(f"{server['base']}/v1/models", timeout=30).json()["data"][0]  # vLLM's fields beside OpenAI's
    assert card["max_model_len"] == 256 and card["root"] == "tiny"
    assert httpx.get(f"{server['base']}/v1/models/tiny", timeout=30).json() == card
    missing = httpx.get(f"{server['base']}/v1/models/org/other", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_equals_runtime_greedy(server, prompt):
    expected = reference(server, prompt, 20)
    r = server["client"].completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
    assert r.choices[0].text == expected.text and r.choices[0].finish_reason == expected.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(expected.prompt_token_ids),
                                                                 len(expected.token_ids))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # our extension: this request's verified and accepted drafts, as the engine counted them
    assert r.usage.model_extra["dspark"] == {"draft_tokens": expected.num_draft_tokens,
                                             "accepted_draft_tokens": expected.num_accepted_tokens}
    assert expected.num_accepted_tokens > 0


def test_usage_reports_the_prompt_tokens_the_prefix_cache_held(server):
    """``usage.prompt_tokens_details.cached_tokens``: none for a new prompt, its full pages (4 tokens each here)
    when the same prompt comes again; ``include_stop_str_in_output`` and ``skip_special_tokens`` are accepted too."""
    prompt = "cached prefix: " + "abcdefgh" * 6
    first = server["client"].completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    again = server["client"].completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                                extra_body={"include_stop_str_in_output": True,
                                                            "skip_special_tokens": False})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == (again.usage.prompt_tokens - 1) // 4 * 4 and cached > 0


def test_streaming_equals_non_streaming_with_exact_usage(server):
    expected = reference(server, PROMPTS[0], 24)
    chunks = list(server["client"].completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                                      stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids) == 24
    assert chunks[-1].usage.model_extra["dspark"] == {"draft_tokens": expected.num_draft_tokens,
                                                      "accepted_draft_tokens": expected.num_accepted_tokens}
    assert len([c for c in chunks if c.choices]) < 24  # steps committed several tokens each


def test_raw_stream_ends_with_done(server):
    body = {"model": "tiny", "prompt": "x = ", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{server['base']}/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_chat_uses_the_chat_template(server):
    tok = server["local"].tokenizer
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
    expected = server["local"].generate([prompt_ids], SamplingParams(max_tokens=12, temperature=0))[0]
    r = server["client"].chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == expected.text
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == len(expected.token_ids)
    stream = server["client"].chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                      stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected.text


def test_completion_logprobs_equal_the_engines_streamed_or_not(server):
    expected = server["local"].generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0, logprobs=3))[0]
    r = server["client"].completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                            logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-5)
    tokenizer = server["local"].tokenizer
    assert lp.tokens == [tokenizer.decode([t]) for t in expected.token_ids]
    assert [len(top) for top in lp.top_logprobs] == [len({tokenizer.decode([t]) for t, _ in e.top})
                                                     for e in expected.logprobs]
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(server["client"].completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                                      logprobs=3, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [x for part in streamed for x in part.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert [x for part in streamed for x in part.text_offset] == lp.text_offset
    plain = server["client"].completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_an_echoed_completion_starts_with_its_prompt_and_the_prompts_logprobs(server):
    """``echo`` with ``logprobs`` (how lm-evaluation-harness scores a continuation): the text and the logprobs start
    with the prompt's, its first token's logprob and top null, the others the engine's prompt logprobs."""
    tokenizer = server["local"].tokenizer
    ids = tokenizer(PROMPTS[1])["input_ids"]
    expected = server["local"].generate([ids], SamplingParams(max_tokens=3, temperature=0, logprobs=2,
                                                              prompt_logprobs=2))[0]
    r = server["client"].completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=3, temperature=0,
                                            logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == PROMPTS[1] + expected.text
    assert lp.tokens == [tokenizer.decode([t]) for t in ids + expected.token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    entries = expected.prompt_logprobs[1:] + expected.logprobs
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in entries], abs=1e-5)
    assert [len(top) for top in lp.top_logprobs[1:]] == [len({tokenizer.decode([t]) for t, _ in e.top})
                                                         for e in entries]
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(server["client"].completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0,
                                                      logprobs=2, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tokenizer.decode(ids) + expected.text
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    bare = server["client"].completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=3, temperature=0,
                                               echo=True)
    assert bare.choices[0].text == PROMPTS[1] + expected.text and bare.choices[0].logprobs is None


def test_vllms_prompt_logprobs_on_both_endpoints(server):
    """vLLM's ``prompt_logprobs`` request field: per prompt token a map {token id: {logprob, rank, decoded_token}} of
    the token and its N most likely alternatives (the engine's prompt logprobs), the first token's null; a
    completion's in each choice (with ``echo`` and ``logprobs`` each shown with its own count), a chat's beside the
    choices (its prompt is the chat template's); streamed, a 400 naming the field."""
    local, tokenizer = server["local"], server["local"].tokenizer
    ids = tokenizer(PROMPTS[1])["input_ids"]
    want = local.generate([ids], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
    payload = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3,
               "echo": True, "logprobs": 1, "n": 2}
    r = httpx.post(f"{server['base']}/v1/completions", json=payload, timeout=120).json()
    for choice in r["choices"]:  # each sample's, the same prompt's
        shown = choice["prompt_logprobs"]
        assert len(shown) == len(ids) and shown[0] is None
        for token, entry, position in zip(ids[1:], want.prompt_logprobs[1:], shown[1:]):
            own = position[str(token)]
            assert own["logprob"] == pytest.approx(entry.logprob, abs=1e-5) and own["rank"] == entry.rank >= 1
            assert own["decoded_token"] == tokenizer.decode([token])
            top = [(int(t), v["logprob"], v["rank"]) for t, v in position.items() if v["rank"] <= 3 and
                   (int(t) != token or entry.rank <= 3)]
            assert sorted(top, key=lambda x: x[2]) == [(t, pytest.approx(lp, abs=1e-5), place) for place, (t, lp)
                                                        in enumerate(entry.top, start=1)]
            assert len(position) == 3 + (entry.rank > 3)  # the token itself beside the top 3 when not among them
        # the echoed prompt's logprobs show logprobs: 1 alternative each, though the engine computed 3
        assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:len(ids)])
    plain = httpx.post(f"{server['base']}/v1/completions", json={**payload, "prompt_logprobs": 0}, timeout=120).json()
    assert all(len(position) == 1 for position in plain["choices"][0]["prompt_logprobs"][1:])  # the token alone
    assert "prompt_logprobs" not in httpx.post(f"{server['base']}/v1/completions", json={
        "model": "tiny", "prompt": PROMPTS[1], "max_tokens": 2}, timeout=120).json()["choices"][0]
    messages = [{"role": "user", "content": PROMPTS[0]}]
    chat = httpx.post(f"{server['base']}/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1},
        timeout=120).json()
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    shown = chat["prompt_logprobs"]
    assert len(shown) == len(prompt) and shown[0] is None and "prompt_logprobs" not in chat["choices"][0]
    assert all(str(token) in position and len(position) <= 2 for token, position in zip(prompt[1:], shown[1:]))
    streamed = httpx.post(f"{server['base']}/v1/completions", json={**payload, "stream": True}, timeout=60)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
    assert "cannot be streamed" in streamed.json()["error"]["message"]


def test_a_batch_of_prompts_answers_each_in_order_as_lm_eval_sends_them(server):
    """OpenAI's batched ``prompt`` (token lists or strings): choice p * n + i is prompt p's sample i; lm-evaluation-
    harness's loglikelihood payload (``echo``, ``logprobs: 1``, ``max_tokens: 1``, token lists) scores each prompt."""
    tokenizer, local = server["local"].tokenizer, server["local"]
    batch = [tokenizer(p)["input_ids"] for p in PROMPTS]
    payload = {"model": "tiny", "prompt": batch, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
               "echo": True}
    r = httpx.post(f"{server['base']}/v1/completions", json=payload, timeout=120).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    for ids, choice in zip(batch, r["choices"]):
        want = local.generate([ids], SamplingParams(max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1))[0]
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx(
            [e.logprob for e in want.prompt_logprobs[1:] + want.logprobs], abs=1e-5)
    assert r["usage"]["prompt_tokens"] == sum(len(ids) for ids in batch)
    texts = server["client"].completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=4, temperature=0, n=2)
    singles = [server["client"].completions.create(model="tiny", prompt=p, max_tokens=4, temperature=0)
               for p in PROMPTS[:2]]
    assert [(c.index, c.text) for c in texts.choices] == [(i, singles[i // 2].choices[0].text) for i in range(4)]
    too_many = httpx.post(f"{server['base']}/v1/completions", json={"model": "tiny", "prompt": [[5]] * 129},
                          timeout=60)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"
    assert "max_waiting_requests" in too_many.json()["error"]["message"]


def test_bad_words_on_both_endpoints_are_the_engines(server):
    """vLLM's ``bad_words``: the answer is the engine's with the same words banned (the greedy text without them
    differs); a word that is not a string or only whitespace is a 400 naming the field."""
    local = server["local"]
    free = reference(server, PROMPTS[0], 8).text
    word = free.split()[0] if free.split() else free[:2]
    want = local.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, bad_words=[word]))[0]
    r = httpx.post(f"{server['base']}/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8,
                                                              "temperature": 0, "bad_words": [word]}, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text != free
    chat = httpx.post(f"{server['base']}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "bad_words": [word]},
        timeout=120)
    assert chat.status_code == 200
    for bad in ([" "], [3], "ab"):
        refused = httpx.post(f"{server['base']}/v1/completions", json={"model": "tiny", "prompt": "x",
                                                                       "bad_words": bad}, timeout=60)
        # (the field, or the item of it: "bad_words.0")
        assert refused.status_code == 400 and refused.json()["error"]["param"].startswith("bad_words"), refused.text


def test_logit_bias_forces_and_bans_tokens_on_both_endpoints(server):
    """OpenAI's ``logit_bias``: -100 bans the greedy first token (the answer equals the engine's with the same bias),
    +100 forces a token even when sampling."""
    local, tokenizer = server["local"], server["local"].tokenizer
    first = reference(server, PROMPTS[0], 6).token_ids[0]
    want = local.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0, logit_bias={first: -100}))[0]
    banned = server["client"].completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                                 logit_bias={str(first): -100})
    assert want.token_ids[0] != first and banned.choices[0].text == want.text
    token = tokenizer("a")["input_ids"][-1]
    forced = server["client"].chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                      max_tokens=4, temperature=0.8, seed=3,
                                                      logit_bias={str(token): 100})
    assert forced.choices[0].message.content == tokenizer.decode([token] * 4)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server):
    chunks = list(server["client"].completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counted = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counted == sorted(counted) and counted[-1] == chunks[-1].usage.completion_tokens == 12
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)


def test_response_format_holds_both_endpoints_to_json(server):
    """OpenAI's ``response_format`` (xgrammar): a json_schema answer parses and fits, a json_object answer starts
    an object; a json_schema type without its schema is a 400 naming response_format."""
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    chat = server["client"].chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=30, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert chat.choices[0].finish_reason == "stop" and set(json.loads(chat.choices[0].message.content)) == {"ok"}
    obj = server["client"].completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                              extra_body={"response_format": {"type": "json_object"}})
    assert obj.choices[0].text.startswith("{")
    bad = httpx.post(f"{server['base']}/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": "x", "response_format": {"type": "json_schema"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("response_format")


WEATHER = {"type": "function", "function": {"name": "weather", "description": "today's weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_tool_calls_named_and_required_streamed_or_not(server):
    """OpenAI's ``tools``: a named ``tool_choice`` answers one call of that function whose arguments fit its schema
    (the engine's answer under that schema, through the chat template with the tools); ``required`` one or more
    calls of the offered functions (one with ``parallel_tool_calls`` false), finishing "tool_calls"; streamed,
    the same calls (a named call's arguments as they come); an earlier call and its result in the history render
    through the template."""
    pytest.importorskip("xgrammar")
    from runtime import StructuredOutputs

    client, local, tokenizer = server["client"], server["local"], server["local"].tokenizer
    messages = [{"role": "user", "content": "weather?"}]
    named = {"type": "function", "function": {"name": "weather"}}
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                       tools=[WEATHER, CLOCK], tool_choice=named)
    message = r.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1 and r.choices[0].finish_reason == "stop"
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in ("Paris", "Oslo") and isinstance(arguments["days"], int)
    prompt = tokenizer.apply_chat_template(messages, tools=[WEATHER, CLOCK], add_generation_prompt=True,
                                           tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert tokenizer.decode(prompt).startswith("[tools] weather clock")
    want = local.generate([prompt], SamplingParams(max_tokens=40, temperature=0, structured_outputs=StructuredOutputs(
        json=json.dumps(WEATHER["function"]["parameters"]))))[0]
    assert call.function.arguments == want.text
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                                 tools=[WEATHER, CLOCK], tool_choice=named, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "weather"
    assert "".join(d.function.arguments for d in deltas) == want.text and all(d.index == 0 for d in deltas)
    for parallel in (True, False):
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=80, temperature=0,
                                           tools=[WEATHER, CLOCK], tool_choice="required",
                                           parallel_tool_calls=parallel)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls and (parallel or len(calls) == 1)
        for c in calls:
            args = json.loads(c.function.arguments)
            assert (c.function.name, set(args)) in (("weather", {"city", "days"}), ("clock", {"zone"}))
        streamed = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=80,
                                                       temperature=0, tools=[WEATHER, CLOCK], tool_choice="required",
                                                       parallel_tool_calls=parallel, stream=True))
        got = [d for c in streamed if c.choices for d in c.choices[0].delta.tool_calls or ()]
        assert [(d.function.name, d.function.arguments) for d in got] == \
            [(c.function.name, c.function.arguments) for c in calls]
        assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "tool_calls"
    history = messages + [{"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "clock", "arguments": '{"zone": "UTC"}'}}]}, {"role": "tool", "tool_call_id": "call_1",
                                                               "content": "12:00"}]
    after = client.chat.completions.create(model="tiny", messages=history, max_tokens=4, temperature=0,
                                           tools=[WEATHER, CLOCK], tool_choice="none")
    # the server rendered the call's arguments as an object, as models' templates expect (not as a JSON string)
    as_object = json.loads(json.dumps(history))
    as_object[1]["tool_calls"][0]["function"]["arguments"] = {"zone": "UTC"}
    rendered = {form: tokenizer.apply_chat_template(h, tools=[WEATHER, CLOCK], add_generation_prompt=True,
                                                    tokenize=False) for form, h in (("object", as_object),
                                                                                    ("text", history))}
    assert '<call clock {"zone": "UTC"}>' in rendered["object"] and "[tool] 12:00" in rendered["object"]
    counts = {form: len(tokenizer(text, add_special_tokens=False)["input_ids"]) for form, text in rendered.items()}
    assert after.usage.prompt_tokens == counts["object"] != counts["text"]
    assert after.choices[0].message.content is not None and after.choices[0].message.tool_calls is None


def test_auto_tool_choice_answers_in_text_or_calls_through_the_hermes_parser(server):
    """``tool_choice: auto`` (the default with tools) on a server with ``tool_call_parser: hermes``: the answer is
    the engine's (special tokens kept: the parser reads tags), as text where it makes no call (this random model
    makes none), streamed too; an answer with <tool_call> blocks becomes OpenAI's calls (``tool_message``)."""
    from cluster.serve import responses
    from cluster.serve.tool_parsers import parse_hermes

    client, local, tokenizer = server["client"], server["local"], server["local"].tokenizer
    messages = [{"role": "user", "content": "weather?"}]
    prompt = tokenizer.apply_chat_template(messages, tools=[WEATHER], add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    want = local.generate([prompt], SamplingParams(max_tokens=12, temperature=0, skip_special_tokens=False))[0]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                       tools=[WEATHER])
    assert r.choices[0].message.content == want.text and r.choices[0].message.tool_calls is None
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 tools=[WEATHER], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    text = 'Checking. <tool_call>{"name": "weather", "arguments": {"city": "Oslo", "days": 1}}</tool_call>'
    message, finish = responses.tool_message("auto", None, text, "stop", parse_hermes)
    assert finish == "tool_calls" and message["content"] == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("weather", {"city": "Oslo", "days": 1})]
    assert responses.tool_message("auto", None, "just text", "length", parse_hermes) == (
        {"role": "assistant", "content": "just text"}, "length")


def test_bad_tool_requests_are_400s_naming_the_field(server):
    """``auto`` (the default with tools) needs a tool-call parser (the small app has none); a named choice must be
    offered; tool choices need tools; a tool message needs its call's id; a function name is OpenAI's pattern."""
    base = f"{server['base']}/v1/chat/completions"
    messages = [{"role": "user", "content": "x"}]
    for extra in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):  # a server without a parser
        r = httpx.post(f"{server['base']}/small/v1/chat/completions", json={"model": "tiny", "messages": messages,
                                                                             **extra},
                       headers={"Authorization": "Bearer sesame"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        assert "--tool-call-parser hermes" in r.json()["error"]["message"]
    for extra, param, words in (
            ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "clock"}}},
             "tool_choice", "which tools do not offer"),
            ({"tool_choice": "required"}, "tool_choice", "needs tools"),
            ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "each function name once"),
            ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools", "pattern"),
            ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
             "tool_choice", "give one of them"),
            ({"messages": [{"role": "tool", "content": "12:00"}]}, "messages", "tool_call_id")):
        r = httpx.post(base, json={"model": "tiny", "messages": messages, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), (extra, r.text)
        assert words in r.json()["error"]["message"], (extra, r.text)


def test_vllms_chat_template_options(server):
    """vLLM's ``chat_template_kwargs`` (template variables, e.g. Qwen3's ``enable_thinking``),
    ``add_generation_prompt`` and ``continue_final_message`` render the prompt as transformers does with them (the
    usage's prompt tokens); options that do not go together are 400s naming the field."""
    tokenizer, base = server["local"].tokenizer, f"{server['base']}/v1/chat/completions"
    user = [{"role": "user", "content": "hello"}]
    started = user + [{"role": "assistant", "content": "The answer is"}]

    def prompt_tokens(messages, **kwargs):
        r = httpx.post(base, json={"model": "tiny", "messages": messages, "max_tokens": 1, **kwargs}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    def rendered(messages, **kwargs):
        ids = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

    assert prompt_tokens(user, chat_template_kwargs={"enable_thinking": False}) == rendered(
        user, add_generation_prompt=True, enable_thinking=False) != rendered(user, add_generation_prompt=True)
    assert prompt_tokens(user, add_generation_prompt=False) == rendered(user, add_generation_prompt=False)
    assert prompt_tokens(started, add_generation_prompt=False, continue_final_message=True) == rendered(
        started, continue_final_message=True) < rendered(started, add_generation_prompt=False)
    tokenized = httpx.post(f"{server['base']}/tokenize", json={
        "messages": started, "add_generation_prompt": False, "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False}, "tools": [WEATHER]}, timeout=60).json()  # vLLM's too
    assert tokenized["count"] == rendered(started, continue_final_message=True, enable_thinking=False,
                                          tools=[WEATHER])
    for extra, param in (({"continue_final_message": True}, "continue_final_message"),
                         ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                         # tokenizer options are not template variables (they would cut the prompt silently)
                         ({"chat_template_kwargs": {"truncation": True, "max_length": 1}}, "chat_template_kwargs"),
                         ({"chat_template_kwargs": {"tokenizer_kwargs": {"add_special_tokens": "zz"}}},
                          "chat_template_kwargs"),
                         ({"chat_template_kwargs": "x"}, "chat_template_kwargs")):
        r = httpx.post(base, json={"model": "tiny", "messages": started, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_vllms_structured_outputs_and_guided_fields(server):
    """vLLM's ``structured_outputs`` field (json, json_object, regex, choice, grammar) and its older ``guided_*``
    names hold the answer as the engine's ``StructuredOutputs`` does; one of them a request, and what xgrammar
    cannot compile, are 400s naming the field."""
    import re

    pytest.importorskip("xgrammar")
    from runtime import StructuredOutputs

    local, base = server["local"], server["base"]
    choices = ["yes", "no way"]
    want = local.generate([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=0, structured_outputs=
                                                       StructuredOutputs(choice=tuple(choices))))[0].text
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 10,
                                                        "temperature": 0, **extra}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want in choices, r.text
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 12, "temperature": 0}
    for extra in ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, {"guided_regex": "[0-9]{3}-[a-z]{2}"}):
        r = httpx.post(f"{base}/v1/chat/completions", json={**chat, **extra}, timeout=60)
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.json()["choices"][0]["message"]["content"]), r.text
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    for extra in ({"structured_outputs": {"json": schema}}, {"guided_json": schema},
                  {"structured_outputs": {"grammar": 'root ::= "{\\"ok\\": " ("true" | "false") "}"'}}):
        r = httpx.post(f"{base}/v1/chat/completions", json={**chat, "max_tokens": 20, **extra}, timeout=60)
        assert set(json.loads(r.json()["choices"][0]["message"]["content"])) == {"ok"}, (extra, r.text)
    for extra, param in (({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
                         ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
                         ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
                         ({"guided_regex": "[unclosed"}, "guided_regex"),
                         ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs")):
        r = httpx.post(f"{base}/v1/chat/completions", json={**chat, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), (extra, r.text)


def test_chat_logprobs_and_top_logprobs(server):
    messages = [{"role": "user", "content": "hello"}]
    r = server["client"].chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert all(c.bytes == list(c.token.encode()) and c.logprob <= 0 for c in content)
    assert all(c.token == c.top_logprobs[0].token for c in content)  # greedy: each token is its row's best
    stream = server["client"].chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                      logprobs=True, top_logprobs=2, stream=True)
    streamed = [x for c in stream if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [x.token for x in streamed] == [x.token for x in content]
    # the second request starts from the first's cached prompt pages: the same values up to fp32 rounding
    assert [x.logprob for x in streamed] == pytest.approx([x.logprob for x in content], abs=1e-5)


@pytest.mark.parametrize("path,payload,param", [
    ("/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": 2},
     "logprobs"),
])
def test_bad_logprobs_requests_are_400s_naming_the_parameter(server, path, payload, param):
    r = post(server, path, payload)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_n_samples_streamed_or_not(server):
    client = server["client"]
    keep_going = {"ignore_eos": True}
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=0.9, seed=5, n=3,
                                  extra_body=keep_going)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, choice in enumerate(r.choices):  # sample i is the request seeded seed + i
        alone = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=0.9, seed=5 + i,
                                          extra_body=keep_going)
        assert choice.text == alone.choices[0].text
    assert r.usage.completion_tokens == 30
    assert r.usage.prompt_tokens == len(server["local"].tokenizer(PROMPTS[0])["input_ids"])  # counted once
    greedy = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                            max_tokens=6, temperature=0)
    assert len({c.message.content for c in greedy.choices}) == 1 and len(greedy.choices) == 2
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=0.9, seed=5,
                                            n=3, stream=True, stream_options={"include_usage": True},
                                            extra_body=keep_going))
    texts = ["", "", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in r.choices] and chunks[-1].usage.completion_tokens == 30


def test_best_of_answers_the_most_likely_sample(server):
    client, local = server["client"], server["local"]
    r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=1.0, seed=9, best_of=3,
                                  extra_body={"ignore_eos": True})
    ids = local.tokenizer(PROMPTS[1])["input_ids"]
    drawn = [local.generate([ids], SamplingParams(max_tokens=8, temperature=1.0, seed=9 + i, logprobs=0,
                                                  ignore_eos=True))[0] for i in range(3)]
    best = max(drawn, key=lambda o: sum(e.logprob for e in o.logprobs))
    assert len(r.choices) == 1 and r.choices[0].text == best.text and r.choices[0].logprobs is None
    assert r.usage.completion_tokens == 24  # every drawn sample counts
    bad = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "best_of": 3, "stream": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "best_of"
    bad = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "best_of": 2, "n": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "best_of"


def post(server, path, payload, headers=None, raw=None):
    return httpx.post(f"{server['base']}{path}", json=payload if raw is None else None, content=raw,
                      headers={"content-type": "application/json", **(headers or {})}, timeout=60)


@pytest.mark.parametrize("payload,status,param", [
    ({"model": "tiny", "prompt": "x", "temperature": 5}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "n": 17}, 400, "n"),  # above the server's max_n (16)
    ({"model": "tiny", "prompt": "x", "n": 129}, 400, "n"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"1": 101}}, 400, "logit_bias.1"),  # the entry named
    ({"model": "tiny", "prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ({"model": "tiny", "prompt": "x", "allowed_token_ids": [99999]}, 400, "allowed_token_ids"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"one": 5}}, 400, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"99999": 5}}, 400, "logit_bias"),  # past the vocabulary
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "repetition_penalty": 1.2}, 400, "repetition_penalty"),
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"model": "tiny", "prompt": list(range(3, 300))}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(server, payload, status, param):
    r = post(server, "/v1/completions", payload)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]


@pytest.mark.parametrize("path,payload,param", [
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_k": 10**20}, "top_k"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": 0, "top_k": 10**20}, "top_k"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 10**30}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1e30}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": ""}, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": ["", "x"]}, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": [f"s{i}" for i in range(200)]}, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": "y" * 5000}, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "seed": 10**30}, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids"),
    ("/v1/completions", {"model": "tiny", "prompt": [5, -1]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x\ud800y"}, "prompt"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x\ud800y"}]},
     "messages.0.content"),
])
def test_out_of_bounds_and_mistyped_parameters_are_400s_naming_them(server, path, payload, param):
    raw = json.dumps(payload).encode()  # json.dumps keeps a lone surrogate as its \ud800 escape
    r = post(server, path, None, raw=raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_malformed_json(server):
    r = post(server, "/v1/chat/completions", None, raw=b'{"model": "tiny", "messages": [')
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert r.json()["error"]["param"] is None


def test_a_poison_request_hurts_nobody_else(server):
    """A request whose parameter would overflow inside a step is refused at admission; the streams and
    non-streaming requests in flight finish exactly, and the replica is not rebuilt."""
    client = openai.AsyncOpenAI(base_url=f"{server['base']}/v1", api_key="unused", max_retries=0)
    expected = [reference(server, f"v{i} = ", 40) for i in range(6)]
    ranks_before = httpx.get(f"{server['base']}/health", timeout=30).json()["ranks"]

    async def streamed(i):
        stream = await client.completions.create(model="tiny", prompt=f"v{i} = ", max_tokens=40, temperature=0,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def plain(i):
        r = await client.completions.create(model="tiny", prompt=f"v{i} = ", max_tokens=40, temperature=0)
        return r.choices[0].text

    async def poison():
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(timeout=60) as http:
            return [await http.post(f"{server['base']}/v1/completions", json={
                "model": "tiny", "prompt": "x", "max_tokens": 4, "temperature": t, "top_k": 10**20}) for t in (1, 0)]

    async def together():
        return await asyncio.gather(*[streamed(i) for i in range(3)], *[plain(i) for i in range(3, 6)], poison())

    *texts, refused = asyncio.run(together())
    assert texts == [e.text for e in expected]
    assert [r.status_code for r in refused] == [400, 400]
    assert all(r.json()["error"]["param"] == "top_k" for r in refused)
    assert httpx.get(f"{server['base']}/health", timeout=30).json()["ranks"] == ranks_before


@pytest.mark.parametrize("method,path,raw,status,code", [
    ("GET", "/v1/nothing-here", None, 404, "not_found"),
    ("DELETE", "/v1/completions", None, 405, "method_not_allowed"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, "invalid_json"),
    ("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, None),
])
def test_routing_and_parsing_errors_have_openai_shape(server, method, path, raw, status, code):
    r = httpx.request(method, f"{server['base']}{path}", content=raw, headers={"content-type": "application/json"},
                      timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert code is None or err["code"] == code


def test_authentication_comes_first_and_accepts_any_bearer_case(server):
    bad_body = {"model": "tiny", "prompt": "x", "temperature": "hot"}
    assert post(server, "/small/v1/completions", bad_body).status_code == 401  # nothing about the schema leaks
    assert post(server, "/small/v1/completions", bad_body, {"authorization": "Bearer wrong"}).status_code == 401
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = post(server, "/small/v1/completions", bad_body, {"authorization": f"{scheme} sesame"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert httpx.get(f"{server['base']}/small/v1/models", headers={"authorization": "bearer sesame"}).status_code == 200


def test_with_a_key_only_health_and_metrics_are_open(server):
    """The tokenizer routes (a big body is work), the chat template, the version and the API's documentation need
    the key too; the probes a balancer and a scraper send do not."""
    base, auth = f"{server['base']}/small", {"authorization": "Bearer sesame"}
    for method, route, body in (("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [5]}),
                                ("GET", "/tokenizer_info", None), ("GET", "/version", None), ("GET", "/docs", None),
                                ("GET", "/redoc", None), ("GET", "/openapi.json", None)):
        r = httpx.request(method, base + route, json=body, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (route, r.text)
        assert httpx.request(method, base + route, json=body, headers=auth, timeout=60).status_code == 200, route
    for route in ("/health", "/metrics"):
        r = httpx.get(base + route, timeout=60)
        assert r.status_code == 200, (route, r.text)


def test_api_key_and_overload(server):
    payload = {"model": "tiny", "prompt": "x = 1", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    assert post(server, "/small/v1/completions", payload).status_code == 401
    auth = {"authorization": "Bearer sesame"}

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[client.post(f"{server['base']}/small/v1/completions", json=payload,
                                                      headers=auth) for _ in range(8)])

    statuses = [r.status_code for r in asyncio.run(burst())]
    assert 200 in statuses and 429 in statuses
    limited = next(r for r in asyncio.run(burst()) if r.status_code == 429)
    assert limited.headers["retry-after"] == "1" and limited.json()["error"]["type"] == "rate_limit_error"


def test_32_concurrent_streams_complete(server):
    client = openai.AsyncOpenAI(base_url=f"{server['base']}/v1", api_key="unused", max_retries=0)

    async def one(i):
        stream = await client.completions.create(model="tiny", prompt=f"x{i} = ", max_tokens=16, temperature=0.8,
                                                 seed=i, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        return chunks[-1].usage.completion_tokens

    async def many():
        return await asyncio.gather(*[one(i) for i in range(32)])

    assert asyncio.run(many()) == [16] * 32


def metrics(server) -> dict:
    text = httpx.get(f"{server['base']}/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels or "position" in s.labels}


def test_cancelled_stream_frees_its_pages(server):
    body = {"model": "tiny", "prompt": "a", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server['base']}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        next(lines)
        assert metrics(server)["dspark:num_requests_running"] >= 1
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = metrics(server)
        if m["dspark:kv_pages_used"] == 0 and m["dspark:num_requests_running"] == 0:
            break
        time.sleep(0.2)
    assert m["dspark:kv_pages_used"] == 0 and m["dspark:num_requests_running"] == 0


def test_metrics_and_health(server):
    server["client"].completions.create(model="tiny", prompt="y", max_tokens=8, temperature=0)
    text = httpx.get(f"{server['base']}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("dspark:spec_decode_num_drafts", "dspark:spec_decode_num_draft_tokens",
                 "dspark:spec_decode_num_accepted_tokens", "dspark:spec_decode_num_accepted_tokens_per_pos",
                 "dspark:spec_decode_mean_acceptance_length", "dspark:time_to_first_token_seconds",
                 "dspark:time_per_output_token_seconds", "dspark:e2e_request_latency_seconds",
                 "dspark:num_requests_running", "dspark:num_requests_waiting", "dspark:kv_pages_used",
                 "dspark:moe_backend_info", "dspark:replica_idle_parks", "dspark:replica_parked"):
        assert name in families, name
    positions = {s.labels["position"] for s in families["dspark:spec_decode_num_accepted_tokens_per_pos"].samples}
    assert positions == {"0", "1", "2", "3"}
    # latencies from the request's arrival: the engine's first-token time (a whole response gets only its finished
    # output from the engine), at most the request's whole latency
    sums = {s.name: s.value for f in ("dspark:time_to_first_token_seconds", "dspark:e2e_request_latency_seconds")
            for s in families[f].samples if s.name.endswith("_sum")}
    assert 0 < sums["dspark:time_to_first_token_seconds_sum"] <= sums["dspark:e2e_request_latency_seconds_sum"]
    # the prefix cache: the same long prompt twice, the second finds the first's pages
    prompt = "def shared_system_prompt(x):\n    return x * 2 + 1\n" * 4
    before = metrics(server)
    for _ in range(2):
        server["client"].completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    after = metrics(server)
    hits = after["dspark:prefix_cache_hits_total"] - before["dspark:prefix_cache_hits_total"]
    queries = after["dspark:prefix_cache_queries_total"] - before["dspark:prefix_cache_queries_total"]
    assert queries > hits > 0 and after["dspark:kv_pages_cached"] > 0
    assert families["dspark:moe_backend_info"].samples[0].labels["backend"] == "none"
    health = httpx.get(f"{server['base']}/health").json()
    assert health["status"] == "ok" and health["ranks"][0]["role"] == "target"


def test_two_serve_replicas_behind_one_route_in_serves_placement_groups(server, near_bigram_target, make_drafter):
    """The deployment declares each replica's bundles (the Serve replica, then its shard): Serve reserves them,
    no replica reserves a group of its own, and two replicas answer on one route, exactly."""
    from ray.util import placement_group_table

    drafter = make_drafter(near_bigram_target, 4, "vanilla", oracle=True)
    serve.run(build_app({"engine": engine_args(near_bigram_target, drafter), "served_model_name": "tiny",
                         "deployment": {"num_replicas": 2}}), name="two", route_prefix="/two")
    try:
        created = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
        assert not [g for g in created if g["name"].startswith("dspark-")]  # none of the replicas' own
        assert sum(len(g["bundles"]) == 2 for g in created) >= 4  # main, small and the two of "two"
        expected = reference(server, PROMPTS[1], 12)
        pids = set()
        for _ in range(16):
            r = post(server, "/two/v1/completions", {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 12,
                                                     "temperature": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected.text
            pids.add(httpx.get(f"{server['base']}/two/health", timeout=30).json()["ranks"][0]["pid"])
        assert len(pids) == 2  # both replicas served
    finally:
        serve.delete("two")


def test_a_cuda_engine_declares_gpu_bundles_before_the_gpus_arrive(server, near_bigram_target):
    """On this CPU-only cluster a cuda engine still declares GPU bundles (workers may still be starting, or
    autoscale from zero): Serve holds the replica until they come, instead of placing it on CPUs."""
    from cluster.placement.serving import serve_plan
    from configs import ServeArgs

    def plan(device, **parallel):
        return serve_plan(ServeArgs(engine={"model": str(near_bigram_target), "device": device},
                                    parallel=parallel))

    waiting = plan("cuda", tensor_parallel_size=2)
    assert waiting.bundles == [{"GPU": 1.0, "CPU": 1.0}] * 2 and waiting.strategy == "PACK"
    assert plan("cpu").bundles == [{"CPU": 1.0}] and plan("auto").bundles == [{"CPU": 1.0}]


def test_a_hub_id_is_served_under_its_name(server, near_bigram_target):
    """The app's model given as a Hub id, resolved by the replica from the (offline) Hub cache: clients call the
    model by its id, and it answers as the local checkpoint does, streamed or not."""
    from tests.runtime.test_hub import fill_cache

    fill_cache(server["hub"], "acme/bigram", near_bigram_target)
    engine = {"model": "acme/bigram", "dtype": "float32", "device": "cpu", "num_pages": 64, "page_size": 4,
              "max_model_len": 128}
    serve.run(build_app({"engine": engine}), name="hub", route_prefix="/hub")
    try:
        client = openai.OpenAI(base_url=f"{server['base']}/hub/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["acme/bigram"]
        expected = LocalLLM(str(near_bigram_target), dtype="float32", device="cpu", num_pages=64, page_size=4,
                            max_model_len=128).generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0))[0]
        r = client.completions.create(model="acme/bigram", prompt=PROMPTS[0], max_tokens=6, temperature=0)
        assert r.choices[0].text == expected.text
        chunks = client.completions.create(model="acme/bigram", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    finally:
        serve.delete("hub")


def test_graceful_shutdown_drains(server, near_bigram_target, make_drafter):
    drafter = make_drafter(near_bigram_target, 4, "vanilla", oracle=True)
    serve.run(build_app({"engine": engine_args(near_bigram_target, drafter), "served_model_name": "tiny"}),
              name="drain", route_prefix="/drain")
    result = {}

    def slow_request():
        payload = {"model": "tiny", "prompt": "z", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
        result["response"] = post(server, "/drain/v1/completions", payload)

    thread = threading.Thread(target=slow_request)
    thread.start()
    time.sleep(1.0)
    serve.delete("drain")  # waits for the in-flight request before the replica stops
    thread.join(timeout=60)
    assert result["response"].status_code == 200
    assert json.loads(result["response"].text)["usage"]["completion_tokens"] == 120


# ---- property-based fuzzing of both endpoints --------------------------------------------------------------

def json_values():
    scalars = (st.none() | st.booleans() | st.integers(-3, 40) | st.sampled_from([10**20, -(10**20), 2**31, 2**63])
               | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([1e-45, 1e30, 0.5, 2.0, 0.0])
               | st.text(max_size=12) | st.sampled_from(["", "x\ud800y", "def f(", "tiny", "\u0000"]))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=6), inner, max_size=3), max_leaves=8)


FIELDS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "stream", "stream_options",
          "stop", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
          "stop_token_ids", "n", "best_of", "logprobs", "top_logprobs", "user", "echo", "logit_bias", "min_tokens",
          "include_stop_str_in_output", "skip_special_tokens", "response_format", "allowed_token_ids",
          "prompt_logprobs", "bad_words", "tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt",
          "continue_final_message", "chat_template_kwargs", "structured_outputs", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar"]


@st.composite
def bodies(draw):
    chat = draw(st.booleans())
    body = {"model": draw(st.sampled_from(["tiny", "tiny", "tiny", "other", 7]))}
    if draw(st.integers(0, 9)):  # usually the prompt or messages are there, sometimes of a wrong shape
        if chat:
            body["messages"] = draw(st.lists(st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "assistant", "robot"]), "content": json_values()}),
                max_size=3) | json_values())
        else:
            body["prompt"] = draw(st.sampled_from(["x = ", "for i in"]) | st.lists(st.integers(-2, 400), max_size=6)
                                  | json_values())
    for name in draw(st.lists(st.sampled_from(FIELDS + ["extra_field"]), max_size=5, unique=True)):
        body[name] = draw(json_values())
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=bodies())
def test_fuzzed_requests_never_get_a_5xx_and_errors_keep_openai_shape(server, case):
    path, body = case
    raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    with httpx.stream("POST", f"{server['base']}{path}", content=raw, headers={"content-type": "application/json"},
                      timeout=120) as r:
        text = r.read().decode("utf-8", "replace")
    assert r.status_code < 500, (r.status_code, text, body)
    if r.status_code != 200:
        err = json.loads(text)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], text
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert text.rstrip().endswith("data: [DONE]"), text[-300:]


def test_the_server_is_healthy_and_exact_after_fuzzing(server):
    assert httpx.get(f"{server['base']}/health", timeout=30).status_code == 200
    expected = reference(server, PROMPTS[1], 16)
    r = server["client"].completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0)
    assert r.choices[0].text == expected.text


def test_a_shard_killed_mid_stream_ends_every_stream_with_an_error_then_recovers(server):
    """Chaos: SIGKILL the target shard while streams run: each stream gets an error event and [DONE], the replica
    rebuilds itself, and later requests are exact."""
    import os
    import signal

    pid = httpx.get(f"{server['base']}/health", timeout=30).json()["ranks"][0]["pid"]
    body = {"model": "tiny", "prompt": "z", "max_tokens": 250, "stream": True, "ignore_eos": True, "temperature": 0}
    streams, started = [], threading.Semaphore(0)

    def consume():
        with httpx.stream("POST", f"{server['base']}/v1/completions", json=body, timeout=120) as r:
            lines = []
            for line in r.iter_lines():
                if line and not lines:
                    started.release()
                if line:
                    lines.append(line)
            streams.append(lines)

    workers = [threading.Thread(target=consume) for _ in range(3)]
    for w in workers:
        w.start()
    for _ in workers:  # every stream has sent its first chunk: all three are mid-stream
        assert started.acquire(timeout=60)
    os.kill(pid, signal.SIGKILL)
    for w in workers:
        w.join(timeout=120)
    assert len(streams) == 3
    for lines in streams:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert json.loads(lines[-2].removeprefix("data: ")).get("error", {}).get("code") == "replica_failure", \
            lines[-3:]
    deadline = time.monotonic() + 60
    while httpx.get(f"{server['base']}/health", timeout=30).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.3)
    expected = reference(server, PROMPTS[2], 12)
    r = server["client"].completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0)
    assert r.choices[0].text == expected.text


def test_a_dead_shard_is_rebuilt_without_traffic(server):
    """No request arrives: the engine thread's idle probe notices the dead actor, /health says 503 while the replica
    rebuilds (never 'ok' with no ranks), then 200 with a new process, and requests are exact again."""
    import os
    import signal

    before = httpx.get(f"{server['base']}/health", timeout=30).json()["ranks"]
    os.kill(before[0]["pid"], signal.SIGKILL)
    seen, deadline = [], time.monotonic() + 60
    while time.monotonic() < deadline:
        r = httpx.get(f"{server['base']}/health", timeout=30)
        seen.append(r.status_code)
        if r.status_code == 200 and r.json()["ranks"][0]["pid"] != before[0]["pid"]:
            break
        assert r.status_code == 503 and r.json()["error"]["message"], r.text
        time.sleep(0.2)
    assert seen[-1] == 200 and 503 in seen, seen
    assert time.monotonic() < deadline - 30  # rebuilt within half a minute of the kill, with no traffic
    expected = reference(server, PROMPTS[0], 12)
    r = server["client"].completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert r.choices[0].text == expected.text


def test_the_tokenizer_endpoints_answer_as_vllms_for_lm_eval(server):
    """vLLM's /tokenize, /detokenize and /tokenizer_info (lm-evaluation-harness's remote tokenizer reads them): the
    engine's own token ids, their text, the chat template's ids; bad tokens and unknown models are 400 / 404."""
    base, tokenizer = server["base"], server["local"].tokenizer
    r = httpx.post(f"{base}/tokenize", json={"prompt": PROMPTS[0], "add_special_tokens": False}, timeout=30).json()
    assert r["tokens"] == tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    chat = httpx.post(f"{base}/tokenize", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                      timeout=30).json()
    assert chat["tokens"] == list(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                add_generation_prompt=True, tokenize=True)["input_ids"])
    assert httpx.post(f"{base}/detokenize", json={"tokens": r["tokens"]}, timeout=30).json() == {"prompt": PROMPTS[0]}
    info = httpx.get(f"{base}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [10**6]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(f"{base}/tokenize", json={"model": "other", "prompt": "x"}, timeout=30).status_code == 404
    neither = httpx.post(f"{base}/tokenize", json={"add_special_tokens": True}, timeout=30)
    assert neither.status_code == 400


def test_contradictory_constraints_are_the_clients_400_streamed_or_not(server):
    """``allowed_token_ids`` [5] with ``min_tokens`` banning stop token 5 leaves no token to choose: a 400 naming
    the constraints, in OpenAI's shape, never a 500 about the model's logits."""
    body = {"model": "tiny", "prompt": "x = 1", "max_tokens": 8, "temperature": 0, "allowed_token_ids": [5],
            "stop_token_ids": [5], "min_tokens": 4}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsatisfiable_constraints", r.text
    assert "allowed_token_ids, min_tokens" in r.json()["error"]["message"]
    # streamed: the failure comes before the first token, so before the stream starts: the same 400
    r = post(server, "/v1/completions", {**body, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsatisfiable_constraints", r.text


def test_a_body_over_the_limit_is_a_413_before_it_is_read_and_a_hopeless_prompt_a_400_before_it_is_tokenized(server):
    auth = {"authorization": "Bearer sesame"}
    big = {"model": "tiny", "prompt": "x" * 100_000, "max_tokens": 1}
    r = post(server, "/small/v1/completions", big, auth)  # (the small app takes 64 KiB)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"x" * 10_000
        yield b'"}'

    r = httpx.post(f"{server['base']}/small/v1/completions", content=chunks(), timeout=60,
                   headers={**auth, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    began = time.monotonic()
    r = post(server, "/v1/completions", big)  # the main app takes it, and refuses it by its length alone
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "characters are at least" in r.json()["error"]["message"] and time.monotonic() - began < 5


def test_asking_for_more_tokens_than_the_context_leaves_is_a_400_not_a_silent_cut(server):
    """max_tokens past the context (256 here) is the client's error, as OpenAI and vLLM answer it; unset, the budget
    is what the context leaves."""
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "def fib(n):", "max_tokens": 300})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert "maximum context length is 256 tokens" in error["message"] and "set max_tokens to at most" in error["message"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000}
    r = post(server, "/v1/chat/completions", chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text
    del chat["max_completion_tokens"]
    r = post(server, "/v1/chat/completions", {**chat, "temperature": 0})
    assert r.status_code == 200, r.text


def test_clients_gone_at_any_moment_abort_every_sample_of_their_requests(server):
    """Streamed n=4 completions whose clients reset the connection right after sending, after the headers or mid
    stream: every sample that started is aborted (counted in dspark:num_aborted_requests, not run to max_tokens),
    the pages come back, and the server goes on answering."""
    import concurrent.futures
    import socket
    import struct
    from urllib.parse import urlparse

    url = urlparse(server["base"])
    body = json.dumps({"model": "tiny", "prompt": "def fib(n):", "max_tokens": 240, "n": 4, "stream": True,
                       "ignore_eos": True, "temperature": 0.8, "seed": 3})
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
    before = metrics(server)["dspark:num_aborted_requests_total"]

    def client(moment: str) -> bool:
        """One client that resets its connection at ``moment``; whether its request had started streaming."""
        conn = socket.create_connection((url.hostname, url.port), timeout=30)
        conn.sendall(request)
        seen = b""
        while moment != "sent" and (b"\r\n\r\n" not in seen if moment == "headers" else seen.count(b"data:") < 6):
            seen += conn.recv(4096)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, not a FIN
        conn.close()
        return moment != "sent"

    with concurrent.futures.ThreadPoolExecutor(12) as pool:  # (together: the race is between them and the steps)
        streamed = sum(pool.map(client, ("sent", "headers", "chunks") * 4))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = metrics(server)
        if m["dspark:num_requests_running"] == m["dspark:num_requests_waiting"] == m["dspark:kv_pages_used"] == 0:
            break
        time.sleep(0.1)
    assert m["dspark:num_requests_running"] == m["dspark:num_requests_waiting"] == m["dspark:kv_pages_used"] == 0
    # (240 tokens take the tiny model far longer than a reset takes to arrive: a sample that was not aborted ran on)
    assert m["dspark:num_aborted_requests_total"] - before >= 4 * streamed
    out = server["client"].completions.create(model="tiny", prompt="def fib(n):", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length"


def reset_clients(server, body: dict, count: int) -> None:
    """``count`` raw clients that send ``body`` as a streamed completion and reset their connections as soon as the
    first chunks arrive (a disconnect storm)."""
    import concurrent.futures
    import socket
    import struct
    from urllib.parse import urlparse

    url = urlparse(server["base"])
    raw = json.dumps(body)
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(raw)}\r\n\r\n{raw}").encode()

    def client(_):
        with socket.create_connection((url.hostname, url.port), timeout=30) as conn:
            conn.sendall(request)
            seen = b""
            while seen.count(b"data:") < 2 and len(seen) < 1 << 16:
                seen += conn.recv(4096) or b"x" * (1 << 16)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, not a FIN

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        list(pool.map(client, range(count)))


def test_chaos_a_grammar_bomb_a_huge_body_and_a_disconnect_storm_never_stall_a_greedy_stream(server):
    """While a greedy stream runs: a regex whose token masks cost twice as much every second token (for the tiny
    tokenizer ~0.03 s at the start, ~1 s ten tokens on; a verify step masks 5 rows), a 5 MB prompt, 16 clients
    resetting their streams. The stream's longest gap between chunks stays
    under 1 s and its text is the one it has alone; the bomb finishes on its own (its grammar holds its output); the
    server goes on answering."""
    pytest.importorskip("xgrammar")
    client = openai.AsyncOpenAI(base_url=f"{server['base']}/v1", api_key="unused", max_retries=0)
    expected = server["local"].generate(["def fib(n):"], SamplingParams(max_tokens=160, temperature=0,
                                                                        ignore_eos=True))[0].text
    bomb = {"model": "tiny", "prompt": "aaaa", "max_tokens": 10, "temperature": 0,
            "guided_regex": "((.{0,100}){0,100}){0,100}x"}

    async def stream():
        await asyncio.sleep(0.5)  # (the bomb is running)
        chunks, gaps, last = [], [], None
        s = await client.completions.create(model="tiny", prompt="def fib(n):", max_tokens=160, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
        async for c in s:
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            chunks.extend(x.text for x in c.choices)
        return "".join(chunks), max(gaps)

    async def attacks():
        async with httpx.AsyncClient(timeout=120) as http:
            bombed = asyncio.ensure_future(http.post(f"{server['base']}/v1/completions", json=bomb))
            await asyncio.sleep(0.8)
            huge = await http.post(f"{server['base']}/v1/completions",
                                   json={"model": "tiny", "prompt": "x " * 2_500_000, "max_tokens": 1})
            await asyncio.to_thread(reset_clients, server, {"model": "tiny", "prompt": "def fib(n):", "n": 4,
                                                            "max_tokens": 200, "stream": True, "ignore_eos": True,
                                                            "temperature": 0.8}, 16)
            return await bombed, huge

    async def together():
        return await asyncio.gather(stream(), attacks())

    (text, longest), (bombed, huge) = asyncio.run(together())
    assert text == expected
    assert longest < 1.0, longest
    assert huge.status_code == 400 and huge.json()["error"]["code"] == "context_length_exceeded", huge.text
    assert bombed.status_code == 200, bombed.text
    out = bombed.json()["choices"][0]
    assert out["finish_reason"] in ("stop", "length")
    assert len(out["text"]) > 0
    assert server["client"].completions.create(model="tiny", prompt="y", max_tokens=2, temperature=0).choices


def test_a_frozen_engine_turns_health_unhealthy_within_seconds_and_healthy_when_it_steps_again(server):
    """The small app (stall_timeout_s 3): its target shard stopped (SIGSTOP) mid-stream, /health answers 503 within
    seconds; continued (SIGCONT), the stream finishes as it would have and /health is 200 again."""
    import signal

    auth = {"authorization": "Bearer sesame"}
    health = httpx.get(f"{server['base']}/small/health", timeout=30).json()
    target = next(r for r in health["ranks"] if r["role"] == "target")
    small = openai.OpenAI(base_url=f"{server['base']}/small/v1", api_key="sesame", max_retries=0)
    expected = server["local"].generate(["def fib(n):"], SamplingParams(max_tokens=120, temperature=0,
                                                                        ignore_eos=True))[0].text
    s = small.completions.create(model="tiny", prompt="def fib(n):", max_tokens=120, temperature=0, stream=True,
                                 extra_body={"ignore_eos": True})
    chunks = iter(s)
    text = next(chunks).choices[0].text
    os.kill(target["pid"], signal.SIGSTOP)
    try:
        deadline, status = time.monotonic() + 20, 200
        while status == 200 and time.monotonic() < deadline:
            time.sleep(0.5)
            r = httpx.get(f"{server['base']}/small/health", headers=auth, timeout=30)
            status = r.status_code
        assert status == 503 and r.json()["error"]["code"] in ("stalled", "unhealthy"), r.text
    finally:
        os.kill(target["pid"], signal.SIGCONT)
    text += "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected
    deadline = time.monotonic() + 30
    while httpx.get(f"{server['base']}/small/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the small app did not turn healthy again"
        time.sleep(0.5)
