"""vLLM's offline ``LLM.chat``: conversations through the model's chat template (tools too), then ``generate``."""

import pytest

from runtime import LLM, SamplingParams

ENGINE = dict(dtype="float32", device="cpu", num_pages=128, page_size=4)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
TOOLS = [{"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}]


def template_ids(tokenizer, conversation, **kwargs):
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_is_generate_on_the_templated_conversations(near_bigram_target):
    llm = LLM(str(near_bigram_target), **ENGINE)
    one = [{"role": "system", "content": "brief"}, {"role": "user", "content": "hello"}]
    two = [{"role": "user", "content": "weather?"}]
    outs = llm.chat([one, two], GREEDY)
    want = llm.generate([template_ids(llm.tokenizer, one), template_ids(llm.tokenizer, two)], GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert [o.prompt_token_ids for o in outs] == [o.prompt_token_ids for o in want]
    assert llm.chat(one, GREEDY)[0].token_ids == outs[0].token_ids  # one conversation alone
    with_tools = llm.chat(two, GREEDY, tools=TOOLS)[0]
    assert with_tools.prompt_token_ids == template_ids(llm.tokenizer, two, tools=TOOLS) != outs[1].prompt_token_ids
    for bad in ([], [[]], ["hello"], [{"content": "no role"}]):
        with pytest.raises(ValueError, match="messages: one conversation"):
            llm.chat(bad, GREEDY)
    quiet = llm.chat(two, GREEDY, chat_template_kwargs={"enable_thinking": False})[0]  # a template variable
    with pytest.raises(ValueError, match=r"\['max_length', 'truncation'\] are not variables of this model's chat "
                       r"template; it reads \['enable_thinking'\]"):
        llm.chat(two, GREEDY, chat_template_kwargs={"truncation": True, "max_length": 1})
    assert quiet.prompt_token_ids == template_ids(llm.tokenizer, two, enable_thinking=False) != outs[1].prompt_token_ids
    started = one + [{"role": "assistant", "content": "The answer is"}]
    continued = llm.chat(started, GREEDY, add_generation_prompt=False, continue_final_message=True)[0]
    ids = llm.tokenizer.apply_chat_template(started, continue_final_message=True, tokenize=True)
    assert continued.prompt_token_ids == list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with pytest.raises(ValueError, match="messages: continue_final_message: .* needs add_generation_prompt false"):
        llm.chat(started, GREEDY, continue_final_message=True)


def test_generate_takes_vllms_prompt_dicts_and_shows_progress_when_asked(near_bigram_target, capsys):
    llm = LLM(str(near_bigram_target), **ENGINE)
    text, ids = "def f(", [5, 6, 7]
    want = [o.token_ids for o in llm.generate([text, ids], GREEDY)]
    got = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=True)
    assert [o.token_ids for o in got] == want
    assert "requests" in capsys.readouterr().err  # the bar, on stderr
    assert llm.generate({"prompt_token_ids": ids}, GREEDY)[0].token_ids == want[1]  # one dict alone
    llm.generate([ids], GREEDY)
    assert "requests" not in capsys.readouterr().err  # off unless asked
    for bad in ({"prompt": text, "prompt_token_ids": ids}, {"text": text}, {"prompt": 3}):
        with pytest.raises(ValueError, match="a prompt dict"):
            llm.generate([bad], GREEDY)
