"""Request metadata (`vllm_xargs`) under hypothesis (derandomized, quick): any JSON value parses
to metadata or raises RequestMetadataError naming the field it refused; nothing else escapes."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from controller.core.request_metadata import (FIELDS, SPECULATE, TENANT, WORKLOAD, RequestMetadata,
                                              RequestMetadataError, parse_request_metadata)
from storage.tenants import normalise_tenant
from storage.workloads import WORKLOADS

FAST = settings(max_examples=400, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                         st.text(max_size=20), st.sampled_from(list(WORKLOADS) + ["Chat", " chat", "true", "false"]))
JSON = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                    max_leaves=8)
KEYS = st.one_of(st.sampled_from([*FIELDS, "hvd_workfload", "hvd_", "session_id", "other"]), st.text(max_size=12))


@FAST
@given(st.one_of(JSON, st.dictionaries(KEYS, JSON, max_size=4)))
@example({"hvd_workload": "poetry"})
@example({"hvd_speculate": "maybe"})
@example({"hvd_speculate": 2})
@example({"hvd_speculate": [1, 2]})
@example({"hvd_tenant": "a\nb"})
def test_any_json_parses_or_is_refused_naming_the_field(extra: object) -> None:
    assert json.loads(json.dumps(extra)) == extra or extra != extra  # what a client can send
    try:
        meta = parse_request_metadata(extra)
    except RequestMetadataError as exc:
        assert exc.field in (*FIELDS, "vllm_xargs") or exc.field.startswith("hvd_")
        assert str(exc).startswith(ascii(exc.field)[1:-1][:40]) and "\n" not in str(exc)
        return
    assert isinstance(extra, dict) or extra is None
    given_ = extra or {}
    assert meta.workload == given_.get(WORKLOAD, "chat") and meta.workload in WORKLOADS
    assert meta.speculate is given_.get(SPECULATE, True)
    assert meta.tenant == normalise_tenant(given_.get(TENANT, "default"))
    assert not any(k.startswith("hvd_") and k not in FIELDS for k in given_)


@pytest.mark.parametrize(("extra", "field", "message"), [
    ({"hvd_workload": "poetry"}, WORKLOAD,
     "hvd_workload must be one of agentic, code_edit, coding, sql, chat; got 'poetry'"),
    ({"hvd_workload": 3}, WORKLOAD, "hvd_workload must be one of agentic, code_edit, coding, sql, chat; got 3"),
    ({"hvd_speculate": "maybe"}, SPECULATE, "hvd_speculate must be a JSON boolean (true or false); got 'maybe'"),
    ({"hvd_speculate": 2}, SPECULATE, "hvd_speculate must be a JSON boolean (true or false); got 2"),
    ({"hvd_speculate": [1, 2]}, SPECULATE, "hvd_speculate must be a JSON boolean (true or false); got [1, 2]"),
    ({"hvd_speculate": 1}, SPECULATE, "hvd_speculate must be a JSON boolean (true or false); got 1"),
    ({"hvd_tenant": "a\nb"}, TENANT, None),
    ({"hvd_tenant": 7}, TENANT, "hvd_tenant must be a string, got int"),
    ({"hvd_workfload": "sql"}, "hvd_workfload",
     "hvd_workfload is not an HVD field; known: hvd_tenant, hvd_workload, hvd_speculate"),
    ([1], "vllm_xargs", "vllm_xargs must be an object, got list"),
])
def test_refusals_name_the_field_and_the_allowed_values(extra, field, message) -> None:
    with pytest.raises(RequestMetadataError) as info:
        parse_request_metadata(extra)
    assert info.value.field == field
    if message is not None:
        assert str(info.value) == message


def test_good_metadata_and_defaults() -> None:
    assert parse_request_metadata(None, "t0", "sql") == RequestMetadata("t0", "sql", True)
    assert parse_request_metadata({"hvd_tenant": "  acme\t ", "hvd_workload": "agentic", "hvd_speculate": False,
                                   "session_id": "x", "temperature": [1]}) == RequestMetadata("acme", "agentic", False)
