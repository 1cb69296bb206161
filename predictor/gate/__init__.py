"""The gate g_theta: the MLP and its numpy inference path (`mlp`), training (`training`), the
version registry (`registry`: store, load, promote, aliases), the serving side of fast calibration
(`calibration`) and the labelled drafts as arrays (`batch`). May import predictor.drafting,
predictor.data and storage."""
