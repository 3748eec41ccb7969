"""vacancyd.core.reach: the newest evidence wins, and old evidence stops counting."""

from __future__ import annotations

from vacancyd.core.reach import Reach


def test_newest_evidence_wins_and_older_evidence_changes_nothing() -> None:
    reach = Reach().learned(True, 10.0)
    assert reach.ok is True and reach.since == 10.0 and not reach.unreachable(10.0, 30.0)
    down = reach.learned(False, 12.0, "connection refused")
    assert down.ok is False and down.since == 12.0 and down.error == "connection refused"
    assert down.unreachable(13.0, 30.0)
    # a check that started before the failure, and finished after it, does not undo it
    assert down.learned(True, 11.0) is down
    still = down.learned(False, 14.0, "connection refused")
    assert still.since == 12.0  # unchanged status keeps its start
    back = still.learned(True, 15.0)
    assert back.ok is True and back.error == "" and not back.unreachable(15.0, 30.0)


def test_no_evidence_or_old_evidence_is_not_a_failure() -> None:
    assert not Reach().unreachable(0.0, 30.0)
    down = Reach().learned(False, 0.0, "timed out")
    assert down.unreachable(30.0, 30.0)
    assert not down.unreachable(30.5, 30.0)
