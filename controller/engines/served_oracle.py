"""The served upper bound: HVD as a perfect cache-draft predictor would serve it (HVD_ORACLE).

How much faster could a better predictor make HVD on the engine itself? The replay engine answers
in simulated milliseconds (`hvd serve --engine replay --oracle`); this answers on vLLM. Greedy
outputs repeat exactly (the bench's methods emit the same tokens), so a first pass recorded with
HVD_RECORD holds every request's output; served again with HVD_ORACLE naming that file, each
request's runtime input carries the output still to come (`RequestInput.continuation`), and the
runtime plans its cache draft with its true accepted length instead of the gate's curve. Only the
cache drafts' survival is known; the model drafter's curve, the costs and the engine are as served.

A request is matched to its recording by its prompt, decoded with the recorder's tokenizer (the
recording keeps the prompt as text; about 0.2 ms once per request, on the decode path, so the bound
is if anything measured a little low). Where the engine's output parts from the recording (another
batch's rounding can flip a near tie) the oracle stops for that request: it would only mislead. The
counts say how much of the traffic the bound covered.

A measurement instrument, not a serving mode: it needs the answers before they are computed."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from predictor.data.traces import TraceFormatError, load_traces


class OracleFileError(ValueError):
    """HVD_ORACLE names a file that holds no usable recording; the message says what is wrong."""


@dataclass
class OracleCounts:
    matched: int = 0  # requests found in the recording
    missing: int = 0  # requests whose prompt the recording does not hold (served without the oracle)
    diverged: int = 0  # matched requests whose output parted from the recording (the oracle stopped there)


def recorded_outputs(path: str | Path) -> dict[str, np.ndarray]:
    """Each recorded prompt's (as text) output token ids, from a file HVD_RECORD wrote."""
    path = Path(path)
    if not path.is_file():
        raise OracleFileError(f"HVD_ORACLE: {path} does not exist (record it first: serve the same prompts with "
                              f"HVD_RECORD={path})")
    try:
        records, _ = load_traces([path])
    except TraceFormatError as exc:
        raise OracleFileError(f"HVD_ORACLE: {exc}") from exc
    out: dict[str, np.ndarray] = {}
    for r in records:
        if r.engine is None or not isinstance(r.context, str):
            raise OracleFileError(f"HVD_ORACLE: {path}: trace {r.trace_id!r} was not recorded by the engine "
                                  f"(HVD_RECORD writes a plain-text context and engine.output_ids)")
        ids = np.asarray(r.engine.output_ids, dtype=np.int32)
        known = out.get(r.context)
        if known is not None and not np.array_equal(known[: len(ids)], ids[: len(known)]):
            raise OracleFileError(f"HVD_ORACLE: {path}: trace {r.trace_id!r} records another output for a prompt "
                                  f"recorded before (greedy outputs repeat; was it sampled?)")
        if known is None or len(ids) > len(known):
            out[r.context] = ids
    if not out:
        raise OracleFileError(f"HVD_ORACLE: {path} holds no recorded request")
    return out


class ServedOracle:
    """Per running request, the recorded output still to come, while the engine's output follows it."""

    def __init__(self, outputs: dict[str, np.ndarray], decode: Callable[[np.ndarray], str],
                 observe: Callable[[str], None] | None = None) -> None:
        self._outputs = outputs
        self._decode = decode
        self._observe = observe  # told each outcome as it happens (the Prometheus counter)
        self._running: dict[str, np.ndarray | None] = {}  # None: missing from the recording, or diverged
        self.counts = OracleCounts()

    def _count(self, outcome: str) -> None:
        setattr(self.counts, outcome, getattr(self.counts, outcome) + 1)
        if self._observe is not None:
            self._observe(outcome)

    def continuation(self, req_id: str, prompt: np.ndarray | None, new: Sequence[int],
                     emitted: int) -> np.ndarray | None:
        """The output still to come after `new` (the tokens the request emitted this step, after
        `emitted` earlier ones); None where the recording cannot say. `prompt` on first sight."""
        rec = self._running.get(req_id, False)
        if rec is False:
            rec = self._outputs.get(self._decode(prompt)) if prompt is not None else None
            self._count("missing" if rec is None else "matched")
            self._running[req_id] = rec
        if rec is None:
            return None
        end = emitted + len(new)
        if end > len(rec) or rec[emitted:end].tolist() != list(new):
            self._count("diverged")
            self._running[req_id] = None
            return None
        return rec[end:]

    def forget(self, req_id: str) -> None:
        self._running.pop(req_id, None)
