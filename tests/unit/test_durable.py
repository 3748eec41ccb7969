"""Durable state files: atomic, versioned, and clear about what is wrong with a bad one."""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path

import pytest

from vacancyd.core.residency import ContextKey, ContextLearning
from vacancyd.runtime import durable, learned

V1 = frozenset({1})


def test_round_trip_and_absent(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "x.json"
    assert durable.read_state(path, V1) is None
    durable.write_state(path, {"version": 1, "a": [1, 2]})
    assert durable.read_state(path, V1) == {"version": 1, "a": [1, 2]}
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]  # no temporary left


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ('{"version": 1, "a": [1, 2', "corrupt or truncated"),
        ("", "corrupt or truncated"),
        ("[1, 2]", "not a JSON object"),
        ("null", "not a JSON object"),  # unusable, not read as "no file" (no pause, no holds)
        ('{"version": 7}', "newer vacancyd (format version 7; this one reads up to 1)"),
        ('{"version": "one"}', "unknown format version 'one'"),
        ('{"a": 1}', "unknown format version None"),
    ],
)
def test_unusable_files_name_the_file_and_say_why(tmp_path: Path, content: str, why: str) -> None:
    path = tmp_path / "x.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(durable.StateFileError) as caught:
        durable.read_state(path, V1)
    assert caught.value.path == path
    assert why in str(caught.value) and str(path) in str(caught.value)


def test_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.mkdir()  # a directory where the file should be: reading fails
    with pytest.raises(durable.StateFileError, match="cannot be read"):
        durable.read_state(path, V1)
    path.rmdir()
    path.write_bytes(b"\xff\xfe{")
    with pytest.raises(durable.StateFileError, match="cannot be read"):
        durable.read_state(path, V1)


def test_a_full_disk_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "x.json"
    durable.write_state(path, {"version": 1, "old": True})

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as caught:
        durable.write_state(path, {"version": 1, "old": False})
    assert caught.value.errno == errno.ENOSPC
    assert json.loads(path.read_text()) == {"version": 1, "old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_a_read_only_directory_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def read_only(*args: object, **kw: object) -> tuple[int, str]:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(OSError, match="Read-only"):
        durable.write_state(tmp_path / "x.json", {"version": 1})


def test_learning_serialisation_and_malformed_entries() -> None:
    learning = ContextLearning(
        contexts={ContextKey("d" * 64, None, "api"): 4096, ContextKey("d" * 64, 2048, "v1"): 8192},
        modelfile_num_ctx={"d" * 64: None, "e" * 64: 8192},
    )
    data = learned.learning_to_json("up", learning)
    assert learned.learning_from_json(json.loads(json.dumps(data))) == learning
    bad = dict(data, contexts=[{"digest": "d", "num_ctx": None, "dialect": "grpc", "loads": 1}])
    with pytest.raises(ValueError, match=r"contexts\[0\].dialect"):
        learned.learning_from_json(bad)
    with pytest.raises(ValueError, match="loads"):
        learned.learning_from_json(
            dict(data, contexts=[{"digest": "d", "num_ctx": 1, "dialect": "api", "loads": -1}])
        )
    with pytest.raises(ValueError, match="priors"):
        learned.priors_from_json({"version": 1, "priors": {"m": "lots"}})
    assert learned.priors_from_json(learned.priors_to_json("up", {"m": 12})) == {"m": 12}


def test_holds_serialisation_and_malformed_entries() -> None:
    from vacancyd.core.ledger import Admitted
    from vacancyd.core.lifecycle import Hold, HoldReason, JobPhase, JobState, ReleaseBy

    job = JobState(
        Admitted(3, "up", ("gpu0",), 100.0, "m", borrower="friend"),
        phase=JobPhase.HELD,
        hold=Hold(HoldReason.CUT_UNCERTAIN, 90.0, ReleaseBy.ADMIN),
    )
    data = learned.holds_to_json([job], {3: 512}, mono_now=100.0, wall_now=1_000.0)
    (saved,) = learned.holds_from_json(json.loads(json.dumps(data)))
    assert saved.borrower == "friend", "a held job is still its borrower's after a restart"
    old = {k: v for k, v in data["holds"][0].items() if k != "borrower"}
    assert learned.holds_from_json({"holds": [old]})[0].borrower == "", "files from before"
    assert saved.job == 3 and saved.resources == ("gpu0",) and saved.charged_mib == 512
    assert saved.reason is HoldReason.CUT_UNCERTAIN and saved.release_by is ReleaseBy.ADMIN
    assert saved.held_since == 990.0
    for bad, why in (
        ({"holds": {}}, "not a list"),
        ({"holds": [dict(data["holds"][0], resources=[])]}, "resources"),
        ({"holds": [dict(data["holds"][0], reason="gone")]}, "unknown reason"),
        ({"holds": [dict(data["holds"][0], upstream=None)]}, "upstream"),
        ({"holds": [dict(data["holds"][0], borrower=7)]}, "borrower"),
    ):
        with pytest.raises(ValueError, match=why):
            learned.holds_from_json(bad)


def test_an_oversized_file_is_refused_without_being_read(tmp_path: Path) -> None:
    """A 200 MB file (sparse: no disk used) is refused from its size alone."""
    path = tmp_path / "holds.json"
    with path.open("wb") as f:
        f.truncate(200 * 1024 * 1024)
    with pytest.raises(durable.StateFileError) as caught:
        durable.read_state(path, V1)
    assert "over the 1048576 byte limit" in str(caught.value) and str(path) in str(caught.value)
    assert caught.value.why.startswith(f"is {200 * 1024 * 1024} bytes")


def test_a_fifo_is_refused_instead_of_blocking_the_read(tmp_path: Path) -> None:
    """A FIFO in place of a state file would block startup until something writes to it."""
    import threading

    path = tmp_path / "pause.json"
    os.mkfifo(path)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            durable.read_state(path, V1)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(2)
    if reader.is_alive():  # it blocked: let it go (a writer that closes at once), then fail
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
        pytest.fail("reading a FIFO state file blocked")
    (exc,) = outcome
    assert isinstance(exc, durable.StateFileError) and "not a regular file" in str(exc)


def test_deeply_nested_json_is_an_unusable_file_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    with pytest.raises(durable.StateFileError, match="nested too deeply"):
        durable.read_state(path, V1)


def test_a_write_over_the_limit_fails_and_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    durable.write_state(path, {"version": 1})
    with pytest.raises(OSError) as caught:
        durable.write_state(path, {"version": 1, "big": "x" * durable.MAX_STATE_BYTES})
    assert caught.value.errno == errno.EFBIG and "byte limit" in str(caught.value)
    assert durable.read_state(path, V1) == {"version": 1}


def test_too_many_holds_or_learned_entries_are_refused() -> None:
    hold = {
        "job": 1,
        "upstream": "up",
        "resources": ["ram"],
        "model": None,
        "charged_mib": None,
        "reason": "cut_uncertain",
        "release_by": "admin",
        "detail": "",
        "held_since": 1.0,
    }
    assert len(learned.holds_from_json({"holds": [hold] * learned.MAX_HOLDS})) == 1024
    with pytest.raises(ValueError, match="lists 1025 holds, over the limit of 1024"):
        learned.holds_from_json({"holds": [hold] * (learned.MAX_HOLDS + 1)})
    priors = {f"m{i}": 1 for i in range(learned.MAX_LEARNED_ENTRIES + 1)}
    with pytest.raises(ValueError, match="over the limit"):
        learned.priors_from_json({"priors": priors})
    context = {"digest": "d", "num_ctx": None, "dialect": "api", "loads": 1}
    with pytest.raises(ValueError, match="over the limit"):
        learned.learning_from_json({"contexts": [context] * (learned.MAX_LEARNED_ENTRIES + 1)})


def test_an_oversized_calibration_cache_is_ignored_unread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from vacancyd.runtime import calibration

    path = calibration.cache_path(tmp_path, "gpu0")
    path.parent.mkdir(parents=True)
    with path.open("wb") as f:
        f.truncate(50 * 1024 * 1024)
    assert calibration.load_calibrations(tmp_path, ["gpu0"]) == {}
    assert any("byte limit" in r.getMessage() for r in caplog.records)
