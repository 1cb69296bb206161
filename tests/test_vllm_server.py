"""`hvd serve --engine vllm` end to end: the real OpenAI-compatible server answers a completion
request carrying tenant/workload metadata, and that request's events reach SQL under them; bad
metadata is an HTTP 400 naming the field; vLLM's /metrics shows the hvd_* metrics beside its own."""
from __future__ import annotations

import json
import time
import urllib.error

import pytest

from storage.engine import make_engine, session_scope
from storage.events import list_events
from storage.stats import verified_tokens

from support.scrape import scrape, total
from support.trace_subset import champion_database
from support.vllm_server import post, start, stop


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    db = champion_database(folder, {"medagentbench-agentbench-pr171": 20, "aider-chat-history": 10})
    proc, base = start(folder, db)
    try:
        yield base, db
    finally:
        stop(proc)


def test_completion_with_metadata_reaches_sql(server):
    base, db = server
    prompt = ("GET http://localhost:8080/fhir/Patient?identifier=S6534835\n"
              "GET http://localhost:8080/fhir/Patient?identifier=S6534835\n" * 3)
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 32, "temperature": 0,
            "vllm_xargs": {"hvd_tenant": "acme", "hvd_workload": "agentic"}}
    answer = post(base + "/v1/completions", body)
    assert answer["choices"][0]["text"]
    assert answer["usage"]["completion_tokens"] == 32
    engine = make_engine(db)
    deadline = time.time() + 30
    events = []
    while time.time() < deadline and not events:
        with session_scope(engine) as session:
            events = list_events(session, tenant="acme")
        time.sleep(0.5)
    assert events, "no events under tenant acme reached SQL"
    assert {e.workload for e in events} == {"agentic"}
    assert any(e.drafter == "cache" for e in events)


def _status(url: str, body: dict) -> tuple[int, dict]:
    try:
        return 200, post(url, body)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize(("xargs", "field"), [
    ({"hvd_workload": "poetry"}, "hvd_workload"),
    ({"hvd_speculate": "maybe"}, "hvd_speculate"),
    ({"hvd_speculate": 2}, "hvd_speculate"),
    ({"hvd_speculate": [1, 2]}, "hvd_speculate"),
    ({"hvd_tenant": "a\nb"}, "hvd_tenant"),
])
def test_bad_metadata_is_http_400_naming_the_field(server, xargs, field):
    base, _ = server
    for path, body in (("/v1/completions", {"prompt": "GET /fhir"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        status, answer = _status(base + path, {"model": "smollm2", "max_tokens": 4, "vllm_xargs": xargs, **body})
        assert status == 400, answer
        assert answer["error"]["param"] == field and answer["error"]["message"].startswith(field), answer


def test_good_metadata_with_opt_out_still_served(server):
    base, _ = server
    status, answer = _status(base + "/v1/completions", {
        "model": "smollm2", "prompt": "GET /fhir", "max_tokens": 4, "temperature": 0,
        "vllm_xargs": {"hvd_tenant": "acme", "hvd_workload": "sql", "hvd_speculate": False}})
    assert status == 200 and answer["usage"]["completion_tokens"] == 4, answer


def test_metrics_show_hvd_beside_vllm(server):
    """vLLM's own /metrics (its API server process) carries the hvd_* series the runtime counts in
    vLLM's worker process: a request's decisions, and token counts equal to its events in SQL."""
    base, db = server
    prompt = "SELECT name FROM singer WHERE age > 20;\nSELECT name FROM singer WHERE age > 20;\n" * 3
    answer = post(base + "/v1/completions", {
        "model": "smollm2", "prompt": prompt, "max_tokens": 24, "temperature": 0,
        "vllm_xargs": {"hvd_tenant": "metrics-co", "hvd_workload": "sql"}})
    generated = answer["usage"]["completion_tokens"]
    mine = {"tenant": "metrics-co", "workload": "sql"}
    engine = make_engine(db)
    deadline = time.time() + 30
    while True:  # the event writer stores what the metrics counted as it was queued: wait for it
        samples = scrape(base + "/metrics")
        with session_scope(engine) as session:
            stored = [verified_tokens(e) for e in list_events(session, tenant="metrics-co")]
        draft = total(samples, "hvd_draft_tokens_total", **mine)
        if (draft, total(samples, "hvd_accepted_tokens_total", **mine)) == \
                (sum(d for d, _ in stored), sum(a for _, a in stored)) or time.time() > deadline:
            break
        time.sleep(0.5)
    assert any(name.startswith("vllm:") for name, _ in samples), "vLLM's own metrics missing from the scrape"
    assert total(samples, "vllm:generation_tokens_total") >= generated
    decisions = total(samples, "hvd_decisions_total", **mine)
    assert 1 <= decisions <= generated  # one per step of the request; every step emits a token
    assert draft == sum(d for d, _ in stored) and total(samples, "hvd_accepted_tokens_total", **mine) \
        == sum(a for _, a in stored), (samples, stored)
    for drafter in ("cache", "model"):
        d = total(samples, "hvd_draft_tokens_total", drafter=drafter)
        a = total(samples, "hvd_accepted_tokens_total", drafter=drafter)
        assert 0 <= a <= d and total(samples, "hvd_rejected_tokens_total", drafter=drafter) == d - a
    assert total(samples, "hvd_decisions_total", workload="sql") >= decisions
    assert total(samples, "hvd_draft_tokens_total") > 0
    assert total(samples, "hvd_gate_outcomes_total") > 0  # its repeated lines drafted from the cache
    assert total(samples, "hvd_champion_version") == total(samples, "hvd_predictor_version", workload="sql") == 1
    assert total(samples, "hvd_events_dropped_total") == 0 and total(samples, "hvd_event_queue_depth") >= 0

