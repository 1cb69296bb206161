"""Trace data: the loader and its schema (`traces`), the tokenizer every trace is replayed through
(`tokens`), the train/test split (`split`). Imports no other predictor sub-package (storage only)."""
