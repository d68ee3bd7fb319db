"""/metrics exports what the confidence scheduler chose, how its step-time prediction held (and what a context
token costs, as its table learned), its survival correction per position, the survival fit (slope per position, bias
per verify history) and how sharp its survivals were."""

from prometheus_client import CollectorRegistry, generate_latest

from cluster.serve.metrics import EngineCollector
from configs import DSparkDecodingConfig
from runtime import LLM, SamplingParams
from runtime.spec.history import history_classes


def test_the_scheduler_gauges_are_exported(near_bigram_target, make_drafter):
    spec = DSparkDecodingConfig(speculative_model=str(make_drafter(near_bigram_target, 4, oracle=True)),
                                enable_confidence_scheduling=True)
    llm = LLM(str(near_bigram_target), speculative_config=spec, dtype="float32", device="cpu", num_pages=256,
              page_size=4, max_num_seqs=4)
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    # sampled: the oracle drafter's drafts then survive some of the time (greedy, all of them: no skill to score)
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=24, temperature=1.0, seed=0, ignore_eos=True))
    registry = CollectorRegistry()
    registry.register(EngineCollector(lambda: llm.engine, llm.rank_info()))
    text = generate_latest(registry).decode()
    last = llm.get_metrics()["confidence_scheduling"]["last"]
    assert f"dspark:confidence_verify_budget {float(last['verify_budget'])}" in text
    assert "dspark:confidence_predicted_step_seconds" in text and "dspark:confidence_measured_step_seconds" in text
    slope = llm.get_metrics()["confidence_scheduling"]["cost_table_ms_per_context_token"]
    assert f"dspark:confidence_step_seconds_per_context_token {slope / 1e3}" in text
    stats = llm.get_metrics()["confidence_scheduling"]
    assert f"dspark:confidence_drafting_off_steps {float(stats['drafting_off_steps'])}" in text
    assert f"dspark:confidence_drafting_holds {float(stats['drafting_holds'])}" in text
    reversed_ = float(stats["drafting_judgements_reversed"])
    assert f"dspark:confidence_drafting_judgements_reversed {reversed_}" in text
    ended = float(stats["drafting_mixed_holds_ended"])
    assert f"dspark:confidence_drafting_mixed_holds_ended {ended}" in text
    assert f"dspark:confidence_serial_steps {float(stats['serial_steps'])}" in text  # (0: a CPU runs nothing ahead)
    # the drafting judgement: the plain step the last decision priced (its startup profile timed plain steps)
    assert last["plain_step_ms"] > 0 and f"dspark:confidence_plain_step_seconds {last['plain_step_ms'] / 1e3}" in text
    assert f"dspark:confidence_drafting_paid_share {float(stats['drafting_paid_share'])}" in text
    ratios = llm.get_metrics()["confidence_scheduling"]["survival_correction"]
    assert len(ratios) == 4
    for position, ratio in enumerate(ratios):
        assert f'dspark:confidence_survival_correction{{position="{position}"}} {float(ratio)}' in text
    fit = llm.get_metrics()["confidence_scheduling"]["survival_fit"]
    assert len(fit["slope"]) == 4 and list(fit["bias"]) == history_classes(4)
    for position, value in enumerate(fit["slope"]):
        assert f'dspark:confidence_survival_slope{{position="{position}"}} {float(value)}' in text
    for history, values in fit["bias"].items():
        for position, value in enumerate(values):
            assert f'dspark:confidence_survival_bias{{history="{history}",position="{position}"}} {float(value)}' \
                in text
    skills = llm.get_metrics()["confidence_scheduling"]["survival_skill_per_position"]
    assert len(skills) == 4 and skills[0] is not None  # the first position is verified at every step
    for position, value in enumerate(skills):  # a position without evidence (None) is left out
        if value is None:
            assert f'dspark:confidence_survival_skill{{position="{position}"}}' not in text
        else:
            assert f'dspark:confidence_survival_skill{{position="{position}"}} {float(value)}' in text
