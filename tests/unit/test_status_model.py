"""The typed status document both ways: written to the /status JSON and read back from it
(vacancyd.core.jsonshape), and read in-process by the host publisher, which gives the same
lender state as the companion's reading of its JSON."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings

from tests.support.status_docs import documents
from vacancyd.core.jsonshape import JsonShapeError, to_json
from vacancyd.core.lender import lender_from_document, lender_from_status
from vacancyd.core.status import StatusDocument


@settings(max_examples=300, deadline=None)
@given(documents)
def test_the_typed_reading_equals_the_companions_reading_of_the_json(
    doc: StatusDocument,
) -> None:
    assert lender_from_document(doc) == lender_from_status(doc.to_json())


@settings(max_examples=300, deadline=None)
@given(documents)
def test_a_document_read_back_from_its_json_is_the_same_document(doc: StatusDocument) -> None:
    assert StatusDocument.from_json(doc.to_json()) == doc
    # The JSON is plain: it survives a trip through text unchanged.
    assert json.loads(json.dumps(doc.to_json())) == doc.to_json()


@given(documents)
def test_what_the_json_shows_beside_the_fields(doc: StatusDocument) -> None:
    out = doc.to_json()
    for name, up in doc.upstreams.items():
        assert out["upstreams"][name]["lendable"] is up.lendable
        assert ("sleep" in out["upstreams"][name]) is (up.sleep is not None)
    for name, r in doc.resources.items():
        assert out["resources"][name]["lendable"] is r.lendable
        assert "has_bytes" not in out["resources"][name]
    assert ("pools" in out) is bool(doc.pools)
    assert out["durable_state"]["write_errors"] == dict(sorted(doc.write_errors.items()))
    if doc.owner_controls is not None:
        assert out["owner_controls"]["holds"] == [to_json(h) for h in doc.holds]


def test_a_wrong_value_is_named_by_its_path() -> None:
    out = json.loads(json.dumps(StatusDocument.from_json(MINIMAL).to_json()))
    out["presence"]["veto"]["active"] = "yes"
    with pytest.raises(JsonShapeError, match=r"status\.presence\.veto\.active: expected true"):
        StatusDocument.from_json(out)
    with pytest.raises(JsonShapeError, match=r"status: 'presence' is missing"):
        StatusDocument.from_json({k: v for k, v in MINIMAL.items() if k != "presence"})
    bad_quality = {**MINIMAL, "resources": {"gpu0": {**GPU, "quality": "fine"}}}
    with pytest.raises(JsonShapeError, match=r"status\.resources\.gpu0\.quality: 'fine' is not"):
        StatusDocument.from_json(bad_quality)


GPU: dict[str, Any] = {
    "kind": "gpu",
    "enabled": True,
    "quality": "ready",
    "age_s": 1.0,
    "free_mib": 100.0,
    "total_mib": 200.0,
    "utilization_ratio": 0.5,
    "used_mib": 100.0,
    "why_not": None,
    "error": None,
    "held_by": None,
    "pressure": None,
}
MINIMAL: dict[str, Any] = {
    "version": "1",
    "uptime_s": None,
    "ready": True,
    "not_ready": [],
    "lending_enabled": True,
    "presence": {
        "source": "logind",
        "sampled": True,
        "age_s": 1.0,
        "evidence_complete": True,
        "refuses": True,
        "veto": {"active": False, "release_in_s": None},
        "detail": "",
        "sessions": [],
        "session_counts": {},
        "exempt_upstreams": [],
    },
    "resources": {"gpu0": GPU},
    "upstreams": {},
}
