"""Piecewise CUDA graphs (``runtime.worker.piecewise``): the steps no whole-step graph serves (a prompt arriving while others
decode, so its chunk rides beside their decodes or verifies) replay per-layer graphs around eager attention and give
the tokens the same engine gives with those steps eager. head_dim 64, the trained pairs' (FlashInfer's kernels for it
are in the GPU host's JIT cache). Skipped without a GPU, flashinfer and triton."""

import pytest

from configs import DSparkDecodingConfig
from runtime import LLM, SamplingParams
from runtime.worker.graph_layout import bucket_of
from tests import builders

pytestmark = pytest.mark.gpu
pytest.importorskip("flashinfer")
pytest.importorskip("triton")

ENGINE = dict(dtype="bfloat16", num_pages=256, page_size=16, kernel_backend="flashinfer", max_num_seqs=8)
PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [100, 3], list(range(20, 51)), [7] * 12, [250, 251]]
LATE = [list(range(60, 100)), [33, 34, 35, 36, 37, 38], list(range(120, 143))]


@pytest.fixture(scope="module")
def narrow_head_target(checkpoints):
    """head_dim 64 (8 query heads, 4 key/value heads), 4 layers, in bf16."""
    return builders.save_target(checkpoints / "narrow-head-qwen3", "qwen3", seed=13, residual_scale=0.6,
                                hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4,
                                head_dim=64)


def arrivals(llm, max_tokens: int = 30) -> list[list[int]]:
    """PROMPTS decoding, then one LATE prompt arriving every third step (its prefill beside their decodes) -> each
    request's tokens, in submission order."""
    eng = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in PROMPTS]
    outputs, steps, late = {}, 0, list(LATE)
    while eng.has_unfinished() or late:
        for out in eng.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
        if late and steps % 3 == 0:
            ids.append(eng.add_request(late.pop(0), params))
    return [outputs[i] for i in ids]


@pytest.mark.parametrize("speculative", [False, True])
def test_mixed_steps_replay_piecewise_graphs_and_equal_eager_steps(narrow_head_target, make_drafter, speculative):
    spec = DSparkDecodingConfig(speculative_model=str(make_drafter(narrow_head_target, 4))) if speculative else None
    runs, infos = {}, {}
    for piecewise in (True, False):
        llm = LLM(str(narrow_head_target), speculative_config=spec, **{**ENGINE, "piecewise_cuda_graphs": piecewise})
        runs[piecewise] = arrivals(llm)
        infos[piecewise] = llm.rank_info()[0]
    pieces = infos[True]["piecewise_graphs"]
    assert infos[False]["piecewise_graphs"] is None and infos[True]["cuda_graphs"]
    assert pieces["pieces"] == 5 and pieces["token_buckets"][-1] == 2048  # 4 layers: 5 pieces
    assert pieces["replays"] > 0, "no step went through the piecewise graphs"
    print(f"piecewise graphs: {pieces}; whole-step graphs {infos[True]['graph_capture_mib']} MiB")
    # what they keep: one bucket's working set in their pool and the shared buffers (the warm-ups' blocks freed)
    assert pieces["capture_mib"] < 256, pieces
    assert runs[True] == runs[False]


def test_a_step_of_every_bucket_size_keeps_its_rows(narrow_head_target):
    """Prompts of lengths that land in different buckets (and one exactly at a bucket) prefill together through the
    piecewise graphs as they do eagerly: padding rows never reach a real one."""
    lengths = (16, 47, 64, 130)
    prompts = [[(7 * n + i) % 300 + 1 for i in range(n)] for n in lengths]  # (the vocabulary: 320)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for piecewise in (True, False):
        llm = LLM(str(narrow_head_target), **{**ENGINE, "piecewise_cuda_graphs": piecewise, "max_num_seqs": 4})
        outs[piecewise] = [o.token_ids for o in llm.generate(prompts, params)]
        if piecewise:
            info = llm.rank_info()[0]["piecewise_graphs"]
            assert info["replays"] > 0 and bucket_of(info["token_buckets"], sum(lengths)) == 320
    assert outs[True] == outs[False]
