"""Drafter training (DeepSpec recipe): blocks, a tiny CPU run that learns, resume, and the engine round trip."""

import json

import pytest
import torch

from configs import DSparkDecodingConfig
from configs.training import DrafterTrainConfig
from runtime.engine.llm import LLM
from runtime.training.blocks import attention_mask, block_inputs, block_labels, sample_anchors
from runtime.training.distill import evaluate
from runtime.training.drafter_trainer import default_layer_ids, train_drafter
from runtime.training.forward import greedy_block, teacher_forced_logits
from tests.runtime.conftest import TRAINING_ENGINE

ENGINE = TRAINING_ENGINE


def test_anchors_only_where_anchor_and_next_token_are_supervised():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1], [1, 1, 0, 0, 0, 0, 0, 0]])
    for seed in range(5):
        anchors, keep = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(seed))
        assert sorted(anchors[0][keep[0]].tolist()) == [2, 3, 6] and keep[0].sum() == 3
        assert anchors[1][keep[1]].tolist() == [0]
        assert (anchors[0][keep[0]].diff() > 0).all()


def test_block_inputs_labels_and_mask():
    ids = torch.arange(10, 20)[None]
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 1, 1, 1]])
    anchors, keep = torch.tensor([[1, 4, 8]]), torch.tensor([[True, True, True]])
    block_ids, positions = block_inputs(ids, anchors, keep, 3, mask_token_id=99)
    assert block_ids.tolist() == [[11, 99, 99, 14, 99, 99, 18, 99, 99]]
    assert positions.tolist() == [[1, 2, 3, 4, 5, 6, 8, 9, 10]]
    labels, target_index, mask = block_labels(ids, loss_mask, anchors, keep, 3)
    assert labels[0, 0].tolist() == [12, 13, 14] and target_index[0, 0].tolist() == [1, 2, 3]
    assert mask.tolist() == [[[True, True, True], [True, False, False], [True, False, False]]]  # 6 unsupervised,
    # then past the end of the sequence
    allowed = attention_mask(anchors, keep, 10, 3)[0, 0]  # [9, 19]
    assert allowed[0, :10].tolist() == [True] + [False] * 9  # block 0 (anchor 1) sees context 0 only
    assert allowed[3, :10].tolist() == [True] * 4 + [False] * 6  # block 1 (anchor 4) sees 0..3
    assert allowed[4, 10:].tolist() == [False, False, False, True, True, True, False, False, False]


def test_tokenize_keeps_row_order_and_supervises_only_answers(qwen3_target):
    from transformers import AutoTokenizer

    from runtime.training.data import tokenize

    tok = AutoTokenizer.from_pretrained(str(qwen3_target))
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows = [{"text": "def f(x):\n    return x"}, {"prompt_ids": [5, 6], "response_ids": [7, 8, 9]},
            {"prompt": "import os", "response": "\nprint(os.sep)", "finished": True}, {"text": "x = [1, 2]"}]
    examples = tokenize(rows, tok, max_len=64, eos_token_id=2)
    assert [e.token_ids for e in examples] == [enc(rows[0]["text"]), [5, 6, 7, 8, 9],
                                              enc("import os") + enc("\nprint(os.sep)") + [2], enc(rows[3]["text"])]
    assert examples[1].loss_mask == [0, 0, 1, 1, 1]
    assert examples[2].loss_mask == [0] * len(enc("import os")) + [1] * (len(enc("\nprint(os.sep)")) + 1)
    assert set(examples[0].loss_mask) == {1}


def test_batches_pad_each_example_and_visit_every_example_once_per_epoch():
    from runtime.training.data import Example, batches

    examples = [Example(list(range(10 * i, 10 * i + 2 + i)), [i % 2] * (2 + i)) for i in range(6)]
    stream = batches(examples, batch_size=3, seed=0, pad_id=99)
    seen = []
    for _ in range(2):  # one epoch: 6 examples in batches of 3
        ids, loss, attn, rows = next(stream)
        assert ids.dtype == loss.dtype == attn.dtype == torch.long
        assert [examples[i].token_ids[0] for i in rows.tolist()] == ids[:, 0].tolist()
        assert ids.shape[1] == int(attn.sum(1).max())  # as wide as the longest example of the batch
        for row_ids, row_loss, row_attn in zip(ids.tolist(), loss.tolist(), attn.tolist()):
            example = examples[row_ids[0] // 10]
            n = len(example.token_ids)
            assert row_ids == example.token_ids + [99] * (len(row_ids) - n)
            assert row_loss == example.loss_mask + [0] * (len(row_ids) - n)
            assert row_attn == [1] * n + [0] * (len(row_ids) - n)
            seen.append(row_ids[0] // 10)
    assert sorted(seen) == list(range(6))


def test_default_layer_ids_never_take_the_last_layer():
    assert default_layer_ids(36) == [0, 8, 17, 26, 34]
    assert default_layer_ids(4) == [0, 1, 2]
    assert default_layer_ids(2) == [0]


def config(target, data, out, **kw):
    return DrafterTrainConfig(target=str(target), data=str(data), out=str(out), block_size=3, markov_rank=16,
                              batch_size=8, max_len=48, num_anchors=12, lr=3e-3, log_every=10, save_every=1000,
                              mask_token_id=319, **kw)


@pytest.mark.slow
def test_training_lowers_the_loss_and_raises_acceptance(near_bigram_target, distilled, tmp_path):
    prompts = torch.randint(3, 300, (16, 8), generator=torch.Generator().manual_seed(1)).tolist()
    untrained = train_drafter(config(near_bigram_target, distilled, tmp_path / "untrained", steps=1), progress=False)
    trained = train_drafter(config(near_bigram_target, distilled, tmp_path / "trained", steps=150), progress=False)
    assert trained["loss"] < 0.7 * untrained["loss"] and trained["accept_len"] > untrained["accept_len"]
    before = evaluate(str(near_bigram_target), str(tmp_path / "untrained"), prompts, 3, 0.0, 24, **ENGINE)
    after = evaluate(str(near_bigram_target), str(tmp_path / "trained"), prompts, 3, 0.0, 24, check_parity=True,
                     **ENGINE)
    assert after["mean_acceptance_length"] > before["mean_acceptance_length"] + 0.5
    assert after["greedy_equals_plain"]  # the written checkpoint round-trips through the engine


def test_bfloat16_autocast_and_target_train_and_keep_float32_weights(near_bigram_target, distilled, tmp_path):
    from safetensors.torch import load_file

    bf16 = dict(autocast="bfloat16", target_dtype="bfloat16")
    first = train_drafter(config(near_bigram_target, distilled, tmp_path / "a", steps=1, **bf16), progress=False)
    later = train_drafter(config(near_bigram_target, distilled, tmp_path / "b", steps=60, **bf16), progress=False)
    assert later["loss"] < 0.8 * first["loss"]
    assert {t.dtype for t in load_file(str(tmp_path / "b" / "model.safetensors")).values()} == {torch.float32}


def test_a_drafter_run_its_time_budget_ends_has_annealed_and_a_rerun_adds_nothing(near_bigram_target, distilled,
                                                                                      tmp_path):
    out = tmp_path / "budget"
    first = train_drafter(config(near_bigram_target, distilled, out, steps=10**6, time_budget_s=2.0), progress=False)
    # the budget stopped it (a loaded 2-core host runs a few steps in 2 s; an idle one dozens)
    assert 1 <= first["step"] < 10**6 and first["finished"]
    assert first["last_lr"] < 0.02 * 3e-3  # the last steps ran at the end of the cosine, not at the peak
    assert torch.load(out / "trainer_state.pt", weights_only=True)["seconds"] >= 2.0
    again = train_drafter(config(near_bigram_target, distilled, out, steps=10**6, time_budget_s=2.0), progress=False)
    assert again["step"] == first["step"] and again["finished"]  # the budget counts over resumed runs


def test_a_drafter_initialized_from_a_trained_one_starts_where_it_ended(near_bigram_target, distilled, tmp_path):
    from safetensors.torch import load_file, save_file

    trained = train_drafter(config(near_bigram_target, distilled, tmp_path / "a", steps=40), progress=False)
    bf16 = tmp_path / "a-bf16"  # a shipped drafter is bfloat16; training goes on in float32
    bf16.mkdir()
    (bf16 / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(tmp_path / "a" / "model.safetensors")).items()},
              str(bf16 / "model.safetensors"))
    fresh = train_drafter(config(near_bigram_target, distilled, tmp_path / "b", steps=1, seed=1), progress=False)
    warm = train_drafter(config(near_bigram_target, distilled, tmp_path / "c", steps=1, seed=1, init_from=str(bf16)),
                         progress=False)
    assert warm["loss"] < 0.8 * fresh["loss"] and warm["loss"] < 1.2 * trained["loss"]
    with pytest.raises(ValueError, match=r"init_from: .* different \['markov_rank'\]"):
        train_drafter(config(near_bigram_target, distilled, tmp_path / "d", steps=1, init_from=str(bf16))
                      .model_copy(update={"markov_rank": 8}), progress=False)
    with pytest.raises(ValueError, match="init_from: .* holds no drafter"):
        train_drafter(config(near_bigram_target, distilled, tmp_path / "e", steps=1, init_from=str(tmp_path)),
                      progress=False)


def test_autocast_names_its_allowed_values(tmp_path):
    with pytest.raises(ValueError, match="autocast"):
        DrafterTrainConfig(target="t", data="d", out="o", autocast="float8")
    from runtime.training.precision import autocast

    with pytest.raises(ValueError, match="off, bfloat16"):
        autocast("float8", torch.device("cpu"))


@pytest.mark.slow
def test_resume_continues_from_the_saved_step(near_bigram_target, distilled, tmp_path):
    out = tmp_path / "run"
    first = train_drafter(config(near_bigram_target, distilled, out, steps=12), progress=False)
    weights = (out / "model.safetensors").read_bytes()
    second = train_drafter(config(near_bigram_target, distilled, out, steps=20), progress=False)
    assert (first["step"], second["step"]) == (12, 20)
    assert torch.load(out / "trainer_state.pt", weights_only=True)["step"] == 20
    assert (out / "model.safetensors").read_bytes() != weights
    with pytest.raises(ValueError, match="different"):
        train_drafter(config(near_bigram_target, distilled, out, steps=30).model_copy(update={"markov_rank": 8}),
                      progress=False)


@pytest.mark.parametrize("head_type,markov_rank", [("vanilla", 16), ("rnn", 16), ("vanilla", 0)])
def test_serving_drafter_proposes_the_training_forwards_block(qwen3_target, make_drafter, monkeypatch, head_type,
                                                              markov_rank):
    """What the trainer optimizes is what the engine drafts: for every block the engine drafted while decoding
    greedily, the training forward (dense masked attention over the whole sequence, anchor = the engine's anchor)
    gives the same block states and the same greedy chain of draft tokens."""
    from transformers import AutoModelForCausalLM

    import runtime.worker.draft_runner
    from configs import DSparkDecodingConfig
    from runtime.kernels import get_backend
    from runtime.models.loader import load_drafter
    from runtime.sampling.sampling_params import SamplingParams
    from runtime.training.forward import block_hidden

    block = 4
    drafter_dir = make_drafter(qwen3_target, block, head_type=head_type, markov_rank=markov_rank, seed=3)
    spec = DSparkDecodingConfig(speculative_model=str(drafter_dir), max_draft_len=block)
    prompt = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    drafted = []  # (anchor position, drafted tokens [K], block states [K, d]) of each engine draft
    serving_draft = runtime.worker.draft_runner.DraftRunner.draft

    def recording_draft(self, entries, committed, accepted, page_table, k_next):
        out = serving_draft(self, entries, committed, accepted, page_table, k_next)
        anchor_pos = entries[0].end_position - entries[0].num_drafts + int(accepted[0])
        drafted.append((anchor_pos, out.tokens[0].tolist(), out.hidden[0].clone()))
        return out

    monkeypatch.setattr(runtime.worker.draft_runner.DraftRunner, "draft", recording_draft)
    llm = LLM(str(qwen3_target), speculative_config=spec, **ENGINE)
    sequence = prompt + llm.generate([prompt], [SamplingParams(max_tokens=24, temperature=0.0)])[0].token_ids
    assert len(drafted) >= 3

    hf = AutoModelForCausalLM.from_pretrained(str(qwen3_target), dtype=torch.float32).eval()
    drafter = load_drafter(spec, hf.config, get_backend("torch"), torch.float32, torch.device("cpu"))
    ids = torch.tensor([sequence])  # [1, L]
    length = ids.shape[1]
    with torch.no_grad():
        hidden_states = hf(input_ids=ids, output_hidden_states=True).hidden_states
        captured = torch.cat([hidden_states[i + 1] for i in drafter.spec.target_layer_ids], dim=-1)
        for anchor_pos, engine_tokens, engine_hidden in drafted:
            if anchor_pos >= length:
                continue
            anchors, keep = torch.tensor([[anchor_pos]]), torch.tensor([[True]])
            block_ids, block_pos = block_inputs(ids, anchors, keep, block, drafter.spec.mask_token_id)
            block_ids[:, 0] = ids[0, anchor_pos]
            hidden = block_hidden(drafter, hf.get_input_embeddings()(block_ids), block_pos, captured,
                                  attention_mask(anchors, keep, length, block))[0]  # [K, d]
            torch.testing.assert_close(hidden, engine_hidden, atol=1e-4, rtol=1e-4)
            tokens = greedy_block(drafter, hf.lm_head, hidden, ids[0, anchor_pos:anchor_pos + 1])
            assert tokens == engine_tokens, f"anchor {anchor_pos}"


@pytest.mark.parametrize("head_type", ["vanilla", "rnn"])
def test_teacher_forced_logits_are_each_positions_markov_correction_with_the_true_previous_token(head_type):
    """z_k = U_k + W2 low_rank(x_{k-1}), the recurrence unrolled over the block with the true previous tokens: the
    trainer's batched form (W2 and the sum once over the block) gives the position-by-position values and gradients."""
    from types import SimpleNamespace

    from runtime.models.heads import MarkovHead

    torch.manual_seed(0)
    n, a, block, vocab, d = 2, 3, 4, 50, 8
    head = MarkovHead(head_type, vocab, 5, d)
    base = torch.randn(n, a, block, vocab, requires_grad=True)
    hidden = torch.randn(n, a, block, d, requires_grad=True)
    prev = torch.randint(0, vocab, (n, a, block))
    batched = teacher_forced_logits(SimpleNamespace(markov_head=head), base, prev, hidden)
    state, rows = head.initial_state(n * a, hidden), []
    for k in range(block):
        low, state = head.low_rank(prev[:, :, k].reshape(-1), hidden[:, :, k].reshape(n * a, -1), state)
        rows.append(base[:, :, k] + head.markov_w2(low).view(n, a, -1))
    reference = torch.stack(rows, dim=2)
    torch.testing.assert_close(batched, reference)
    weights = torch.randn(n, a, block, vocab)
    grads = torch.autograd.grad((batched * weights).sum(), [base, hidden, head.markov_w2.weight], allow_unused=True)
    expected = torch.autograd.grad((reference * weights).sum(), [base, hidden, head.markov_w2.weight],
                                   allow_unused=True)
    for got, want in zip(grads, expected):
        assert (got is None) == (want is None) and (got is None or torch.allclose(got, want, atol=1e-5))


@pytest.mark.parametrize("ce_weight,l1_weight", [(0.1, 0.9), (1.0, 0.0), (0.0, 1.0)])
def test_the_chunked_cross_entropy_and_l1_are_autograds_to_the_last_bit(monkeypatch, ce_weight, l1_weight):
    """The loss's cross-entropy and L1 between the softmaxes, a chunk of rows at a time (5 here: the last chunk
    short) with the softmaxes recomputed in the backward, give autograd's values and gradients through
    ``F.cross_entropy``, ``softmax`` and ``abs``."""
    import runtime.training.loss as loss_module

    vocab = 30
    monkeypatch.setattr(loss_module, "CHUNK_BYTES", 5 * 4 * vocab)
    torch.manual_seed(1)
    draft = (3 * torch.randn(2, 3, 4, vocab)).requires_grad_(True)
    target, labels = 3 * torch.randn(2, 3, 4, vocab), torch.randint(0, vocab, (2, 3, 4))
    weights = torch.rand(2, 3, 4)
    ce, l1 = loss_module.cross_entropy_and_l1(draft, target, labels)
    reference_ce = torch.nn.functional.cross_entropy(draft.flatten(0, 2), labels.flatten(), reduction="none")
    reference_l1 = (draft.softmax(-1) - target.softmax(-1)).abs().sum(-1)
    torch.testing.assert_close(ce, reference_ce.view_as(ce))
    torch.testing.assert_close(l1, reference_l1)
    got = torch.autograd.grad(((ce_weight * ce + l1_weight * l1) * weights).sum(), draft)[0]
    want = torch.autograd.grad(((ce_weight * reference_ce.view_as(ce) + l1_weight * reference_l1) * weights).sum(),
                               draft)[0]
    torch.testing.assert_close(got, want)


def test_an_l1_weighed_zero_is_a_statistic_with_the_cross_entropys_gradient():
    """The DFlash-style baseline (cross-entropy only): the loss and its gradient are the weighted cross-entropy's, and
    the L1 is still reported, computed without a backward."""
    from runtime.training.loss import LossWeights, dspark_loss

    torch.manual_seed(0)
    draft = torch.randn(2, 3, 4, 30, requires_grad=True)
    target, labels = torch.randn(2, 3, 4, 30), torch.randint(0, 30, (2, 3, 4))
    mask = torch.rand(2, 3, 4) > 0.3
    loss, stats = dspark_loss(draft, target, labels, mask, None, LossWeights(ce=1.0, l1=0.0, confidence=0.0))
    (grad,) = torch.autograd.grad(loss, draft)
    w = torch.exp(-torch.arange(4.0) / 4.0) * mask
    ce = torch.nn.functional.cross_entropy(draft.flatten(0, 2), labels.flatten(), reduction="none").view_as(w)
    reference = (ce * w).sum() / w.sum()
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(grad, torch.autograd.grad(reference, draft)[0])
    l1 = (draft.softmax(-1) - target.softmax(-1)).abs().sum(-1)
    torch.testing.assert_close(stats["l1"], ((l1 * w).sum() / w.sum()).detach())


def test_target_lr_warms_up_then_anneals_to_zero_by_its_steps_or_its_time_limit():
    from runtime.training.target_trainer import lr_factor

    assert lr_factor(0, 100) == pytest.approx(0.2)  # warmup: 5 steps of 100
    assert lr_factor(4, 100) == pytest.approx(1.0, abs=0.01)
    assert lr_factor(50, 100) == pytest.approx(0.5)
    assert lr_factor(99, 100) < 0.001
    # a run its time limit stops: progress follows the clock when the clock is ahead of the steps
    assert lr_factor(10, 10**6, time_fraction=0.5) == pytest.approx(0.5)
    assert lr_factor(10, 10**6, time_fraction=1.0) == 0.0


def test_a_target_run_stopped_by_its_time_limit_has_annealed_its_learning_rate(tmp_path):
    from configs.training import TargetTrainConfig
    from runtime.training.target_trainer import train_target

    cfg = TargetTrainConfig(out=str(tmp_path / "target"), vocab_size=300, hidden_size=32, num_layers=2, num_heads=2,
                            num_kv_heads=1, max_len=32, max_corpus_bytes=100_000, batch_size=4, steps=10**6,
                            max_seconds=2.0, lr=1e-2, device="cpu")
    stats = train_target(cfg, progress=False)
    # the clock stopped it (a loaded 2-core host ran 9 steps in the 2 s; an idle one a few hundred)
    assert 1 < stats["steps"] < 10**6
    assert stats["last_lr"] < 0.02 * cfg.lr  # the last steps ran at the end of the cosine, not at the peak


def test_calibration_fits_a_temperature_per_position_that_lowers_the_error():
    """Synthetic verifications: the head says 0.9 at every position where the truth is 0.6: the fit cools it."""
    from runtime.training.calibration import expected_calibration_error, fit_temperatures

    g = torch.Generator().manual_seed(0)
    verifications = []
    for _ in range(4000):
        survive = torch.rand(3, generator=g) < 0.6
        accepted = int(torch.cumprod(survive.int(), 0).sum())
        verifications.append(([0.9, 0.9, 0.9], accepted))
    fit = fit_temperatures(verifications, 3)
    assert all(t > 1.5 for t in fit["temperatures"])  # sigmoid(logit(.9) / T) ~ .6 needs T ~ 5
    assert all(a < 0.5 * b for a, b in zip(fit["ece_after"], fit["ece_before"]))
    assert expected_calibration_error(torch.tensor([0.25, 0.75], dtype=torch.float64),
                                      torch.tensor([0.0, 1.0], dtype=torch.float64)) == pytest.approx(0.25)


@pytest.mark.slow
def test_train_drafter_calibrates_on_held_out_prompts(near_bigram_target, distilled, tmp_path):
    held = tmp_path / "held.jsonl"
    rows = torch.randint(3, 300, (8, 8), generator=torch.Generator().manual_seed(5)).tolist()
    held.write_text("".join(json.dumps({"prompt_ids": r}) + "\n" for r in rows))
    out = tmp_path / "calibrated"
    stats = train_drafter(config(near_bigram_target, distilled, out, steps=40, calibration_data=str(held),
                                 calibration_prompts=8, calibration_tokens=16), progress=False)
    temperatures = json.loads((out / "config.json").read_text())["confidence_temperatures"]
    assert temperatures == stats["calibration"]["temperatures"] and len(temperatures) == 3
    assert stats["calibration"]["verifications"] > 0
    spec = DSparkDecodingConfig(speculative_model=str(out), enable_confidence_scheduling=True)
    llm = LLM(str(near_bigram_target), speculative_config=spec, **ENGINE)  # the scheduler reads them
    assert llm.engine.confidence.temperatures.tolist() == pytest.approx(temperatures)


def test_cached_target_states_train_as_the_live_target_does(near_bigram_target, distilled, tmp_path):
    """One pass of the target fills the cache; a run reading it matches a run with the target live (to bfloat16
    rounding of the cached states), and a cache of other examples is rebuilt rather than misread."""
    import json

    cache = tmp_path / "states"
    live = train_drafter(config(near_bigram_target, distilled, tmp_path / "live", steps=8), progress=False)
    cached = train_drafter(config(near_bigram_target, distilled, tmp_path / "cached", steps=8,
                                  target_cache=str(cache)), progress=False)
    assert (cache / "index.json").is_file() and (cache / "captured.npy").is_file()
    assert cached["loss"] == pytest.approx(live["loss"], rel=0.03)
    key = json.loads((cache / "index.json").read_text())["key"]
    fewer = tmp_path / "fewer.jsonl"
    fewer.write_text("\n".join(distilled.read_text().splitlines()[:40]) + "\n")
    train_drafter(config(near_bigram_target, fewer, tmp_path / "other", steps=2, target_cache=str(cache)),
                  progress=False)
    assert json.loads((cache / "index.json").read_text())["key"] != key


def test_self_distillation_answers_each_prompt_once_per_sampling(near_bigram_target, tmp_path):
    import json

    from runtime.training.prompt_sets import read_turns, template_math_problems
    from runtime.training.self_distill import Sampling, answer_prompts

    turns = tmp_path / "turns.jsonl"
    turns.write_text('{"turns": ["def add(a, b):"]}\n{"turns": ["for i in range(10):", "and again"]}\n')
    assert read_turns(turns) == [["def add(a, b):"], ["for i in range(10):", "and again"]]
    (tmp_path / "bad.jsonl").write_text('{"turns": []}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: each row needs 'turns'"):
        read_turns(tmp_path / "bad.jsonl")
    problems = template_math_problems(5, seed=1)
    assert len(problems) == 5 and problems == template_math_problems(5, seed=1) and "{" not in "".join(problems)
    llm = LLM(str(near_bigram_target), **ENGINE)
    rows = [{"source": "s", "messages": [{"role": "user", "content": t[0]}]} for t in read_turns(turns)]
    rows.append({"source": "long", "messages": [{"role": "user", "content": "print(1) " * 200}]})
    counts = answer_prompts(llm, rows, [Sampling(0.0), Sampling(0.8, 0.9)], max_tokens=6, max_prompt_tokens=64,
                            out=tmp_path / "answers.jsonl", seed=3)
    assert counts["rows"] == 4 and counts["prompts"] == 2 and counts["skipped_long_prompts"] == 1
    written = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert [r["temperature"] for r in written] == [0.0, 0.0, 0.8, 0.8]
    assert written[0]["prompt_ids"] == written[2]["prompt_ids"] and all(len(r["response_ids"]) <= 6 for r in written)


def test_states_held_in_memory_train_as_the_folder_cache_does(near_bigram_target, distilled, tmp_path):
    """The target's states held in the device's memory (one pass of the target) give the same steps as the folder
    cache, which holds the same bfloat16 states; asking for both caches is an error naming them."""
    cached = train_drafter(config(near_bigram_target, distilled, tmp_path / "cached", steps=6,
                                  target_cache=str(tmp_path / "states")), progress=False)
    held = train_drafter(config(near_bigram_target, distilled, tmp_path / "held", steps=6,
                                target_cache_in_memory=True), progress=False)
    assert held["loss"] == pytest.approx(cached["loss"], rel=1e-5)
    with pytest.raises(ValueError, match="target_cache and target_cache_in_memory"):
        config(near_bigram_target, distilled, tmp_path / "both", steps=1, target_cache=str(tmp_path / "states"),
               target_cache_in_memory=True)


def test_held_states_are_the_examples_own_padded_with_zeros(near_bigram_target):
    """``DeviceTarget`` gathers each example's states from one flat buffer: a batch of examples of other lengths, in
    any order, reads what the target computed for each alone (to bfloat16), and zeros past each one's end."""
    from transformers import AutoModelForCausalLM

    from runtime.training.data import Example
    from runtime.training.target_states import DeviceTarget, LiveTarget

    target = AutoModelForCausalLM.from_pretrained(near_bigram_target).eval()
    live = LiveTarget(target, [0, 1])
    g = torch.Generator().manual_seed(0)
    examples = [Example(torch.randint(3, 200, (n,), generator=g).tolist(), [1] * n) for n in (5, 9, 3)]
    held = DeviceTarget(live, examples, batch_tokens=12, progress=False)
    rows = torch.tensor([2, 0, 1])
    ids = torch.zeros(3, 9, dtype=torch.long)
    captured, final = held(ids, torch.ones_like(ids), rows)
    assert captured.shape == (3, 9, 2 * target.config.hidden_size) and captured.dtype == torch.bfloat16
    for r, i in enumerate(rows.tolist()):
        n = len(examples[i].token_ids)
        alone = torch.tensor([examples[i].token_ids])
        want_captured, want_final = live(alone, torch.ones_like(alone), torch.tensor([i]))
        torch.testing.assert_close(captured[r, :n].float(), want_captured[0].to(torch.bfloat16).float())
        torch.testing.assert_close(final[r, :n].float(), want_final[0].to(torch.bfloat16).float())
        assert not captured[r, n:].any() and not final[r, n:].any()


def test_the_target_writes_every_kinds_prompts_in_one_call(near_bigram_target):
    """``write_prompts``: one generate call for all kinds, each kind's i-th request seeded ``seed + i``; an unfinished
    or unusable text is dropped and a repeat within a kind kept once (the same text in two kinds stays in both)."""
    from types import SimpleNamespace

    from runtime.training.self_distill import write_prompts

    tokenizer = LLM(str(near_bigram_target), **ENGINE).tokenizer
    calls = []

    def generate(prompts, params):
        calls.append([p.seed for p in params])
        repeat = "A prompt that repeats."
        texts = {100: "short", 101: repeat, 102: repeat, 200: repeat}
        return [SimpleNamespace(text=texts.get(p.seed, f"Prompt written at seed {p.seed}."),
                                finish_reason="length" if p.seed == 103 else "stop") for p in params]

    llm = SimpleNamespace(tokenizer=tokenizer, generate=generate)
    written = write_prompts(llm, {"math": (5, 100), "code": (2, 200)})
    assert calls == [[100, 101, 102, 103, 104, 200, 201]]
    assert written == {"math": ["A prompt that repeats.", "Prompt written at seed 104."],
                       "code": ["A prompt that repeats.", "Prompt written at seed 201."]}


def test_every_samplings_answers_go_to_the_engine_in_one_call(near_bigram_target, tmp_path):
    """``answer_prompts`` submits all samplings' requests at once (the engine's batch drains once), sampling-major,
    request ``k * prompts + i`` seeded ``seed + k * prompts + i``; the rows come out in that order."""
    import json
    from types import SimpleNamespace

    from runtime.training.self_distill import Sampling, answer_prompts

    tokenizer = LLM(str(near_bigram_target), **ENGINE).tokenizer
    calls = []

    def generate(prompts, params, use_tqdm=False):
        calls.append([(p.seed, p.temperature) for p in params])
        return [SimpleNamespace(token_ids=[p.seed], finish_reason="stop") for p in params]

    rows = [{"source": s, "messages": [{"role": "user", "content": f"question {s}"}]} for s in ("a", "b")]
    answer_prompts(SimpleNamespace(tokenizer=tokenizer, generate=generate), rows, [Sampling(0.0), Sampling(0.8, 0.9)],
                   max_tokens=4, max_prompt_tokens=64, out=tmp_path / "answers.jsonl", seed=10)
    assert calls == [[(10, 0.0), (11, 0.0), (12, 0.8), (13, 0.8)]]
    written = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert [(r["source"], r["temperature"], r["response_ids"]) for r in written] == [
        ("a", 0.0, [10]), ("b", 0.0, [11]), ("a", 0.8, [12]), ("b", 0.8, [13])]
