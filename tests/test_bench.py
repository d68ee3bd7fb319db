"""``dspark bench``'s model shapes load with random weights (load_format='dummy') and decode on the CPU."""

from cluster.bench import MODEL_SHAPES, write_shape
from configs import DSparkDecodingConfig
from runtime import LLM, SamplingParams


def test_a_shape_pair_loads_with_dummy_weights_and_decodes(tmp_path):
    target, drafter = write_shape(tmp_path, "tiny", draft_layers=1, block_size=3)
    assert not list(target.glob("*.safetensors"))  # config.json only
    spec = DSparkDecodingConfig(speculative_model=str(drafter), load_format="dummy")
    llm = LLM(str(target), speculative_config=spec, load_format="dummy", dtype="float32", device="cpu",
              num_pages=32, page_size=16)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    out = llm.generate([[5, 6, 7, 8]], params)[0]
    plain = LLM(str(target), load_format="dummy", dtype="float32", device="cpu", num_pages=32, page_size=16)
    assert out.token_ids == plain.generate([[5, 6, 7, 8]], params)[0].token_ids  # same seed, same weights
    assert len(out.token_ids) == 10 and llm.get_metrics()["num_drafts"] > 0
    assert set(MODEL_SHAPES) >= {"qwen3-8b", "tiny"}
