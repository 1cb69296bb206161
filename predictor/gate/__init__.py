"""The gate g_theta: the MLP and its numpy inference path (`mlp`), training (`training`), the
version registry (`registry`: store, load, promote, aliases), the serving side of fast calibration
(`calibration`), the labelled drafts as arrays (`batch`) and the training configuration (`config`,
light enough for `hvd --help`). May import predictor.drafting and storage."""
