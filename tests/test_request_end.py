"""Which draft tokens can still be output: none past the request's last possible token, which the
step's bonus token gives anyway (controller.core.request_end), and the runtime verifies no others."""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.core.decision import CACHE, MODEL, DecisionConfig
from controller.core.request_end import model_room, useful_length
from controller.core.runtime import RequestInput, RequestInputError
from controller.core.runtime import Runtime as _Runtime
from predictor.decision.profiles import cost_profiles
from predictor.drafting.cache_drafter import VLLM_SUFFIX
from predictor.drafting.token_classes import token_classes
from predictor.gate.mlp import SURVIVAL_K
from tests.test_runtime_boundary import PROMPT, survival_gate

GPU = cost_profiles()["gpu-8b"]
Runtime = partial(_Runtime, suffix=VLLM_SUFFIX)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(draft=st.lists(st.integers(0, 9), max_size=20), room=st.none() | st.integers(0, 25),
       stops=st.sets(st.integers(0, 9), max_size=3))
def test_the_useful_length_is_the_longest_prefix_that_can_be_output(draft, room, stops):
    n = useful_length(draft, room, stops)
    assert 0 <= n <= len(draft)
    assert room is None or n <= max(0, room - 1)
    assert not set(draft[:n]) & stops
    # and no longer one would do: the draft ends there, or the room, or a stop token follows
    assert n == len(draft) or (room is not None and n == max(0, room - 1)) or draft[n] in stops


def test_useful_length_cases():
    assert useful_length([5, 6, 7, 8], None, ()) == 4
    assert useful_length([5, 6, 7, 8], 3, ()) == 2  # 2 drafted + the bonus token = the 3 left
    assert useful_length([5, 6, 7, 8], 1, ()) == 0  # the last token is the bonus token's
    assert useful_length([5, 6, 7, 8], 0, ()) == 0
    assert useful_length([5, 2, 7, 8], None, (2,)) == 1  # the eos is the bonus token's if it comes
    assert useful_length([2, 6], None, {2, 9}) == 0
    assert model_room(None, 5) == 5 and model_room(4, 5) == 3 and model_room(1, 5) == 0 and model_room(0, 5) == 0


@pytest.fixture
def runtime(tokenizer):
    return Runtime(survival_gate(SURVIVAL_K), token_classes(tokenizer), DecisionConfig(cost=GPU))


def test_a_sure_draft_is_verified_only_as_far_as_its_request_can_go(runtime):
    plan = runtime.step([RequestInput("a", [100], PROMPT, workload="agentic", room=5)])
    assert plan.source.tolist() == [CACHE] and plan.drafts[0] == [101, 102, 103, 104]
    assert plan.cache_drafts[0] == list(range(101, 113))  # the cache's whole draft, for the record
    plan = runtime.step([RequestInput("b", [100], PROMPT, workload="agentic", stops=(103, 999))])
    assert plan.drafts[0] == [101, 102]  # 103 ends the request: the bonus token gives it
    plan = runtime.step([RequestInput("c", [100], PROMPT, workload="agentic")])
    assert len(plan.drafts[0]) == 12  # an engine that does not say: the whole draft


def test_a_request_with_one_token_left_verifies_nothing(runtime):
    plan = runtime.step([RequestInput("a", [100], PROMPT, workload="agentic", room=1),
                         RequestInput("b", [100], PROMPT, workload="code_edit", room=9)])
    assert plan.source.tolist()[0] != CACHE and plan.drafts[0] == []
    assert plan.drafts[1] == list(range(101, 109))
    assert plan.cache_len.tolist() == [0, 8]


def test_a_model_draft_is_cut_to_the_room_left(tokenizer):
    runtime = Runtime(survival_gate(0), token_classes(tokenizer), DecisionConfig(cost=GPU))
    prompt = list(range(3000, 3060))
    plan = runtime.step([RequestInput("m", [5], prompt, workload="sql")])
    assert plan.source.tolist() == [MODEL] and plan.model_k >= 3
    plan = runtime.step([RequestInput("n", [5], prompt, workload="sql", room=3)])
    assert plan.source.tolist() == [MODEL] and plan.model_k <= 2
    plan = runtime.step([RequestInput("o", [5], prompt, workload="sql", room=1),
                         RequestInput("p", [5], prompt, workload="sql")])
    assert plan.source.tolist()[0] != MODEL and plan.source.tolist()[1] == MODEL


@pytest.mark.parametrize("room", [-1, 2.5, True, "3"])
def test_a_bad_room_is_refused_by_name(runtime, room):
    with pytest.raises(RequestInputError, match="room must be an int >= 0"):
        runtime.step([RequestInput("a", [100], PROMPT, workload="agentic", room=room)])
    assert "a" not in runtime.requests


def test_room_as_numpy_int_is_taken(runtime):
    plan = runtime.step([RequestInput("a", [100], PROMPT, workload="agentic", room=np.int64(3))])
    assert plan.drafts[0] == [101, 102]
