"""Step regions (``runtime.kernels.profiling.region``): named in a torch.profiler trace, no-ops otherwise."""

import torch

from runtime import LLM, SamplingParams
from runtime.kernels.profiling import region


def test_a_step_names_its_regions_only_while_a_profiler_records(bigram_target):
    assert type(region("dspark.x")).__name__ == "nullcontext"
    llm = LLM(str(bigram_target), dtype="float32", device="cpu", num_pages=64, page_size=4)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert type(region("dspark.x")).__name__ == "record_function"
        llm.generate([[3, 4, 5]], params)
    names = {event.name for event in prof.events()}
    assert {"dspark.schedule", "dspark.execute", "dspark.forward", "dspark.verify", "dspark.commit"} <= names
