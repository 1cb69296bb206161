"""The tau tuner's report under the allocator: the running mean of the break-even tau per workload,
however the events arrive in batches; nothing reported before a workload's first decided draft."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.core.decision import DecisionConfig
from controller.core.tau_tuner import TauTuner
from storage.workloads import WORKLOADS

observations = st.lists(st.tuples(st.integers(0, len(WORKLOADS) - 1),
                                  st.floats(-5.0, 50.0, allow_nan=False) | st.just(float("nan"))),
                        min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(observations, st.lists(st.integers(1, 20), min_size=1, max_size=10))
def test_break_even_is_the_running_mean_in_any_batching(obs, cuts):
    tuner = TauTuner(DecisionConfig())
    workload = np.array([w for w, _ in obs])
    tau = np.array([t for _, t in obs])
    start = 0
    for size in cuts * (len(obs) // len(cuts) + 1):
        if start >= len(obs):
            break
        tuner.observe_break_even(workload[start : start + size], tau[start : start + size])
        start += size
    for i, w in enumerate(WORKLOADS):
        mean = None
        for wi, t in obs:
            if wi == i and np.isfinite(t):
                mean = t if mean is None else (1 - tuner.decay) * mean + tuner.decay * t
        got = tuner.state[w].break_even
        assert (got is None) if mean is None else abs(got - mean) <= 1e-9 * (1 + abs(mean))


def test_reports_follow_the_rule():
    tuner = TauTuner(DecisionConfig())
    assert tuner.changes("start", "allocator") == []  # no break-even tau seen yet
    tuner.observe_break_even(np.array([WORKLOADS.index("sql")] * 2), np.array([2.0, 4.0]))
    (change,) = tuner.changes("live estimates", "allocator")
    expected = 0.995 * 2.0 + 0.005 * 4.0
    assert (change.workload, change.correction, change.reason) == ("sql", 0.0, "live estimates")
    assert change.tau == change.rule_tau == pytest.approx(expected, rel=1e-12)
    assert tuner.changes("again", "allocator") == []  # unchanged: not written again
    binary = tuner.changes("binary", "binary")
    assert {c.workload for c in binary} == set(WORKLOADS)  # the goodput rule's tau, for every workload
    sql = next(c for c in binary if c.workload == "sql")
    assert sql.tau == sql.rule_tau == float(tuner.rule_tau("sql", 8)[0]) and sql.correction == 0.0
