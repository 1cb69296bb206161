"""Trace data: the loader and its schema (`traces`), the tokenizer every trace is replayed through
(`tokens`), the train/test split (`split`), each source's head of whole sessions (`streams`). Imports no other predictor sub-package (storage only)."""
