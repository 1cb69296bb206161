"""Helpers shared by the test modules, not tests themselves: small seeded gates (`gates`), a
Prometheus /metrics scraper (`scrape`), read-backs of what the code under test wrote (`rows`), and
verbatim slices of the bundled traces with a champion trained on one (`trace_subset`). Test modules import them as `support.<module>` (pytest puts tests/
on sys.path, beside conftest.py).

The TCP fault proxy the outage tests use lives in bench/tcp_proxy.py, since bench/outage.py uses it
too and bench must not import tests/; pytest finds it through `pythonpath = ["bench"]` (pyproject.toml).
"""
