"""Online learning of g_theta from hindsight labels, with drift detection, in river's two verbs:
`learn_many(batch)` and `predict_many(features)` (the challenger's predictions).

The learner keeps a challenger (a trainable copy of the champion, of the champion's kind) and
updates it in mini-batches of new labelled cache drafts mixed with a replay buffer sampled evenly
across workloads, so one busy workload does not erase what the others taught; a survival gate
learns with the censored loss of predictor.gate.training, a point gate with squared error. Every
event is first scored by both models (by their predicted lengths) before the challenger learns from
it (`shadow`: predictor.online.promotion.ShadowWindow); whether that earns a promotion is the policy's
call (predictor.online.promotion.PromotionPolicy), acting on it the caller's. A per-workload ADWIN on
the champion's error flags drift; the learner then takes larger steps for a while. Deterministic
under a seed: the same events in the same order give the same models and the same shadow scores.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from river import drift

from predictor.drafting.features import NUM_FEATURES
from predictor.gate.batch import Batch
from predictor.gate.mlp import DRAFT_LEN_COLUMN, MLP, GatePredictor
from predictor.gate.training import censored_bce
from predictor.online.calibrator import CalibrationConfig
from predictor.online.counterfactual import CounterfactualPolicy
from predictor.online.promotion import GoodputFn, PromotionPolicy, ShadowWindow
from storage.workloads import WORKLOADS


@dataclass(frozen=True)
class LearnerConfig:
    seed: int = 0
    batch_size: int = 256  # new events per update
    replay_ratio: float = 1.0  # replayed rows per new row
    buffer_per_workload: int = 20_000
    learning_rate: float = 1e-4
    drift_boost: float = 4.0  # learning-rate multiplier right after a drift
    boost_updates: int = 40
    adwin_delta: float = 0.002
    drift_chunk: int = 200  # ADWIN sees the mean error of each chunk of a workload's events
    window: int = 20_000  # shadow-scoring window (events)
    promotion: PromotionPolicy = field(default_factory=PromotionPolicy)  # the whole-stream rule (point champions)
    counterfactual: CounterfactualPolicy = field(default_factory=CounterfactualPolicy)  # per workload (survival)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)  # the fast path beside this one


@dataclass
class DriftSignal:
    workload: str
    events_seen: int
    error_mean: float


@dataclass
class LearnResult:
    events: int = 0
    updates: int = 0
    drifts: list[DriftSignal] = field(default_factory=list)


class OnlineLearner:
    def __init__(self, champion: GatePredictor, goodput: GoodputFn, config: LearnerConfig | None = None) -> None:
        self.config = config or LearnerConfig()
        torch.manual_seed(self.config.seed)
        self._rng = np.random.default_rng(self.config.seed)
        self.champion = champion
        self._start_challenger(champion)
        self._buffers = {w: _Reservoir(self.config.buffer_per_workload, NUM_FEATURES, self._rng) for w in range(len(WORKLOADS))}
        self._adwin = {w: drift.ADWIN(delta=self.config.adwin_delta, clock=1) for w in range(len(WORKLOADS))}
        self._pending_errors: dict[int, list[float]] = {}
        self.shadow = ShadowWindow(goodput, self.config.window)
        self.since_promotion = 0  # events learned since the champion last changed
        self._boost = 0
        self.events_seen = 0
        self.updates = 0

    def _start_challenger(self, champion: GatePredictor) -> None:
        # vLLM builds its plugins under torch.inference_mode(); tensors made there can never train.
        with torch.inference_mode(False):
            self.model = _to_torch(champion)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=self.config.learning_rate)

    def challenger(self) -> GatePredictor:
        return GatePredictor.from_torch(self.model, self.champion.schema_hash)

    def adopt(self, champion: GatePredictor) -> None:
        """A new champion (promoted here, or moved by an operator's rollback): score against it. A
        champion of the other kind restarts the challenger from it, so the two stay comparable."""
        if champion.kind != self.model.kind:
            self._start_challenger(champion)
        self.champion = champion
        self.shadow.clear()
        self.since_promotion = 0

    def predict_many(self, features: np.ndarray) -> np.ndarray:
        return self.challenger().predict(features)

    def learn_many(self, batch: Batch, train: Batch | None = None) -> LearnResult:
        """Score and watch for drift on the new drafts `batch`; learn from `train` (default: the
        same drafts; predictor.online.workload_promotion holds the newest back for its comparisons)."""
        result = LearnResult(events=len(batch.label))
        if not len(batch.label):
            return result
        self.shadow.add(batch.label, batch.draft_len, batch.tau, batch.workload,
                        self.champion.predict(batch.features), self.predict_many(batch.features))
        result.drifts = self._detect_drift(batch)
        if result.drifts:
            self._boost = self.config.boost_updates
        self.events_seen += len(batch.label)
        self.since_promotion += len(batch.label)
        batch = batch if train is None else train
        for w in np.unique(batch.workload):
            sel = batch.workload == w
            self._buffers[int(w)].add(batch.features[sel], batch.label[sel])
        for start in range(0, len(batch.label), self.config.batch_size):
            end = start + self.config.batch_size
            self._update(batch.features[start:end], batch.label[start:end])
            result.updates += 1
        return result

    # ---------------------------------------------------------------- internals
    def _detect_drift(self, batch: Batch) -> list[DriftSignal]:
        """ADWIN per workload on the champion's mean absolute error over chunks of events: drafts
        of one request are strongly correlated, and ADWIN on single events raises false alarms."""
        errors = np.abs(self.champion.predict(batch.features) - batch.label)
        signals = []
        for w in np.unique(batch.workload).tolist():
            pending = self._pending_errors.setdefault(w, [])
            pending.extend(errors[batch.workload == w].tolist())
            while len(pending) >= self.config.drift_chunk:
                chunk, pending[:] = pending[: self.config.drift_chunk], pending[self.config.drift_chunk :]
                detector = self._adwin[w]
                detector.update(float(np.mean(chunk)))
                if detector.drift_detected:
                    signals.append(DriftSignal(WORKLOADS[w], self.events_seen, float(detector.estimation)))
        return signals

    def _update(self, x_new: np.ndarray, y_new: np.ndarray) -> None:
        cfg = self.config
        n_replay = int(round(len(y_new) * cfg.replay_ratio))
        filled = [b for b in self._buffers.values() if b.size]
        xs, ys = [x_new], [y_new]
        if n_replay and filled:
            per = max(1, n_replay // len(filled))
            for buf in filled:
                x, y = buf.sample(per)
                xs.append(x)
                ys.append(y)
        x = torch.from_numpy(np.concatenate(xs).astype(np.float32))
        y = torch.from_numpy(np.concatenate(ys).astype(np.float32))
        lr = cfg.learning_rate * (cfg.drift_boost if self._boost > 0 else 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._boost = max(0, self._boost - 1)
        with torch.inference_mode(False), torch.enable_grad():
            self.model.train()
            if self.model.kind == "survival":
                loss = censored_bce(self.model(x), x[:, DRAFT_LEN_COLUMN], y)
            else:
                loss = ((self.model(x) - y) ** 2).mean()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.model.eval()
        self.updates += 1


class _Reservoir:
    """Uniform sample of everything a workload ever contributed (reservoir sampling)."""

    def __init__(self, capacity: int, width: int, rng: np.random.Generator) -> None:
        self.x = np.zeros((capacity, width), dtype=np.float32)
        self.y = np.zeros(capacity, dtype=np.float32)
        self.capacity, self.size, self.seen, self.rng = capacity, 0, 0, rng

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        for row, label in zip(x, y):
            if self.size < self.capacity:
                self.x[self.size], self.y[self.size] = row, label
                self.size += 1
            else:
                j = int(self.rng.integers(0, self.seen + 1))
                if j < self.capacity:
                    self.x[j], self.y[j] = row, label
            self.seen += 1

    def sample(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        idx = self.rng.integers(0, self.size, size=n)
        return self.x[idx], self.y[idx]


def _to_torch(gate: GatePredictor) -> MLP:
    """The champion as a trainable torch module of its kind (same function, same float32 weights)."""
    hidden = tuple(w.shape[1] for w in gate.weights[:-1])
    model = MLP(gate.num_features, hidden, gate.weights[-1].shape[1])
    with torch.no_grad():
        model.mean.copy_(torch.from_numpy(gate.mean))
        model.scale.copy_(torch.from_numpy(gate.scale))
        linears = [m for m in model.net if isinstance(m, torch.nn.Linear)]
        for layer, w, b in zip(linears, gate.weights, gate.biases):
            layer.weight.copy_(torch.from_numpy(np.ascontiguousarray(w.T)))
            layer.bias.copy_(torch.from_numpy(b))
    model.eval()
    return model


def batch_from_events(events: Sequence, tau_of: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Batch:
    """Cache-drafter events that carry features -> arrays. `tau_of(draft_len, workload)` fills in
    the threshold for drafts that were never held to one (shadow drafts)."""
    rows = [e for e in events if e.drafter == "cache" and e.features]
    if not rows:
        empty = np.zeros(0)
        return Batch(np.zeros((0, NUM_FEATURES), np.float32), empty.astype(np.float32), empty.astype(int),
                     empty.astype(int), empty, np.zeros(0, dtype=object), np.zeros(0, dtype=bool),
                     np.zeros(0, dtype=object), empty.astype(np.int64))
    x = np.frombuffer(b"".join(e.features for e in rows), dtype=np.float32).reshape(len(rows), NUM_FEATURES)
    k = np.array([e.draft_len for e in rows], dtype=np.int64)
    w = np.array([WORKLOADS.index(e.workload) for e in rows], dtype=np.int64)
    tau = np.array([np.nan if e.tau is None else e.tau for e in rows], dtype=np.float64)
    missing = ~np.isfinite(tau)
    if missing.any():
        tau[missing] = tau_of(k[missing], w[missing])
    return Batch(x.copy(), np.array([e.accepted for e in rows], dtype=np.float32), k, w, tau,
                 np.array([e.tenant for e in rows], dtype=object), np.array([e.decision != "shadow" for e in rows]),
                 np.array([e.request_id for e in rows], dtype=object),
                 np.array([e.position for e in rows], dtype=np.int64))
