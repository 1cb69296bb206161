"""The survival gate: its curve's invariants, its numpy twin, its blob, its censored loss, its
training, its reliability table, and the online learner and champion store on it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from safetensors.numpy import save as st_save

from predictor.drafting.cache_drafter import SuffixConfig
from predictor.drafting.features import FEATURE_NAMES, NUM_FEATURES, schema_hash
from predictor.evaluation.gate_quality import survival_reliability
from predictor.gate.batch import Batch
from predictor.gate.mlp import DRAFT_LEN_COLUMN, POINT_FORMAT, SURVIVAL_FORMAT, SURVIVAL_K, MLP, BlobError, GatePredictor
from predictor.gate.registry import gate_from_blob, load_gate, store_champion
from predictor.gate.training import TrainConfig, censored_bce, train_gate
from predictor.online.learner import LearnerConfig, OnlineLearner
from storage.engine import session_scope
from storage.versions import get_version

K = SURVIVAL_K


def test_k_is_the_longest_cache_draft_and_the_length_column_is_found_by_name():
    assert K == SuffixConfig().num_speculative_tokens == 24
    assert FEATURE_NAMES[DRAFT_LEN_COLUMN] == "draft_len"


def _survival_model(seed: int, hidden: tuple[int, ...] = (16, 8)) -> MLP:
    torch.manual_seed(seed)
    m = MLP(NUM_FEATURES, hidden, K)
    with torch.no_grad():
        m.mean.copy_(torch.randn(NUM_FEATURES))
        m.scale.copy_(torch.rand(NUM_FEATURES) + 0.5)
    return m.eval()


def _rows(n: int, seed: int = 7) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 2.0, size=(n, NUM_FEATURES)).astype(np.float32)
    x[:, DRAFT_LEN_COLUMN] = rng.integers(0, K + 1, size=n)
    return x


# ---------------------------------------------------------------- the curve's invariants


@settings(max_examples=60, deadline=None)
@given(weight_scale=st.floats(0.01, 30.0), bias=st.floats(-20.0, 20.0), seed=st.integers(0, 2**16),
       draft_len=arrays(np.int64, st.integers(1, 40), elements=st.integers(-2, K + 6)))
def test_curve_is_monotone_in_unit_range_and_zero_past_the_draft(weight_scale, bias, seed, draft_len):
    rng = np.random.default_rng(seed)
    n = len(draft_len)
    weights = [rng.normal(0, weight_scale, (NUM_FEATURES, 12)).astype(np.float32),
               rng.normal(0, weight_scale, (12, K)).astype(np.float32)]
    biases = [rng.normal(0, 1, 12).astype(np.float32), np.full(K, bias, np.float32)]
    gate = GatePredictor(np.zeros(NUM_FEATURES, np.float32), np.ones(NUM_FEATURES, np.float32), weights, biases,
                         schema_hash())
    x = rng.normal(0, 3, (n, NUM_FEATURES)).astype(np.float32)
    x[:, DRAFT_LEN_COLUMN] = draft_len
    s = gate.survival(x)
    assert s.shape == (n, K) and s.dtype == np.float32
    assert np.all((s >= 0) & (s <= 1))
    assert np.all(np.diff(s, axis=1) <= 0)
    positions = np.arange(1, K + 1)
    assert np.all(s[positions[None, :] > draft_len[:, None]] == 0)
    expected = gate.predict(x)
    assert expected.dtype == np.float32
    np.testing.assert_allclose(expected, s.sum(axis=1), rtol=1e-6, atol=1e-6)
    assert np.all(expected <= np.clip(draft_len, 0, K) + 1e-4)


def test_numpy_twin_equals_torch_for_the_survival_head():
    model = _survival_model(1234)
    gate = GatePredictor.from_torch(model, schema_hash())
    assert gate.kind == "survival" and model.kind == "survival"
    x = _rows(512)
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
        # S(j) = prod_{i<=j} sigmoid(z_i), 0 past the draft's length, in torch
        draft_len = torch.from_numpy(x[:, DRAFT_LEN_COLUMN])
        curve = torch.cumprod(torch.sigmoid(logits), dim=1)
        expected = (curve * (torch.arange(1, K + 1)[None, :] <= draft_len[:, None]).to(curve.dtype)).numpy()
    assert logits.shape == (512, K)
    got = gate.survival(x)
    np.testing.assert_allclose(got, expected, atol=2e-6, rtol=0)
    np.testing.assert_allclose(gate.predict(x), expected.sum(axis=1), atol=2e-5, rtol=0)
    np.testing.assert_allclose(gate.logits(x), logits.numpy(), atol=2e-5, rtol=1e-5)
    assert 0 < got[:, 0].mean() < 1  # a curve, not all zeros or ones


def test_point_gate_keeps_its_meaning_and_has_no_curve():
    torch.manual_seed(0)
    point = GatePredictor.from_torch(MLP(NUM_FEATURES, (16,)), schema_hash())
    assert point.kind == "point" and point.blob_format == POINT_FORMAT
    assert point.predict(_rows(4)).shape == (4,)
    with pytest.raises(TypeError, match="point-estimate predictor .*has no survival curve"):
        point.survival(_rows(4))


def test_a_last_layer_of_another_width_is_refused_at_construction():
    with pytest.raises(ValueError, match=f"1 output \\(point\\) or {K} \\(survival\\), got 5"):
        GatePredictor(np.zeros(3, np.float32), np.ones(3, np.float32), [np.zeros((3, 5), np.float32)],
                      [np.zeros(5, np.float32)], schema_hash())
    with pytest.raises(ValueError, match="outputs must be 1 \\(point\\) or 24"):
        MLP(NUM_FEATURES, (8,), 7)


# ---------------------------------------------------------------- the blob


def _tensors(gate: GatePredictor) -> dict:
    out = {"mean": gate.mean, "scale": gate.scale}
    for i, (w, b) in enumerate(zip(gate.weights, gate.biases)):
        out[f"w{i}"], out[f"b{i}"] = w, b
    return out


def _blob(tensors: dict, fmt: str, layers: int) -> bytes:
    return st_save(tensors, metadata={"format": fmt, "schema_hash": schema_hash(), "layers": str(layers)})


def test_survival_blob_round_trip_is_bit_identical():
    gate = GatePredictor.from_torch(_survival_model(5), schema_hash())
    blob = gate.to_bytes()
    assert f'"format":"{SURVIVAL_FORMAT}"'.encode() in blob
    back = GatePredictor.from_bytes(blob, expected_schema_hash=schema_hash())
    x = _rows(64)
    assert back.kind == "survival" and np.array_equal(back.survival(x), gate.survival(x))
    assert back.to_bytes() == blob


def test_an_old_point_blob_still_loads_and_serves_as_a_point_gate():
    torch.manual_seed(3)
    point = GatePredictor.from_torch(MLP(NUM_FEATURES, (16, 8)), schema_hash())
    old = _blob(_tensors(point), POINT_FORMAT, 3)  # written by the library's own writer, as old versions were
    back = GatePredictor.from_bytes(old, expected_schema_hash=schema_hash())
    x = _rows(64)
    assert back.kind == "point" and np.array_equal(back.predict(x), point.predict(x))
    assert f'"format":"{POINT_FORMAT}"'.encode() in back.to_bytes()


def test_a_last_layer_that_does_not_match_the_format_is_refused():
    survival = _tensors(GatePredictor.from_torch(_survival_model(1), schema_hash()))
    torch.manual_seed(1)
    point = _tensors(GatePredictor.from_torch(MLP(NUM_FEATURES, (16, 8)), schema_hash()))
    with pytest.raises(BlobError, match=f"does not end in {K} outputs \\(one per draft position\\) as format "
                                        f"{SURVIVAL_FORMAT} requires; its last layer has 1"):
        GatePredictor.from_bytes(_blob(point, SURVIVAL_FORMAT, 3))
    with pytest.raises(BlobError, match=f"does not end in one output as format {POINT_FORMAT} requires; "
                                        f"its last layer has {K}"):
        GatePredictor.from_bytes(_blob(survival, POINT_FORMAT, 3))


def test_an_unknown_format_names_the_known_ones():
    tensors = _tensors(GatePredictor.from_torch(_survival_model(1), schema_hash()))
    with pytest.raises(BlobError, match=f"format 'hvd-survival/2'; known formats: {POINT_FORMAT}, {SURVIVAL_FORMAT}"):
        GatePredictor.from_bytes(_blob(tensors, "hvd-survival/2", 3))


# ---------------------------------------------------------------- the censored loss


def test_censored_positions_get_no_gradient():
    draft_len = torch.tensor([5.0, 5.0, 3.0, 24.0, 0.0])
    label = torch.tensor([2.0, 5.0, 0.0, 24.0, 0.0])
    logits = torch.randn(5, K, generator=torch.Generator().manual_seed(0), requires_grad=True)
    censored_bce(logits, draft_len, label).backward()
    observed_upto = [3, 5, 1, 24, 0]  # min(a + 1, L)
    for row, last in enumerate(observed_upto):
        assert torch.all(logits.grad[row, :last] != 0), row
        assert torch.all(logits.grad[row, last:] == 0), row
    # so the loss cannot see what the logits are past there
    moved = logits.detach().clone()
    moved[0, 3:] += 100.0
    moved[2, 1:] -= 50.0
    assert censored_bce(moved, draft_len, label) == censored_bce(logits.detach(), draft_len, label)


def test_censored_loss_by_hand():
    # one draft of length 3 that got 1 token accepted: position 1 accepted, 2 rejected, 3 censored
    z = torch.zeros(1, K)
    z[0, :3] = torch.tensor([2.0, -1.0, 7.0])
    got = censored_bce(z, torch.tensor([3.0]), torch.tensor([1.0]), torch.tensor([2.0]))
    by_hand = 2.0 * (-np.log(1 / (1 + np.exp(-2.0))) - np.log(1 - 1 / (1 + np.exp(1.0))))
    assert got.item() == pytest.approx(by_hand, rel=1e-6)


def test_labels_outside_the_draft_are_refused_by_training():
    x = np.zeros((3, NUM_FEATURES), np.float32)
    x[:, DRAFT_LEN_COLUMN] = [4, 4, 2]
    with pytest.raises(ValueError, match="1 row\\(s\\) have an accepted length outside 0..draft length "
                                         "\\(first: row 2, label 3, draft length 2\\)"):
        train_gate(x, np.array([0, 4, 3]), np.zeros(3, np.int64), TrainConfig(epochs=1))


def test_unknown_training_kind_is_refused():
    with pytest.raises(ValueError, match="kind must be one of survival, point, got 'quantile'"):
        TrainConfig(kind="quantile")


# ---------------------------------------------------------------- training recovers a known curve


def _geometric(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Drafts whose every position is accepted with probability p (0.9 or 0.55, told by a
    feature) until the first rejection, truncated at the draft length: S(j) = p ** j."""
    rng = np.random.default_rng(seed)
    x = np.zeros((n, NUM_FEATURES), np.float32)
    easy = rng.random(n) < 0.5
    x[:, 0] = easy
    x[:, DRAFT_LEN_COLUMN] = rng.integers(1, K + 1, size=n)
    p = np.where(easy, 0.9, 0.55)
    run = rng.geometric(1 - p) - 1  # successes before the first failure
    label = np.minimum(run, x[:, DRAFT_LEN_COLUMN]).astype(np.float32)
    return x, label, p


def test_training_recovers_a_geometric_survival_curve():
    x, label, _ = _geometric(40_000, seed=0)
    config = TrainConfig(hidden=(16,), epochs=10, batch_size=512, learning_rate=1e-2, balance=0.0)
    gate = GatePredictor.from_torch(train_gate(x, label, np.zeros(len(x), np.int64), config), schema_hash())
    probe = np.zeros((2, NUM_FEATURES), np.float32)
    probe[:, 0] = [1, 0]
    probe[:, DRAFT_LEN_COLUMN] = K
    s = gate.survival(probe)
    j = np.arange(1, K + 1)
    # the curve's whole mass matters where drafts reach: positions with S >= 0.02
    for row, p in enumerate((0.9, 0.55)):
        truth = p ** j
        seen = truth >= 0.02
        assert np.max(np.abs(s[row, seen] - truth[seen])) < 0.03, (p, s[row, seen], truth[seen])
    # the expected length is sum_j p^j over the draft: a short draft caps it
    probe[:, DRAFT_LEN_COLUMN] = 3
    assert gate.predict(probe) == pytest.approx([0.9 + 0.81 + 0.729, 0.55 + 0.3025 + 0.166375], abs=0.06)


def test_point_training_keeps_its_mse_path():
    x, label, p = _geometric(4000, seed=1)
    config = TrainConfig(hidden=(8,), epochs=2, kind="point")
    a = train_gate(x, label, np.zeros(len(x), np.int64), config)
    b = train_gate(x, label, np.zeros(len(x), np.int64), config)
    assert a.kind == "point" and a.outputs == 1
    assert all(torch.equal(u, v) for u, v in zip(a.state_dict().values(), b.state_dict().values()))


# ---------------------------------------------------------------- the reliability table


def test_reliability_table_by_hand():
    survival = np.array([[0.9, 0.5, 0.0],
                         [0.7, 0.3, 0.1],
                         [0.2, 0.0, 0.0]])
    draft_len = np.array([2, 3, 1])
    label = np.array([2, 0, 1])
    table = survival_reliability(survival, draft_len, label)
    assert table == [
        {"position": 1, "count": 3, "mean_predicted": 0.6, "observed": 0.6667, "gap": -0.0667},
        {"position": 2, "count": 2, "mean_predicted": 0.4, "observed": 0.5, "gap": -0.1},
        {"position": 3, "count": 1, "mean_predicted": 0.1, "observed": 0.0, "gap": 0.1},
    ]
    # positions no draft reaches are left out
    assert [r["position"] for r in survival_reliability(survival, np.array([1, 1, 1]), label)] == [1]
    with pytest.raises(ValueError, match="survival must be \\(n x K\\)"):
        survival_reliability(survival[:2], draft_len, label)


# ---------------------------------------------------------------- the online learner


def _batch(n: int, seed: int) -> Batch:
    x, label, _ = _geometric(n, seed)
    return Batch(x, label, x[:, DRAFT_LEN_COLUMN].astype(np.int64), np.zeros(n, np.int64), np.full(n, 0.7))


def _goodput(label, draft_len, cache, workload):
    return np.where(cache, label + 1.0, 1.75), np.where(cache, 6.5 + 0.03 * (1 + draft_len), 8.0)


def _learn(champion: GatePredictor) -> OnlineLearner:
    learner = OnlineLearner(champion, _goodput, LearnerConfig(seed=5, batch_size=64, learning_rate=1e-2))
    for seed in range(8):  # 64 updates: enough for S(1) to reach the observed rate (32 left it 0.07-0.24 short)
        learner.learn_many(_batch(512, seed))
    return learner


def test_online_learner_on_a_survival_champion_stays_survival_and_is_deterministic():
    # a pessimistic champion: every position's conditional acceptance is sigmoid(-3)
    model = _survival_model(0, hidden=(16,))
    with torch.no_grad():
        model.net[-1].bias.fill_(-3.0)
        model.net[-1].weight.mul_(0.01)
    champion = GatePredictor.from_torch(model, schema_hash())
    a, b = _learn(champion), _learn(champion)
    assert a.updates == b.updates > 0
    assert a.challenger().kind == "survival" and a.challenger().blob_format == SURVIVAL_FORMAT
    assert a.challenger().to_bytes() == b.challenger().to_bytes()
    # it learned from the labels through the censored loss: S(1) went from ~0.05 to the observed rate
    held_out = _batch(2000, 99)
    observed = np.mean(held_out.label >= 1)
    assert abs(champion.survival(held_out.features)[:, 0].mean() - observed) > 0.6
    assert abs(a.challenger().survival(held_out.features)[:, 0].mean() - observed) < 0.05


def test_adopting_a_champion_of_the_other_kind_restarts_the_challenger_from_it():
    learner = OnlineLearner(GatePredictor.from_torch(_survival_model(0), schema_hash()), _goodput, LearnerConfig())
    torch.manual_seed(2)
    point = GatePredictor.from_torch(MLP(NUM_FEATURES, (16,)), schema_hash())
    learner.adopt(point)
    assert learner.challenger().kind == "point"
    assert learner.challenger().to_bytes() == point.to_bytes()


# ---------------------------------------------------------------- champion storage


def test_store_champion_names_the_kind_and_the_probe_scores_the_curve(db):
    survival = GatePredictor.from_torch(_survival_model(4), schema_hash())
    torch.manual_seed(4)
    point = GatePredictor.from_torch(MLP(NUM_FEATURES), schema_hash())
    with session_scope(db) as s:
        sid = store_champion(s, survival, reason="test", actor="test")
        pid = store_champion(s, point, reason="test", actor="test")
        assert (get_version(s, sid).kind, get_version(s, pid).kind) == ("survival", "mlp")
    assert load_gate(db, sid)[1].kind == "survival" and load_gate(db)[1].kind == "point"


def test_a_survival_blob_whose_logits_overflow_is_refused():
    gate = GatePredictor.from_torch(_survival_model(4), schema_hash())
    huge = GatePredictor(gate.mean, gate.scale, [w * 1e15 for w in gate.weights], [b * 1e15 for b in gate.biases],
                         gate.schema_hash)
    with np.errstate(all="ignore"):
        with pytest.raises(BlobError, match="scores a fixed probe input to non-finite values"):
            gate_from_blob(huge.to_bytes())
    assert gate_from_blob(gate.to_bytes()).kind == "survival"
