"""Learning while serving: the online learner (`learner`), its promotion rule (`promotion`), the
per-workload promotion (`workload_promotion`) on counterfactual replay (`counterfactual`), and the
fitting of fast calibrations (`calibrator`). May import predictor.data, .drafting, .gate, .decision,
.replay, .evaluation and storage."""
