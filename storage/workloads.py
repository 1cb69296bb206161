"""The workloads HVD knows. Stored with every event, statistic and override, so the list lives with
the storage layer; the predictor (a feature per workload) and the dashboard both read it here."""
from __future__ import annotations

WORKLOADS: tuple[str, ...] = ("agentic", "code_edit", "coding", "sql", "chat")
