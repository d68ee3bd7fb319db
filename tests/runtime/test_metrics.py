"""Counters and the acceptance gate."""

from runtime.engine.metrics import AcceptanceGate, SpecMetrics


def test_spec_metrics():
    m = SpecMetrics()
    m.record(4, 2)
    m.record(2, 2)
    m.record(0, 0)
    assert m.as_dict() == {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 4,
                           "num_accepted_tokens_per_pos": [2, 2, 0, 0], "mean_acceptance_length": 3.0}


def test_gate_needs_a_full_window_and_never_reopens():
    gate = AcceptanceGate(window=3, threshold=0.5)
    gate.record(4, 0)
    gate.record(4, 0)
    assert not gate.closed
    gate.record(0, 0)  # a step without drafts is no sample
    assert not gate.closed
    gate.record(4, 4)
    assert gate.closed  # mean(0, 0, 1) = 1/3 < 0.5
    gate.record(4, 4)
    assert gate.closed


def test_gate_disabled():
    for gate in (AcceptanceGate(None, 0.5), AcceptanceGate(0, 0.5), AcceptanceGate(3, None)):
        for _ in range(5):
            gate.record(4, 0)
        assert not gate.closed
