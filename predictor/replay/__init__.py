"""Offline replay of traces through the drafter and hindsight (`trace_replay`), its on-disk cache
(`trace_replay_cache`), and the replayed, split dataset (`dataset`). May import predictor.data,
predictor.drafting and storage."""
