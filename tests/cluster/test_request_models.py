"""The server's request models without a server: the model's default sampling parameters (``Engine.sampling_defaults``,
from its generation_config.json) fill the fields a request leaves unset; the fields it sets stay the client's."""

from cluster.serve import protocol

DEFAULTS = {"temperature": 0.0, "top_k": 3, "max_tokens": 5}


def test_unset_fields_take_the_models_defaults_and_set_ones_stay():
    unset = protocol.CompletionRequest(model="m", prompt="x").sampling_params(16, DEFAULTS)
    assert (unset.temperature, unset.top_k, unset.top_p, unset.max_tokens) == (0.0, 3, 1.0, 16)
    chosen = protocol.CompletionRequest(model="m", prompt="x", temperature=0.7, top_k=0).sampling_params(16, DEFAULTS)
    assert (chosen.temperature, chosen.top_k) == (0.7, 0)
    chat = protocol.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
    assert chat.sampling_params(chat.token_budget(5), DEFAULTS).temperature == 0.0
    assert protocol.CompletionRequest(model="m", prompt="x").sampling_params(16).temperature == 1.0  # none given
