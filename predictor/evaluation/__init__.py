"""Offline evaluation: the policy simulator (`simulator`), the `hvd eval` report (`report`), the gate's
precision/recall and calibration (`gate_quality`), the single-drafter baselines priced from served
drafts (`baselines`). May import predictor.data, .drafting, .gate, .decision, .replay and storage."""
