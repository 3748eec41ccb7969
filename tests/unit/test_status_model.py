"""The typed status document read both ways: in-process by the host publisher, and as the
companion reads its /status JSON; both give the same lender state."""

from __future__ import annotations

from hypothesis import given, settings

from tests.support.status_docs import documents
from vacancyd.core.lender import lender_from_document, lender_from_status
from vacancyd.core.status import StatusDocument


@settings(max_examples=300, deadline=None)
@given(documents)
def test_the_typed_reading_equals_the_companions_reading_of_the_json(
    doc: StatusDocument,
) -> None:
    assert lender_from_document(doc) == lender_from_status(doc.to_json())
