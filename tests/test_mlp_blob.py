"""The numpy gate equals the torch MLP, and its safetensors blob refuses anything malformed."""
from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch
from safetensors.numpy import save as st_save

from predictor.drafting.features import NUM_FEATURES, schema_hash
from predictor.gate.mlp import BLOB_FORMAT, MLP, BlobError, GatePredictor


@pytest.fixture
def model() -> MLP:
    torch.manual_seed(1234)
    m = MLP(NUM_FEATURES, (16, 8))
    with torch.no_grad():
        m.mean.copy_(torch.randn(NUM_FEATURES))
        m.scale.copy_(torch.rand(NUM_FEATURES) + 0.5)
        m.net[-1].bias.fill_(0.0)  # keep outputs on both sides of 0
    return m.eval()


@pytest.fixture
def x() -> np.ndarray:
    return np.random.default_rng(7).normal(0.0, 2.0, size=(512, NUM_FEATURES)).astype(np.float32)


def test_numpy_gate_equals_torch_forward(model, x):
    gate = GatePredictor.from_torch(model, schema_hash())
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).clamp_min(0.0).numpy()
    got = gate.predict(x)
    assert got.shape == (512,) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    assert (got == 0).any() and (got > 0).any()  # both sides of the clamp were exercised
    assert gate.num_features == NUM_FEATURES


def test_blob_round_trip_is_bit_identical(model, x):
    gate = GatePredictor.from_torch(model, schema_hash())
    blob = gate.to_bytes()
    back = GatePredictor.from_bytes(blob, expected_schema_hash=schema_hash())
    assert np.array_equal(back.predict(x), gate.predict(x))
    assert back.schema_hash == schema_hash()
    assert len(back.weights) == 3


def _blob_with(tensors: dict, **meta) -> bytes:
    base = {"format": BLOB_FORMAT, "schema_hash": schema_hash(), "layers": "3"}
    base.update(meta)
    return st_save(tensors, metadata={k: v for k, v in base.items() if v is not None})


def _tensors(gate: GatePredictor) -> dict:
    out = {"mean": gate.mean, "scale": gate.scale}
    for i, (w, b) in enumerate(zip(gate.weights, gate.biases)):
        out[f"w{i}"], out[f"b{i}"] = w, b
    return out


def test_truncated_blob(model):
    blob = GatePredictor.from_torch(model, schema_hash()).to_bytes()
    for cut in (0, 5, 8, 40, len(blob) // 2, len(blob) - 1):
        with pytest.raises(BlobError, match="not a readable safetensors file"):
            GatePredictor.from_bytes(blob[:cut])


def test_random_bytes():
    rng = np.random.default_rng(0)
    for size in (3, 64, 4096):
        with pytest.raises(BlobError, match="not a readable safetensors file"):
            GatePredictor.from_bytes(rng.bytes(size))


def test_pickle_payload_is_refused_without_running_it(model):
    payload = pickle.dumps(model.state_dict())
    with pytest.raises(BlobError, match="not a readable safetensors file"):
        GatePredictor.from_bytes(payload)
    torch_file = pickle.dumps({"w0": np.zeros(3)})
    with pytest.raises(BlobError):
        GatePredictor.from_bytes(torch_file)


def test_other_schema_hash_is_refused(model):
    gate = GatePredictor.from_torch(model, "f" * 64)
    blob = gate.to_bytes()
    with pytest.raises(BlobError, match=r"feature schema ffffffffffff.*this code computes schema " + schema_hash()[:12]):
        GatePredictor.from_bytes(blob, expected_schema_hash=schema_hash())
    # without an expectation the blob loads and reports its own hash
    assert GatePredictor.from_bytes(blob).schema_hash == "f" * 64


def test_schema_hash_in_the_error_is_escaped(model):
    """The message reaches terminals (hvd versions, rollback) and logs: no control codes from a blob."""
    blob = _blob_with(_tensors(GatePredictor.from_torch(model, schema_hash())), schema_hash="\x1b[2J\n" + "a" * 60)
    with pytest.raises(BlobError) as info:
        GatePredictor.from_bytes(blob, expected_schema_hash=schema_hash())
    assert str(info.value).startswith("predictor blob was trained on feature schema \\x1b[2J\\naaaaaaa, ")


def test_wrong_format_is_refused(model):
    tensors = _tensors(GatePredictor.from_torch(model, schema_hash()))
    with pytest.raises(BlobError, match="format 'other/1'"):
        GatePredictor.from_bytes(_blob_with(tensors, format="other/1"))
    with pytest.raises(BlobError, match="format None"):
        GatePredictor.from_bytes(st_save(tensors))  # no metadata at all


@pytest.mark.parametrize("missing", ["w1", "b2", "mean", "scale"])
def test_missing_tensor_is_named(model, missing):
    tensors = _tensors(GatePredictor.from_torch(model, schema_hash()))
    del tensors[missing]
    with pytest.raises(BlobError, match=f"lacks tensor or field '{missing}'"):
        GatePredictor.from_bytes(_blob_with(tensors), expected_schema_hash=schema_hash())


def test_missing_layers_field(model):
    tensors = _tensors(GatePredictor.from_torch(model, schema_hash()))
    with pytest.raises(BlobError, match="lacks tensor or field 'layers'"):
        GatePredictor.from_bytes(_blob_with(tensors, layers=None))


def test_mismatched_shapes_are_refused(model):
    tensors = _tensors(GatePredictor.from_torch(model, schema_hash()))
    tensors["w1"] = np.zeros((5, 8), dtype=np.float32)  # expects 16 inputs
    with pytest.raises(BlobError, match="layer 1 has shape"):
        GatePredictor.from_bytes(_blob_with(tensors))
    tensors = _tensors(GatePredictor.from_torch(model, schema_hash()))
    with pytest.raises(BlobError, match="does not end in one output"):
        GatePredictor.from_bytes(_blob_with(tensors, layers="2"))  # stops at the 8-wide layer


def test_header_length_out_of_range():
    bad = (10**6).to_bytes(8, "little") + json.dumps({"__metadata__": {}}).encode()
    with pytest.raises(BlobError, match="not a readable safetensors file"):
        GatePredictor.from_bytes(bad)


# ---------------------------------------------------------------- malformed headers


def _one_layer(width: int, scale: float = 1.0) -> dict:
    return {"mean": np.zeros(width, np.float32), "scale": np.full(width, scale, np.float32),
            "w0": np.ones((width, 1), np.float32), "b0": np.zeros(1, np.float32)}


def test_non_integer_layer_count_is_a_blob_error():
    with pytest.raises(BlobError, match="layers"):
        GatePredictor.from_bytes(_blob_with(_one_layer(3), layers="one"))


def test_zero_layers_is_a_blob_error():
    tensors = {"mean": np.zeros(1, np.float32), "scale": np.ones(1, np.float32)}
    with pytest.raises(BlobError):
        GatePredictor.from_bytes(_blob_with(tensors, layers="0"))


def test_non_finite_weights_are_a_blob_error():
    tensors = _one_layer(3)
    tensors["w0"][1, 0] = np.nan
    with pytest.raises(BlobError, match="non-finite"):
        GatePredictor.from_bytes(_blob_with(tensors, layers="1"))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_zero_scale_is_a_blob_error():
    with pytest.raises(BlobError, match="scale"):
        GatePredictor.from_bytes(_blob_with(_one_layer(3, scale=0.0), layers="1"))
