"""g_theta: a small MLP regressor of the cache draft's accepted length, and its numpy twin.

Training uses torch; the decode path uses `GatePredictor`, plain numpy matmuls over the whole batch,
because a torch call costs tens of microseconds of dispatch per request-sized batch. Both compute
the same function from the same float32 weights. Blobs are safetensors (no code runs on load) with
the feature schema hash and layer sizes in the header; anything that does not match is refused.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.numpy import load as st_load

BLOB_FORMAT = "hvd-mlp/1"


class BlobError(ValueError):
    """A predictor blob that is corrupt, truncated or made for another feature schema."""


class MLP(torch.nn.Module):
    """Standardise, then ReLU layers; the output is clamped at 0 by the caller, not trained on."""

    def __init__(self, num_features: int, hidden: tuple[int, ...] = (128, 64, 32)) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(num_features))
        self.register_buffer("scale", torch.ones(num_features))
        layers: list[torch.nn.Module] = []
        width = num_features
        for h in hidden:
            layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
            width = h
        layers.append(torch.nn.Linear(width, 1))
        self.net = torch.nn.Sequential(*layers)
        self.hidden = tuple(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.mean) / self.scale).squeeze(-1)


@dataclass
class GatePredictor:
    """Numpy inference for a batch of feature rows; what the runtime and the simulator call."""

    mean: np.ndarray
    scale: np.ndarray
    weights: list[np.ndarray]
    biases: list[np.ndarray]
    schema_hash: str

    def __post_init__(self) -> None:
        # Fold the scaler into the first layer: two fewer array operations per call, which is
        # most of the cost at batch 1.
        w0 = self.weights[0] / self.scale[:, None]
        b0 = self.biases[0] - (self.mean / self.scale) @ self.weights[0]
        self._layers = [(w0.astype(np.float32), b0.astype(np.float32))] + [
            (w, b) for w, b in zip(self.weights[1:], self.biases[1:])
        ]

    @classmethod
    def from_torch(cls, model: MLP, schema_hash: str) -> "GatePredictor":
        linears = [m for m in model.net if isinstance(m, torch.nn.Linear)]
        return cls(
            mean=model.mean.detach().numpy().astype(np.float32).copy(),
            scale=model.scale.detach().numpy().astype(np.float32).copy(),
            weights=[np.ascontiguousarray(m.weight.detach().numpy().T, dtype=np.float32) for m in linears],
            biases=[m.bias.detach().numpy().astype(np.float32).copy() for m in linears],
            schema_hash=schema_hash,
        )

    @property
    def num_features(self) -> int:
        return len(self.mean)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Predicted accepted length per row (float32, >= 0)."""
        h = np.asarray(x, dtype=np.float32)
        last = len(self._layers) - 1
        for i, (w, b) in enumerate(self._layers):
            h = h @ w
            h += b
            if i < last:
                np.maximum(h, 0.0, out=h)
        return np.maximum(h[:, 0], 0.0)

    def to_bytes(self) -> bytes:
        tensors = {"mean": self.mean, "scale": self.scale}
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            tensors[f"w{i}"] = w
            tensors[f"b{i}"] = b
        meta = {"format": BLOB_FORMAT, "schema_hash": self.schema_hash, "layers": str(len(self.weights))}
        return _canonical_safetensors(tensors, meta)

    @classmethod
    def from_bytes(cls, blob: bytes, expected_schema_hash: str | None = None) -> "GatePredictor":
        try:
            tensors = st_load(blob)
            meta = _metadata(blob)
        except (SafetensorError, ValueError, json.JSONDecodeError) as exc:
            raise BlobError(f"predictor blob is not a readable safetensors file: {exc}") from exc
        if meta.get("format") != BLOB_FORMAT:
            raise BlobError(f"predictor blob has format {meta.get('format')!r}, expected {BLOB_FORMAT!r}")
        if expected_schema_hash is not None and meta.get("schema_hash") != expected_schema_hash:
            raise BlobError(
                f"predictor blob was trained on feature schema {ascii(str(meta.get('schema_hash'))[:12])[1:-1]}, "
                f"this code computes schema {expected_schema_hash[:12]}: retrain (make warmstart)"
            )
        if "layers" not in meta:
            raise BlobError("predictor blob lacks tensor or field 'layers'")
        try:
            layers = int(meta["layers"])
        except ValueError as exc:
            raise BlobError(f"predictor blob metadata 'layers' is not an integer: {meta.get('layers')!r}") from exc
        if layers < 1:
            raise BlobError(f"predictor blob declares {layers} layers; at least 1 is needed")
        try:
            weights = [tensors[f"w{i}"].astype(np.float32) for i in range(layers)]
            biases = [tensors[f"b{i}"].astype(np.float32) for i in range(layers)]
            mean, scale = tensors["mean"].astype(np.float32), tensors["scale"].astype(np.float32)
        except KeyError as exc:
            raise BlobError(f"predictor blob lacks tensor or field {exc}") from exc
        width = len(mean)
        for i, (w, b) in enumerate(zip(weights, biases)):
            if w.ndim != 2 or w.shape[0] != width or b.shape != (w.shape[1],):
                raise BlobError(f"predictor blob layer {i} has shape {w.shape}/{b.shape}, expected input width {width}")
            width = w.shape[1]
        if width != 1 or scale.shape != mean.shape:
            raise BlobError("predictor blob does not end in one output or its scaler is malformed")
        if not (np.all(np.isfinite(scale)) and np.all(scale > 0)):
            raise BlobError("predictor blob scaler has a zero, negative or non-finite scale")
        if not all(np.all(np.isfinite(a)) for a in [mean, *weights, *biases]):
            raise BlobError("predictor blob holds non-finite weights")
        return cls(mean, scale, weights, biases, str(meta["schema_hash"]))


def _canonical_safetensors(tensors: dict[str, np.ndarray], meta: dict[str, str]) -> bytes:
    """The safetensors format written byte-for-byte deterministically (tensors in name order, a
    sorted header), so equal weights give equal blobs and equal hashes; the library's own writer
    orders equal-sized tensors arbitrarily."""
    header: dict[str, object] = {"__metadata__": meta}
    chunks, offset = [], 0
    for name in sorted(tensors):
        data = np.ascontiguousarray(tensors[name], dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(chunks)


def _metadata(blob: bytes) -> dict[str, str]:
    if len(blob) < 8:
        raise ValueError("blob shorter than a safetensors header")
    size = int.from_bytes(blob[:8], "little")
    if size <= 0 or 8 + size > len(blob):
        raise ValueError("safetensors header length out of range")
    return json.loads(blob[8 : 8 + size]).get("__metadata__", {})
