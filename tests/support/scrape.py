"""Scraping a Prometheus /metrics page the way a Prometheus server reads it, for the tests that
check the hvd_* metrics of real servers."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset], float]


def scrape(url: str) -> Samples:
    """Every sample of the page, by (name, labels)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples carrying at least `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)
