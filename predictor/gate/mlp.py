"""g_theta: a small MLP over the cache draft's features, and its numpy twin.

Two kinds share the body. A *survival* gate (the default) ends in K = SURVIVAL_K logits, one per
draft position j, of the conditional acceptance h_j = P(accepted >= j | accepted >= j-1); its
survival curve S(j) = prod_{i<=j} sigmoid(z_i) is monotone by construction and 0 past the draft's
end, and its expected accepted length sum_j S(j) is what `predict` returns. A *point* gate (the
seed's, format hvd-mlp/1) ends in one output, the regressed accepted length; old versions of it
still load and serve.

Training uses torch; the decode path uses `GatePredictor`, plain numpy matmuls over the whole batch,
because a torch call costs tens of microseconds of dispatch per request-sized batch. Both compute
the same function from the same float32 weights. Blobs are safetensors (no code runs on load) with
the format, feature schema hash and layer count in the header; anything that does not match is refused.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.numpy import load as st_load

from predictor.drafting.cache_drafter import SuffixConfig
from predictor.drafting.features import FEATURE_NAMES

SURVIVAL_K = SuffixConfig().num_speculative_tokens  # the longest draft the cache makes
DRAFT_LEN_COLUMN = FEATURE_NAMES.index("draft_len")
POINT_FORMAT = "hvd-mlp/1"
SURVIVAL_FORMAT = "hvd-survival/1"
BLOB_FORMAT = POINT_FORMAT  # the seed's name for the point format
FORMATS = {POINT_FORMAT: ("point", 1), SURVIVAL_FORMAT: ("survival", SURVIVAL_K)}  # format -> (kind, outputs)
_KIND_OF_WIDTH = {outputs: kind for kind, outputs in FORMATS.values()}
_FORMAT_OF_KIND = {kind: fmt for fmt, (kind, _) in FORMATS.items()}


class BlobError(ValueError):
    """A predictor blob that is corrupt, truncated or made for another feature schema."""


class MLP(torch.nn.Module):
    """Standardise, then ReLU layers. outputs=1: the point regressor, forward gives (n,), clamped at
    0 by the caller, not trained on. outputs=SURVIVAL_K: forward gives the (n, K) conditional logits."""

    def __init__(self, num_features: int, hidden: tuple[int, ...] = (128, 64, 32), outputs: int = 1) -> None:
        if outputs not in _KIND_OF_WIDTH:
            raise ValueError(f"MLP outputs must be 1 (point) or {SURVIVAL_K} (survival), got {outputs}")
        super().__init__()
        self.register_buffer("mean", torch.zeros(num_features))
        self.register_buffer("scale", torch.ones(num_features))
        layers: list[torch.nn.Module] = []
        width = num_features
        for h in hidden:
            layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
            width = h
        layers.append(torch.nn.Linear(width, outputs))
        self.net = torch.nn.Sequential(*layers)
        self.hidden = tuple(hidden)
        self.outputs = outputs

    @property
    def kind(self) -> str:
        return _KIND_OF_WIDTH[self.outputs]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net((x - self.mean) / self.scale)
        return out.squeeze(-1) if self.outputs == 1 else out


@dataclass
class GatePredictor:
    """Numpy inference for a batch of feature rows; what the runtime and the simulator call."""

    mean: np.ndarray
    scale: np.ndarray
    weights: list[np.ndarray]
    biases: list[np.ndarray]
    schema_hash: str

    def __post_init__(self) -> None:
        width = self.weights[-1].shape[1] if self.weights and self.weights[-1].ndim == 2 else None
        if width not in _KIND_OF_WIDTH:
            raise ValueError(f"a gate's last layer must have 1 output (point) or {SURVIVAL_K} (survival), "
                             f"got {width}")
        self._kind = _KIND_OF_WIDTH[width]
        self._positions = np.arange(1, width + 1, dtype=np.float32)
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

    @property
    def kind(self) -> str:
        """"point" (one regressed length) or "survival" (a curve over the SURVIVAL_K draft positions)."""
        return self._kind

    @property
    def blob_format(self) -> str:
        return _FORMAT_OF_KIND[self._kind]

    def logits(self, x: np.ndarray) -> np.ndarray:
        """The last layer's raw output (n, outputs): the unclamped regression of a point gate, the
        per-position conditional logits of a survival gate."""
        h = np.asarray(x, dtype=np.float32)
        last = len(self._layers) - 1
        for i, (w, b) in enumerate(self._layers):
            h = h @ w
            h += b
            if i < last:
                np.maximum(h, 0.0, out=h)
        return h

    def survival(self, x: np.ndarray) -> np.ndarray:
        """S(j) = P(accepted >= j), j = 1..SURVIVAL_K, per row (float32, n x K): non-increasing in
        j (a running product of factors in [0, 1]) and 0 past the row's draft length."""
        if self._kind != "survival":
            raise TypeError(f"a point-estimate predictor ({POINT_FORMAT}) has no survival curve; "
                            f"only {SURVIVAL_FORMAT} gates do (retrain: hvd warmstart)")
        x = np.asarray(x, dtype=np.float32)
        if x.shape == (0, len(self.mean)):  # a step without cache drafts: nothing to compute
            return np.zeros((0, len(self._positions)), dtype=np.float32)
        return self._curve(self.logits(x), x[:, DRAFT_LEN_COLUMN])

    def _curve(self, z: np.ndarray, draft_len: np.ndarray) -> np.ndarray:
        # sigmoid(z) = (1 + tanh(z/2)) / 2: no overflow warnings for large |z|, exactly in [0, 1]
        z *= 0.5
        np.tanh(z, out=z)
        z += 1.0
        z *= 0.5
        z.cumprod(axis=1, out=z)
        z *= self._positions <= draft_len[:, None]
        return z

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Predicted accepted length per row (float32, >= 0): the clamped regression of a point
        gate, the expected accepted length sum_j S(j) (<= the draft length) of a survival gate."""
        x = np.asarray(x, dtype=np.float32)
        z = self.logits(x)
        if self._kind == "point":
            return np.maximum(z[:, 0], 0.0)
        return self._curve(z, x[:, DRAFT_LEN_COLUMN]).sum(axis=1)

    def to_bytes(self) -> bytes:
        tensors = {"mean": self.mean, "scale": self.scale}
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            tensors[f"w{i}"] = w
            tensors[f"b{i}"] = b
        meta = {"format": self.blob_format, "schema_hash": self.schema_hash, "layers": str(len(self.weights))}
        return _canonical_safetensors(tensors, meta)

    @classmethod
    def from_bytes(cls, blob: bytes, expected_schema_hash: str | None = None) -> "GatePredictor":
        try:
            tensors = st_load(blob)
            meta = _metadata(blob)
        except (SafetensorError, ValueError, json.JSONDecodeError) as exc:
            raise BlobError(f"predictor blob is not a readable safetensors file: {exc}") from exc
        fmt = meta.get("format")
        if fmt not in FORMATS:
            raise BlobError(f"predictor blob has format {ascii(fmt)}; known formats: {', '.join(FORMATS)}")
        outputs = FORMATS[fmt][1]
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
        if width != outputs:
            wanted = "one output" if outputs == 1 else f"{outputs} outputs (one per draft position)"
            raise BlobError(f"predictor blob does not end in {wanted} as format {fmt} requires; "
                            f"its last layer has {width}")
        if scale.shape != mean.shape:
            raise BlobError(f"predictor blob scaler is malformed: scale {scale.shape} vs mean {mean.shape}")
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
