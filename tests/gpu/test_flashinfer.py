"""The flashinfer kernel backend on CUDA: each op against the torch reference, and the engine's CUDA graphs
against its eager steps with the same kernels (token for token). Skipped without a GPU and flashinfer."""

import dataclasses
import random
import time

import pytest
import torch

from configs import DSparkDecodingConfig
from runtime import LLM, SamplingParams
from runtime.kernels import AttentionGeometry, HostLayout, PagedAttentionMeta, get_backend, torch_ref
from tests import builders

pytestmark = pytest.mark.gpu
pytest.importorskip("flashinfer")
pytest.importorskip("triton")

DEV = torch.device("cuda")
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def fi():
    return get_backend("flashinfer")


def close(got, want, tol=2e-2):
    assert torch.isfinite(got).all()
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < tol, f"relative error {err:.2e}"


def test_norms_and_activation(fi):
    x, res, w = (torch.randn(37, 4096, device=DEV, dtype=BF16) for _ in range(2)), None, None
    x, res = list(x)
    w = torch.randn(4096, device=DEV, dtype=BF16)
    close(fi.rms_norm(x, w, 1e-6), torch_ref.rms_norm(x, w, 1e-6))
    got, got_sum = fi.add_rms_norm(x, res, w, 1e-6)
    want, want_sum = torch_ref.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(got_sum, want_sum)
    close(got, want)
    gate_up = torch.randn(37, 2 * 3000, device=DEV, dtype=BF16)
    close(fi.silu_and_mul(gate_up), torch_ref.silu_and_mul(gate_up))


@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_on_strided_views(fi, norm):
    t, hq, hkv, d = 19, 8, 2, 128
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEV, dtype=BF16)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hkv, d)
    qw, kw = (torch.randn(d, device=DEV, dtype=BF16) if norm else None for _ in range(2))
    angles = torch.arange(t, device=DEV).float()[:, None] * torch.rand(d // 2, device=DEV)
    cos, sin = torch.cat([angles, angles], -1).cos().to(BF16), torch.cat([angles, angles], -1).sin().to(BF16)
    for got, want in zip(fi.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin),
                         torch_ref.qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)):
        assert got.is_contiguous()
        close(got, want)


def test_rope_and_cache_writes_the_rotated_keys(fi):
    t, hq, hkv, d, page = 11, 8, 2, 128, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEV, dtype=BF16)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    qw, kw = torch.randn(d, device=DEV, dtype=BF16), torch.randn(d, device=DEV, dtype=BF16)
    angles = torch.arange(t, device=DEV).float()[:, None] * torch.rand(d // 2, device=DEV)
    cos, sin = torch.cat([angles, angles], -1).cos().to(BF16), torch.cat([angles, angles], -1).sin().to(BF16)
    slots = torch.randperm(8 * page, device=DEV)[:t]
    caches = [[torch.randn(8, page, hkv, d, device=DEV, dtype=BF16) for _ in range(2)] for _ in range(2)]
    caches[1] = [c.clone() for c in caches[0]]
    got_q = fi.rope_and_cache(q, k, v, qw, kw, 1e-6, cos, sin, *caches[0], slots)
    want_q = torch_ref.rope_and_cache(q, k, v, qw, kw, 1e-6, cos, sin, *caches[1], slots)
    close(got_q, want_q)
    close(caches[0][0], caches[1][0], 1e-2)
    assert torch.equal(caches[0][1], caches[1][1])  # v is copied as is
    kv_only = [c.clone() for c in caches[0]]
    kv_only[0].zero_()
    fi.rope_and_cache_kv(k, v, kw, 1e-6, cos, sin, *kv_only, slots)  # a drafter's context append: no queries
    assert torch.equal(kv_only[0].view(-1, hkv, d)[slots], caches[0][0].view(-1, hkv, d)[slots])
    assert torch.equal(kv_only[1], caches[0][1])


def mixed_batch_attention(backend):
    """A prefill chunk, a decode row and an 8-token verify in one batch, pages scattered, GQA 32/8 -> (got, want)."""
    page, hq, hkv, d = 16, 32, 8, 128
    k_cache, v_cache = (torch.randn(64, page, hkv, d, device=DEV, dtype=BF16) for _ in range(2))
    qo_lens, kv_lens = [40, 1, 8], [40, 300, 77]
    pages = [[3, 9, 11], list(range(12, 31)), [40, 7, 50, 51, 60]]
    qsl = torch.tensor([0, 40, 41, 49], device=DEV)
    width = max(len(p) for p in pages)
    table = torch.tensor([p + [0] * (width - len(p)) for p in pages], device=DEV)
    meta = PagedAttentionMeta(query_start_loc=qsl, seq_lens=torch.tensor(kv_lens, device=DEV), page_table=table,
                              max_query_len=40, max_seq_len=300, causal=True, num_tokens=49, page_size=page,
                              host=HostLayout(qo_lens, kv_lens, pages))
    q = torch.randn(49, hq, d, device=DEV, dtype=BF16)
    got = backend.paged_attention(q, k_cache, v_cache, backend.plan_attention(meta), d ** -0.5)
    want = torch_ref.paged_attention(q, k_cache, v_cache, torch_ref.plan_attention(meta), d ** -0.5)
    return got, want


def test_paged_attention_matches_the_reference(fi):
    close(*mixed_batch_attention(fi))


def test_the_eager_wrapper_plans_in_and_out_of_inference_mode():
    """A backend whose eager wrapper an engine's forward made (inside inference mode: its buffers are inference
    tensors) plans again outside it: one run saw FlashInfer's plan refuse the in-place write, after the small-GEMM
    tests' engines had used the process's backend first."""
    from runtime.kernels.flashinfer_backend import FlashInferBackend

    backend = FlashInferBackend()
    with torch.inference_mode():
        close(*mixed_batch_attention(backend))
    close(*mixed_batch_attention(backend))


@pytest.mark.parametrize("q_len", [1, 8])
def test_the_graphs_decode_wrapper_matches_the_reference(fi, q_len):
    """The decode wrapper CUDA graphs replay (tensor cores, Q tokens per request, causal within the block), planned
    for a fixed batch of 4 and captured once, then replanned for other lengths: equal to the torch reference."""
    page, hq, hkv, d, batch = 16, 32, 8, 128, 4
    k_cache, v_cache = (torch.randn(96, page, hkv, d, device=DEV, dtype=BF16) for _ in range(2))
    wrapper = fi.graph_wrapper(torch.device(DEV), batch, 96, q_len)
    q = torch.randn(batch * q_len, hq, d, device=DEV, dtype=BF16)
    out = torch.empty_like(q)

    def meta_for(kv_lens: list[int]) -> PagedAttentionMeta:
        pages, start = [], 0
        for n in kv_lens:
            used = -(-n // page)
            pages.append(list(range(95 - start, 95 - start - used, -1)))  # scattered, descending ids
            start += used
        width = max(len(p) for p in pages)
        qsl = torch.arange(batch + 1, device=DEV) * q_len
        table = torch.tensor([p + [0] * (width - len(p)) for p in pages], device=DEV)
        return PagedAttentionMeta(query_start_loc=qsl, seq_lens=torch.tensor(kv_lens, device=DEV), page_table=table,
                                  max_query_len=q_len, max_seq_len=max(kv_lens), causal=True,
                                  num_tokens=batch * q_len, page_size=page,
                                  host=HostLayout([q_len] * batch, kv_lens, pages),
                                  geometry=AttentionGeometry(hq, hkv, d, BF16, d ** -0.5))

    first = fi.plan_attention(meta_for([q_len, 100, 333, 17 + q_len]), wrapper)
    fi.paged_attention(q, k_cache, v_cache, first, d ** -0.5)  # warm up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(fi.paged_attention(q, k_cache, v_cache, first, d ** -0.5))
    for kv_lens in ([q_len, 100, 333, 17 + q_len], [600, q_len + 15, 64, 129]):
        meta = meta_for(kv_lens)
        fi.plan_attention(meta, wrapper)
        graph.replay()
        close(out, torch_ref.paged_attention(q, k_cache, v_cache, torch_ref.plan_attention(meta), d ** -0.5))
    with pytest.raises(ValueError, match="tokens per request"):
        ragged = meta_for([q_len, 100, 333, 17 + q_len])
        fi.plan_attention(dataclasses.replace(ragged, host=HostLayout([q_len + 1] * batch, ragged.host.kv_lens,
                                                                      ragged.host.page_ids)), wrapper)


def test_a_graph_plan_made_while_the_device_runs_neither_waits_nor_races(fi):
    """Planning the next decode step while the GPU still runs this one (the autoregressive graphs' plan-ahead):
    the plan returns long before the device work ends (no stream drain from a pageable or blocking copy), and its
    copies run after the graph it replans, so the graph launched before the plan still reads the old plan."""
    page, hq, hkv, d, batch = 16, 32, 8, 128, 2
    k_cache, v_cache = (torch.randn(64, page, hkv, d, device=DEV, dtype=BF16) for _ in range(2))
    wrapper = fi.graph_wrapper(torch.device(DEV), batch, 64, 1)
    geometry = AttentionGeometry(hq, hkv, d, BF16, d ** -0.5)
    q, out = torch.randn(batch, hq, d, device=DEV, dtype=BF16), torch.empty(batch, hq, d, device=DEV, dtype=BF16)

    def meta_for(kv_lens):
        pages = [list(range(32 * i, 32 * i + -(-n // page))) for i, n in enumerate(kv_lens)]
        width = max(len(p) for p in pages)
        table = torch.tensor([p + [0] * (width - len(p)) for p in pages], device=DEV)
        return PagedAttentionMeta(query_start_loc=torch.arange(batch + 1, device=DEV),
                                  seq_lens=torch.tensor(kv_lens, device=DEV), page_table=table,
                                  max_query_len=1, max_seq_len=max(kv_lens), causal=True, num_tokens=batch,
                                  page_size=page, host=HostLayout([1] * batch, kv_lens, pages), geometry=geometry)

    now, upcoming = meta_for([100, 300]), meta_for([101, 301])
    planned = fi.plan_attention(now, wrapper)
    fi.paged_attention(q, k_cache, v_cache, planned, d ** -0.5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(fi.paged_attention(q, k_cache, v_cache, planned, d ** -0.5))
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device time ahead of the graph
    graph.replay()
    started = time.perf_counter()
    fi.plan_attention(upcoming, wrapper)
    took = time.perf_counter() - started
    torch.cuda.synchronize()
    assert took < 0.1, f"the plan waited {took:.3f} s for the device"
    close(out, torch_ref.paged_attention(q, k_cache, v_cache, torch_ref.plan_attention(now), d ** -0.5))
    graph.replay()
    close(out, torch_ref.paged_attention(q, k_cache, v_cache, torch_ref.plan_attention(upcoming), d ** -0.5))


@pytest.mark.parametrize("window", [None, 1, 40, 500])  # an embedded drafter's rolling window over its context
@pytest.mark.parametrize("head_dim,block", [(128, 7), (64, 4), (16, 3)])
def test_draft_block_attention_matches_the_reference(fi, head_dim, block, window):
    """Block queries over a paged context of device-side length plus the block's own keys (bidirectional)."""
    page, hq, hkv, batch = 16, 8, 2, 3
    k_cache, v_cache = (torch.randn(40, page, hkv, head_dim, device=DEV, dtype=BF16) for _ in range(2))
    ctx = torch.tensor([1, 37, 200], device=DEV)
    table = torch.stack([torch.randperm(40, device=DEV)[:13] for _ in range(batch)])
    meta = PagedAttentionMeta(query_start_loc=torch.arange(batch + 1, device=DEV) * block, seq_lens=ctx,
                              page_table=table, max_query_len=block, max_seq_len=200, causal=False,
                              num_tokens=batch * block, page_size=page, num_extra_keys=block, context_window=window)
    q = torch.randn(batch * block, hq, head_dim, device=DEV, dtype=BF16)
    xk, xv = (torch.randn(batch, block, hkv, head_dim, device=DEV, dtype=BF16) for _ in range(2))
    got = fi.paged_attention(q, k_cache, v_cache, fi.plan_attention(meta), head_dim ** -0.5, xk, xv)
    want = torch_ref.paged_attention(q, k_cache, v_cache, torch_ref.plan_attention(meta), head_dim ** -0.5, xk, xv)
    close(got, want)


def test_draft_block_attention_splits_long_contexts_per_request(fi):
    """Contexts past 2048 keys are split (a program per 2048 keys, merged by log-sum-exp), each request by its own
    length: the reference's values, and a request's rows the same alone as in its batch (bit for bit)."""
    page, hq, hkv, d, block, pages = 16, 32, 8, 128, 7, 400
    k_cache, v_cache = (torch.randn(pages * 3, page, hkv, d, device=DEV, dtype=BF16) for _ in range(2))
    ctx = torch.tensor([5000, 100, 2049, 6400], device=DEV)
    batch = ctx.numel()
    table = torch.stack([torch.randperm(pages * 3, device=DEV)[:pages] for _ in range(batch)])
    meta = PagedAttentionMeta(query_start_loc=torch.arange(batch + 1, device=DEV) * block, seq_lens=ctx,
                              page_table=table, max_query_len=block, max_seq_len=pages * page, causal=False,
                              num_tokens=batch * block, page_size=page, num_extra_keys=block)
    q = torch.randn(batch * block, hq, d, device=DEV, dtype=BF16)
    xk, xv = (torch.randn(batch, block, hkv, d, device=DEV, dtype=BF16) for _ in range(2))
    got = fi.paged_attention(q, k_cache, v_cache, fi.plan_attention(meta), d ** -0.5, xk, xv)
    close(got, torch_ref.paged_attention(q, k_cache, v_cache, torch_ref.plan_attention(meta), d ** -0.5, xk, xv))
    alone = dataclasses.replace(meta, query_start_loc=meta.query_start_loc[:2], seq_lens=ctx[:1],
                                page_table=table[:1], num_tokens=block)
    first = fi.paged_attention(q[:block], k_cache, v_cache, fi.plan_attention(alone), d ** -0.5, xk[:1], xv[:1])
    assert torch.equal(first, got[:block])


@pytest.fixture(scope="module")
def wide_target(checkpoints):
    """head_dim 128 (FlashInfer's kernels), 4 layers, in bf16."""
    return builders.save_target(checkpoints / "wide-qwen3", "qwen3", seed=11, residual_scale=0.6, hidden_size=512,
                                intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2, head_dim=128)


PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [100, 3], list(range(20, 51)), [7] * 12, [250, 251]]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
ENGINE = dict(dtype="bfloat16", num_pages=256, page_size=16, kernel_backend="flashinfer", max_num_seqs=8)


def generate(target, drafter=None, **kw):
    spec = DSparkDecodingConfig(speculative_model=str(drafter)) if drafter is not None else None
    llm = LLM(str(target), speculative_config=spec, **{**ENGINE, **kw})
    return llm, [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("speculative", [False, True])
def test_graphed_steps_equal_eager_steps(wide_target, make_drafter, speculative):
    drafter = make_drafter(wide_target, 4) if speculative else None
    graphed, tokens = generate(wide_target, drafter)
    info = graphed.rank_info()[0]
    assert info["kernel_backend"] == "flashinfer" and info["cuda_graphs"] and info["draft_graphs"] == speculative
    # most decode steps were planned (DSpark: while the drafter drafted), or launched, while the step before them
    # ran, and still equal eager; a DSpark engine allots pages a block ahead for it
    assert info["plans_made_ahead"] + info["steps_run_ahead"] > 0
    assert (info["plans_made_ahead"] > 0) if speculative else (info["steps_run_ahead"] > 0)
    assert graphed.engine.scheduler.lookahead == (5 if speculative else 1)
    eager, eager_tokens = generate(wide_target, drafter, enforce_eager=True)
    assert not eager.rank_info()[0]["cuda_graphs"]
    assert tokens == eager_tokens
    # padding rows never change a request: each prompt alone (bucket 1) decodes as in the batch of 5 (bucket 8)
    alone = [[o.token_ids for o in graphed.generate([p], GREEDY)][0] for p in PROMPTS]
    assert alone == tokens


def test_prompt_logprobs_of_graphed_and_piecewise_steps_equal_the_eager_steps(wide_target, make_drafter):
    """Prompt logprobs read from a prefill graph's or a piecewise graph's hidden states (short and long chunks,
    beside a drafter) equal the eager engine's (bf16: the same kernels, within rounding)."""
    spec = DSparkDecodingConfig(speculative_model=str(make_drafter(wide_target, 4)))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    prompts = PROMPTS + [[(7 * i) % 300 + 3 for i in range(400)]]  # a long chunk beside the short ones
    runs = {}
    for eager in (False, True):
        llm = LLM(str(wide_target), speculative_config=spec, **{**ENGINE, "enforce_eager": eager})
        runs[eager] = llm.generate(prompts, params)
        if not eager:
            assert llm.rank_info()[0]["graph_replays"] > 0
    for prompt, got, want in zip(prompts, runs[False], runs[True]):
        assert len(got.prompt_logprobs) == len(prompt) and got.prompt_logprobs[0] is None
        assert [e.token_id for e in got.prompt_logprobs[1:]] == prompt[1:]
        lp = torch.tensor([[e.logprob for e in x.prompt_logprobs[1:]] for x in (got, want)])
        assert torch.isfinite(lp).all() and (lp[0] - lp[1]).abs().max() < 0.1


@pytest.mark.parametrize("speculative", [False, True])
def test_biased_and_min_tokens_requests_leave_the_argmax_paths_and_equal_eager(wide_target, make_drafter,
                                                                               speculative):
    """logit_bias and min_tokens' banned stop tokens change the target's rows, so such requests skip the graphs'
    argmax verdicts (greedy decode, verify, packed) and verify from the logits: graphed equals eager, beside plain
    requests that keep the fast paths."""
    spec = DSparkDecodingConfig(speculative_model=str(make_drafter(wide_target, 4))) if speculative else None
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    first = [o.token_ids[0] for o in LLM(str(wide_target), speculative_config=spec, **ENGINE).generate(PROMPTS, plain)]
    params = [dataclasses.replace(plain, logit_bias={t: -100.0}) if i % 2 else
              dataclasses.replace(plain, min_tokens=12, stop_token_ids=(first[i],)) if i % 3 == 0 else plain
              for i, t in enumerate(first)]
    runs = {}
    for eager in (False, True):
        llm = LLM(str(wide_target), speculative_config=spec, **{**ENGINE, "enforce_eager": eager})
        runs[eager] = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert runs[False] == runs[True]
    for i, tokens in enumerate(runs[False]):
        if i % 2:
            assert first[i] not in tokens
        elif i % 3 == 0:
            assert len(tokens) >= 12 and first[i] not in tokens[:11]


def test_structured_outputs_in_graphed_engines_equal_eager(wide_target, make_drafter):
    """A grammar's masked rows (xgrammar, carried in .whl-fi) verify from the graphs' logits: graphed equals eager,
    beside plain requests that keep the argmax paths."""
    pytest.importorskip("xgrammar")
    import json

    from runtime import StructuredOutputs

    schema = {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    wanted = StructuredOutputs(json=json.dumps(schema))
    params = [SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=wanted) if i % 2 else
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True) for i in range(len(PROMPTS))]
    spec = DSparkDecodingConfig(speculative_model=str(make_drafter(wide_target, 4)))
    runs = {}
    for eager in (False, True):
        llm = LLM(str(wide_target), speculative_config=spec, **{**ENGINE, "enforce_eager": eager})
        runs[eager] = [(o.token_ids, o.finish_reason) for o in llm.generate(PROMPTS, params)]
    assert runs[False] == runs[True]


def test_a_broken_row_in_a_graphed_greedy_step_fails_that_request_alone(wide_target, tmp_path):
    """Plain greedy steps read back the one-token graph's verdicts (argmax, -1 for a broken row): one-token prompts
    are served by that graph from their first step, and the one whose embedding is NaN fails alone."""
    import shutil

    from safetensors.torch import load_file, save_file

    poisoned = tmp_path / "poisoned"
    shutil.copytree(wide_target, poisoned)
    weights = load_file(str(poisoned / "model.safetensors"))
    weights["model.embed_tokens.weight"][7] = float("nan")
    save_file(weights, str(poisoned / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(poisoned), **ENGINE)
    clean = [[5], [100], [250]]
    expected = [o.token_ids for o in llm.generate(clean, GREEDY)]
    outs = llm.generate([clean[0], [7], clean[1], clean[2]], GREEDY)
    assert outs[1].finish_reason == "error" and "non-finite" in outs[1].error and outs[1].token_ids == []
    assert [o.token_ids for o in (outs[0], outs[2], outs[3])] == expected
    assert llm.rank_info()[0]["graph_replays"] > 0
    assert [o.token_ids for o in llm.generate(clean, GREEDY)] == expected  # the scratch page was cleaned


def test_a_verify_graphs_verdicts_equal_eager_verification_faults_included(wide_target, make_drafter, tmp_path):
    """Greedy verify steps read the verify graph's own verification (``runtime.sampling.verify.block_verdicts``): with a
    token whose embedding is NaN in some prompts (so some anchors or drafts break their rows), the graphed engine's
    tokens and failed requests equal the eager engine's, which verifies with torch kernels after the forward."""
    import shutil

    from safetensors.torch import load_file, save_file

    poisoned = tmp_path / "poisoned"
    shutil.copytree(wide_target, poisoned)
    weights = load_file(str(poisoned / "model.safetensors"))
    weights["model.embed_tokens.weight"][7] = float("nan")
    save_file(weights, str(poisoned / "model.safetensors"), metadata={"format": "pt"})
    spec = DSparkDecodingConfig(speculative_model=str(make_drafter(wide_target, 4)))
    prompts = PROMPTS + [[5, 7], [33, 2]]
    runs = {}
    for eager in (False, True):
        llm = LLM(str(poisoned), speculative_config=spec, **{**ENGINE, "enforce_eager": eager})
        runs[eager] = [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, GREEDY)]
        if not eager:
            assert llm.rank_info()[0]["graph_replays"] > 0
    assert runs[False] == runs[True]
    assert any(reason == "error" for _, reason in runs[False]) and any(r != "error" for _, r in runs[False])


def test_ragged_steps_are_padded_into_graphs_and_exact(wide_target, make_drafter):
    """Blocks trimmed at max_tokens and short prefills replay a padded graph (the real rows decide), and give the
    eager steps' tokens."""
    drafter = make_drafter(wide_target, 4)
    spec = DSparkDecodingConfig(speculative_model=str(drafter))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 14, 23, 6, 31)]
    runs, ragged = {}, []
    for eager in (False, True):
        llm = LLM(str(wide_target), speculative_config=spec, **{**ENGINE, "enforce_eager": eager})
        if not eager:
            graphs = llm.engine.executor.worker.graphs
            replay = graphs.run

            def spy(reqs, q_len, append_context=False):
                if any(len(r.token_ids) < q_len for r in reqs):
                    ragged.append((q_len, [len(r.token_ids) for r in reqs]))
                return replay(reqs, q_len, append_context)

            graphs.run = spy
        runs[eager] = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert ragged, "no ragged step was graphed"
    assert runs[False] == runs[True]


def test_a_draft_len_schedule_is_graphed_and_exact(wide_target, make_drafter):
    """The schedule's shorter block (2 drafts above 2 requests) gets its own target and drafter graphs, and its
    graphed steps give the eager steps' tokens."""
    drafter = make_drafter(wide_target, 4)
    spec = DSparkDecodingConfig(speculative_model=str(drafter), draft_len_schedule={2: 4, 8: 2})
    runs = {}
    for eager in (False, True):
        llm = LLM(str(wide_target), speculative_config=spec, **{**ENGINE, "enforce_eager": eager})
        runs[eager] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        if not eager:
            worker = llm.engine.executor.worker
            assert {q for _, q in worker.graphs.graphs if q not in worker.graphs.prefill_q_lens} == {1, 3, 5}
            assert {k for _, k in worker.engine_part.channel.runner.graphs.graphs} == {2, 4}
            assert llm.get_metrics()["num_drafts"] > 0
    assert runs[False] == runs[True]


def test_logprobs_on_the_graphed_path(wide_target, make_drafter):
    """Logprobs read from graphed verify rows (bf16 logits) match the eager steps', and DSpark's match plain
    decoding's up to bf16 rounding of the batched verify."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    runs = {}
    for name, spec, eager in (("graphed", True, False), ("eager", True, True), ("plain", False, False)):
        drafter = DSparkDecodingConfig(speculative_model=str(make_drafter(wide_target, 4))) if spec else None
        llm = LLM(str(wide_target), speculative_config=drafter, **{**ENGINE, "enforce_eager": eager})
        runs[name] = llm.generate(PROMPTS, params)
    for graphed, eager in zip(runs["graphed"], runs["eager"]):
        assert graphed.token_ids == eager.token_ids and len(graphed.logprobs) == 16
        assert [e.logprob for e in graphed.logprobs] == pytest.approx([e.logprob for e in eager.logprobs], abs=1e-3)
    for spark, plain in zip(runs["graphed"], runs["plain"]):
        same = next((i for i, (a, b) in enumerate(zip(spark.token_ids, plain.token_ids)) if a != b), 16)
        assert [e.logprob for e in spark.logprobs[:same]] == pytest.approx(
            [e.logprob for e in plain.logprobs[:same]], abs=0.05)


def test_flashinfer_agrees_with_the_torch_kernels_in_bf16(wide_target):
    _, fast = generate(wide_target)
    _, ref = generate(wide_target, kernel_backend="torch")
    same_prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(fast, ref)]
    assert sum(same_prefix) >= 0.6 * sum(len(x) for x in ref), same_prefix  # bf16 near-ties may part


def test_flashinfer_refuses_float32(wide_target):
    from runtime.kernels import KernelBackendUnavailable

    with pytest.raises(KernelBackendUnavailable, match="bfloat16 or float16"):
        LLM(str(wide_target), **{**ENGINE, "dtype": "float32"})


@pytest.mark.parametrize("q_len", [1, 8])
def test_a_graph_wrappers_fast_replan_equals_flashinfers_own_plan(fi, q_len):
    """After its first plan, a graph's decode wrapper replans by calling FlashInfer's cached planner directly
    (``DecodeGraphWrapper._replan``): for every layout it leaves the same plan info and page-table buffers as
    FlashInfer's ``plan`` on a twin wrapper, and attention through it equals the torch reference."""
    page, hq, hkv, d, batch = 16, 32, 8, 128, 4
    geometry = AttentionGeometry(hq, hkv, d, BF16, d ** -0.5)
    k_cache, v_cache = (torch.randn(128, page, hkv, d, device=DEV, dtype=BF16) for _ in range(2))
    fast, twin = (fi.graph_wrapper(torch.device(DEV), batch, 128, q_len) for _ in range(2))
    q = torch.randn(batch * q_len, hq, d, device=DEV, dtype=BF16)
    rng = random.Random(q_len)
    for step in range(6):
        kv_lens = [rng.randint(q_len, 500) for _ in range(batch)]
        ids = rng.sample(range(128), sum(-(-n // page) for n in kv_lens))
        pages, at = [], 0
        for n in kv_lens:
            pages.append(ids[at:at + -(-n // page)])
            at += len(pages[-1])
        width = max(len(p) for p in pages)
        meta = PagedAttentionMeta(query_start_loc=torch.arange(batch + 1, device=DEV) * q_len,
                                  seq_lens=torch.tensor(kv_lens, device=DEV),
                                  page_table=torch.tensor([p + [0] * (width - len(p)) for p in pages], device=DEV),
                                  max_query_len=q_len, max_seq_len=max(kv_lens), causal=True,
                                  num_tokens=batch * q_len, page_size=page, host=HostLayout([q_len] * batch, kv_lens,
                                                                                            pages), geometry=geometry)
        planned = fi.plan_attention(meta, fast)
        twin.planned_geometry = None  # FlashInfer's own plan, every time
        fi.plan_attention(meta, twin)
        assert fast.fast_plans == step and twin.fast_plans == 0
        assert list(fast.inner._plan_info) == list(twin.inner._plan_info)
        for name in ("_paged_kv_indptr_buf", "_paged_kv_last_page_len_buf"):
            assert torch.equal(getattr(fast.inner, name), getattr(twin.inner, name)), name
        used = sum(len(p) for p in pages)
        assert torch.equal(fast.inner._paged_kv_indices_buf[:used], twin.inner._paged_kv_indices_buf[:used])
        close(fi.paged_attention(q, k_cache, v_cache, planned, d ** -0.5),
              torch_ref.paged_attention(q, k_cache, v_cache, torch_ref.plan_attention(meta), d ** -0.5))


def test_a_short_prefill_replays_a_graph_and_decodes_as_the_eager_one(wide_target):
    """A prompt chunk longer than any verify block (here 20 tokens, no drafter) replays a prefill graph (Q = 24 at
    batch 1) rather than running eagerly, and the request decodes as it does on the eager engine."""
    prompt = list(range(40, 60))
    graphed = LLM(str(wide_target), **ENGINE)
    info = graphed.rank_info()[0]
    assert 24 in info["graph_prefill_q_lens"] and info["graph_prefill_tokens"] > 0
    before = info["graph_replays"]
    first = graphed.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[0]
    assert graphed.rank_info()[0]["graph_replays"] == before + 1  # the prefill step itself
    tokens = graphed.generate([prompt], GREEDY)[0].token_ids
    eager = LLM(str(wide_target), **{**ENGINE, "enforce_eager": True})
    assert tokens == eager.generate([prompt], GREEDY)[0].token_ids and first.token_ids == tokens[:1]


def test_a_short_context_engine_captures_its_graphs_and_decodes_as_the_eager_one(wide_target):
    """max_model_len 48 with pages of 16: the prefill graphs stop at the first length holding a whole context, and
    every graph's page table holds a request padded past its own pages (a 30-token prompt replays the 32 graph)."""
    prompt = list(range(40, 70))
    graphed = LLM(str(wide_target), **{**ENGINE, "max_model_len": 48})
    assert graphed.rank_info()[0]["graph_prefill_q_lens"] == [16, 24, 32, 48]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eager = LLM(str(wide_target), **{**ENGINE, "max_model_len": 48, "enforce_eager": True})
    assert graphed.generate([prompt], params)[0].token_ids == eager.generate([prompt], params)[0].token_ids


def drive(llm, lengths: tuple[int, ...], late_at: int, late_tokens: int, abort_at: int) -> list[list[int]]:
    """Step ``llm``'s engine over PROMPTS (greedy, ``lengths`` tokens each), a late request of ``late_tokens``
    arriving after step ``late_at`` and the third prompt aborted after step ``abort_at`` -> each one's tokens."""
    eng = llm.engine
    ids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
           for p, n in zip(PROMPTS, lengths)]
    outputs, steps = {}, 0
    while eng.has_unfinished():
        for out in eng.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
        if steps == late_at:
            ids.append(eng.add_request([33, 34, 35, 36, 37, 38],
                                       SamplingParams(max_tokens=late_tokens, temperature=0.0, ignore_eos=True)))
        if steps == abort_at:
            eng.abort(ids[2])
    return [outputs[i] for i in ids]


def test_decode_steps_run_ahead_and_decode_as_eager_steps(wide_target):
    """Plain greedy decoding launches each steady step before the previous one is read back (pinned read-back,
    the tokens fed on the device): requests finishing at different lengths and one arriving mid-decode still
    decode exactly as on the eager engine; most steps were launched ahead. The engine foresees finishes and
    arrivals (they lag a step), so what drops a step launched ahead is the unforeseen: a request aborted mid-decode."""
    lengths = (9, 23, 40, 17, 31)

    def run(llm):
        return drive(llm, lengths, late_at=12, late_tokens=15, abort_at=20)

    graphed = LLM(str(wide_target), **{**ENGINE, "max_num_seqs": 8})
    tokens = run(graphed)
    info = graphed.rank_info()[0]
    assert info["steps_run_ahead"] > 20 and info["steps_ahead_dropped"] >= 1
    eager = LLM(str(wide_target), **{**ENGINE, "enforce_eager": True})
    assert tokens == run(eager) and 0 < len(tokens[2]) < lengths[2]


@pytest.mark.parametrize("num", [1, 17, 64])
def test_the_markov_step_kernel_matches_the_reference_up_to_bf16_ties(fi, num):
    """The fused greedy Markov step on the Qwen3-8B drafter's shape (V = 151936, rank 256, bf16): the reference's
    token, or where not, a column whose reference value ties the maximum within the bf16 rounding of the product."""
    torch.manual_seed(num)
    vocab, rank = 151936, 256
    base = torch.randn(num, 7, vocab, device=DEV)[:, 3]
    low_rank = torch.randn(num, rank, device=DEV, dtype=BF16)
    weight = torch.randn(vocab, rank, device=DEV, dtype=BF16) / 16
    got = fi.markov_argmax(base, low_rank, weight)
    want = torch_ref.markov_argmax(base, low_rank, weight)
    z = base + torch.nn.functional.linear(low_rank, weight).float()
    assert got.shape == (num,) and bool(((got >= 0) & (got < vocab)).all())
    gap = z.max(dim=-1).values - z.gather(1, got[:, None])[:, 0]
    assert bool((gap <= 2 * 2 ** -7 * z.abs().max()).all()), gap
    assert (got == want).float().mean().item() >= 0.9


def test_verify_steps_run_ahead_and_decode_as_eager_steps(wide_target, make_drafter):
    """DSpark greedy verify steps are launched while the drafter drafts the block they verify (its anchor and
    drafts fed on the device, this step read back through pinned memory first): requests finishing at different
    lengths, one arriving mid-decode and one aborted decode as on the eager engine; most verify steps were
    launched ahead, and the abort dropped the one launched for it."""
    spec = DSparkDecodingConfig(speculative_model=str(make_drafter(wide_target, 4)))
    lengths = (30, 44, 40, 35, 38)

    def run(llm):
        return drive(llm, lengths, late_at=6, late_tokens=25, abort_at=10)

    graphed = LLM(str(wide_target), speculative_config=spec, **ENGINE)
    tokens = run(graphed)
    info = graphed.rank_info()[0]
    assert info["steps_run_ahead"] > 5 and info["steps_ahead_dropped"] >= 1
    eager = LLM(str(wide_target), speculative_config=spec, **{**ENGINE, "enforce_eager": True})
    want = run(eager)
    assert [t for i, t in enumerate(tokens) if i != 2] == [t for i, t in enumerate(want) if i != 2]
    short, long = sorted((tokens[2], want[2]), key=len)  # aborted after as many steps: as many blocks accepted
    assert 0 < len(short) < lengths[2] and long[:len(short)] == short


def test_the_workers_rope_tables_give_the_rows_a_forward_would_compute(wide_target, make_drafter):
    """On a GPU the worker caches the target's and the colocated drafter's RoPE tables (``RotaryEmbedding.cache``,
    every position a page table can address): each forward gathers its rows, bit for bit the computed ones."""
    llm = LLM(str(wide_target), speculative_config=DSparkDecodingConfig(
        speculative_model=str(make_drafter(wide_target, 4))), **ENGINE)
    worker = llm.engine.executor.worker
    rows = worker.pages_per_seq * 16  # every position a page table can address (the last is the table's last row)
    positions = torch.tensor([0, 1, 15, 16, rows // 2, rows - 1], device=DEV)
    for model in (worker.target, worker.drafter):
        cos, sin = model.rotary._tables
        assert cos.shape[0] == rows and cos.dtype == BF16
        got, want = model.rotary(positions, BF16), model.rotary._compute(positions, BF16)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_separate_drafters_process_graphs_its_block_drafts(wide_target, make_drafter):
    """The worker of a separate drafter (``role="drafter"``, no process group needed for this) captures its block
    drafts as CUDA graphs (``Worker.drafter_uses_cuda_graphs``): over a context appended eagerly, as the draft server
    appends the states it receives, a graphed block of two requests equals the eager one."""
    from configs import LLMConfig
    from runtime.worker.worker import Worker, WorkerPlan

    config = LLMConfig(model=str(wide_target), speculative_config=DSparkDecodingConfig(
        speculative_model=str(make_drafter(wide_target, 4))), device="cuda", max_model_len=256, **ENGINE)
    worker = Worker(config, WorkerPlan(role="drafter", tp_rank=0, tp_size=1, drafter="separate"))
    worker.load()
    worker.allocate(64)
    runner = worker.draft_runner
    assert worker.drafter_uses_cuda_graphs and worker.info()["draft_graphs"] and runner.graphs.serves(2, 4)
    gen = torch.Generator(device="cuda").manual_seed(0)
    width = runner.drafter.fc.in_features  # the captured target layers' states, concatenated
    positions = torch.arange(5, device="cuda").repeat(2)  # two requests of five context tokens, pages 0 and 1
    slots = torch.cat([torch.arange(5, device="cuda"), 16 + torch.arange(5, device="cuda")])
    runner.append_context(torch.randn(10, width, generator=gen, device="cuda", dtype=torch.bfloat16), positions, slots)
    anchors = torch.tensor([7, 300], device="cuda")
    anchor_pos = torch.tensor([5, 5], device="cuda")
    table = torch.tensor([[0], [1]], device="cuda")
    graphed = runner.graphs.run(anchors, anchor_pos, table, 4)
    graphed_tokens, graphed_block = graphed.tokens.clone(), graphed.block.clone()
    eager = runner.draft_block(anchors, anchor_pos, table, 4)
    assert torch.equal(graphed_tokens, eager.tokens) and torch.equal(graphed_block, eager.block)
