"""The owner's return is a chain of direct calls (ARCHITECTURE.md, "The owner's return"):
the state's writers that can raise a reclaim edge return it, and only the control layer's
owner controls and reclaimer call them, so no edge is raised without being answered."""

from __future__ import annotations

import re
from pathlib import Path

import vacancyd

#: SharedState's writers whose result is a reclaim edge to answer.
EDGE_WRITERS = (
    "record_presence",
    "record_presence_failure",
    "record_pressure",
    "record_pressure_failure",
    "record_capacity",
    "set_holds",
    "raise_edge",
)
#: Where they may be called from: the state itself, and the callers that answer the edges.
ANSWERED_IN = {"state.py", "control/owner.py", "control/reclaim.py"}

CALL = re.compile(r"\bstate\.(" + "|".join(EDGE_WRITERS) + r")\b(?!_)")


def test_only_the_owner_controls_and_the_reclaimer_call_the_writers_that_raise_edges() -> None:
    root = Path(vacancyd.__file__).parent
    stray = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        if where in ANSWERED_IN:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if CALL.search(line):
                stray.append(f"vacancyd/{where}:{number}: {line.strip()}")
    assert not stray, (
        "a reclaim edge these raise would go unanswered; call the owner controls' or the "
        f"reclaimer's entry instead: {stray}"
    )


def test_the_pattern_finds_a_stray_call() -> None:
    assert CALL.search("        self.state.record_presence(reading, now)")
    assert CALL.search("on_sample=state.record_capacity,")
    assert not CALL.search("on_error = partial(state.record_capacity_failure, name)")
