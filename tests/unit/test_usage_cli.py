"""``vacancyd usage`` offline: the ledger in the config's state_dir, each --format and --by,
an empty or missing ledger, a bad --since, and the cost with a price."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import time
from pathlib import Path

import pytest

from vacancyd.cli import main
from vacancyd.core.usage import UsageRow
from vacancyd.runtime.usage import USAGE_FILE, UsageStore


def write_config(tmp_path: Path, extra: str = "") -> Path:
    cfg = tmp_path / "vacancyd.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "state"}"\n{extra}\n')
    return cfg


def fill(tmp_path: Path, rows: list[UsageRow]) -> None:
    async def go() -> None:
        store = UsageStore(tmp_path / "state" / USAGE_FILE, retention_days=90)
        await store.open()
        for r in rows:
            await asyncio.wrap_future(store.record(r))
        await store.close()

    asyncio.run(go())


def job(job_id: int, borrower: str, model: str | None, ago_s: float, **kw: object) -> UsageRow:
    now = time.time()  # at the test's start: a slow run must not age the rows out of --since
    values: dict[str, object] = {
        "job_id": job_id,
        "borrower": borrower,
        "upstream": "llm",
        "model": model,
        "resource": "gpu0",
        "started_at": now - ago_s - 60,
        "ended_at": now - ago_s,
        "outcome": "completed",
        "prompt_tokens": 100,
        "completion_tokens": 50,
        "energy_j": 720_000.0,
    }
    values.update(kw)
    return UsageRow(**values)  # type: ignore[arg-type]


def rows() -> list[UsageRow]:
    return [
        job(1, "", "qwen", 60),
        job(2, "friend", "qwen", 120, energy_j=None, prompt_tokens=None, completion_tokens=None),
        job(3, "friend", None, 600),
        job(4, "friend", "qwen", 3 * 86400),  # outside 24h
    ]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    cfg = write_config(tmp_path, "energy_price_per_kwh = 0.25\nenergy_currency = 'EUR'")
    fill(tmp_path, rows())
    return cfg


def test_json_is_exactly_rows_named_after_by(
    ledger: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(["usage", "--config", str(ledger), "--format", "json"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert list(doc) == ["rows"]
    assert doc["rows"] == [
        {
            "borrower": "default",
            "requests": 1,
            "busy_s": 60.0,
            "prompt_tokens": 100,
            "completion_tokens": 50,
            "energy_j": 720000.0,
            "energy_kwh": 0.2,
            "cost": 0.05,
            "currency": "EUR",
        },
        {
            "borrower": "friend",
            "requests": 2,
            "busy_s": 120.0,
            "prompt_tokens": 100,
            "completion_tokens": 50,
            "energy_j": 720000.0,
            "energy_kwh": 0.2,
            "cost": 0.05,
            "currency": "EUR",
        },
    ]


@pytest.mark.parametrize(
    ("by", "keys"),
    [
        ("borrower", ["default", "friend"]),
        ("model", ["qwen", None]),
        ("day", None),  # local days: checked for shape
    ],
)
def test_each_by(
    by: str, keys: list[str | None] | None, ledger: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(
        ["usage", "--config", str(ledger), "--format", "json", "--by", by, "--since", "7d"], capsys
    )
    assert code == 0
    rows = json.loads(out)["rows"]
    assert all(set(r) >= {by, "requests", "busy_s", "prompt_tokens"} for r in rows)
    assert sum(r["requests"] for r in rows) == 4
    if keys is not None:
        assert [r[by] for r in rows] == keys
    else:
        assert all(len(r["day"]) == 10 and r["day"][4] == "-" for r in rows)


def test_since_narrows(ledger: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        ["usage", "--config", str(ledger), "--format", "json", "--since", "5m"], capsys
    )
    assert code == 0
    assert [(r["borrower"], r["requests"]) for r in json.loads(out)["rows"]] == [
        ("default", 1),
        ("friend", 1),
    ]


def test_table_has_a_total_and_the_cost(ledger: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["usage", "--config", str(ledger)], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "BORROWER",
        "REQUESTS",
        "BUSY",
        "S",
        "PROMPT",
        "TOKENS",
        "COMPLETION",
        "TOKENS",
        "ENERGY",
        "KWH",
        "COST",
        "EUR",
    ]
    assert lines[1].split() == ["default", "1", "60.00", "100", "50", "0.2", "0.05"]
    assert lines[2].split() == ["friend", "2", "120.00", "100", "50", "0.2", "0.05"]
    assert lines[3].split() == ["TOTAL", "3", "180.00", "200", "100", "0.4", "0.1"]


def test_csv(ledger: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        ["usage", "--config", str(ledger), "--format", "csv", "--by", "model"], capsys
    )
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert list(rows[0]) == [
        "model",
        "requests",
        "busy_s",
        "prompt_tokens",
        "completion_tokens",
        "energy_j",
        "energy_kwh",
        "cost",
        "currency",
    ]
    assert [(r["model"], r["requests"], r["energy_j"]) for r in rows] == [
        ("qwen", "2", "720000.0"),
        ("", "1", "720000.0"),
    ]


@pytest.mark.parametrize("fmt", ["table", "json", "csv"])
def test_an_empty_ledger(tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path)
    fill(tmp_path, [])
    code, out, err = run(["usage", "--config", str(cfg), "--format", fmt], capsys)
    assert code == 0 and err == ""
    expected = {
        "table": "no borrowed jobs ended since 24h\n",
        "json": '{\n  "rows": []\n}\n',
        "csv": "borrower,requests,busy_s,prompt_tokens,completion_tokens,energy_j,energy_kwh\n",
    }
    assert out == expected[fmt]


def test_an_empty_csv_report_keeps_the_cost_columns_when_priced(
    ledger: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A CSV consumer reads the same columns whether or not a job ended in the window.
    code, out, _ = run(
        ["usage", "--config", str(ledger), "--format", "csv", "--since", "9999-12-31"], capsys
    )
    assert code == 0
    assert out == (
        "borrower,requests,busy_s,prompt_tokens,completion_tokens,energy_j,energy_kwh,"
        "cost,currency\n"
    )


def test_a_table_escapes_control_characters_in_a_borrowers_model_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the model name is whatever the borrower sent: it must not drive the owner's terminal
    cfg = write_config(tmp_path)
    fill(tmp_path, [job(1, "", "\x1b]0;pwned\x07\x1b[31mred\nx", 60), job(2, "", "ünï", 60)])
    code, out, _ = run(["usage", "--config", str(cfg), "--by", "model"], capsys)
    assert code == 0
    assert "\x1b" not in out and "\x07" not in out
    lines = out.splitlines()
    assert len(lines) == 4  # header, two models, total: no line broken by the newline
    assert "\\x1b]0;pwned\\x07\\x1b[31mred\\nx" in out
    assert "ünï" in out


def test_no_ledger_yet_is_empty_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write_config(tmp_path)
    code, out, err = run(["usage", "--config", str(cfg), "--format", "json"], capsys)
    assert code == 0 and json.loads(out) == {"rows": []}
    assert "no usage ledger at" in err


def test_an_unreadable_ledger_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write_config(tmp_path)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / USAGE_FILE).write_bytes(b"garbage" * 500)
    code, out, err = run(["usage", "--config", str(cfg)], capsys)
    assert code == 1 and out == ""
    assert "vacancyd usage: cannot" in err and "--url" in err


@pytest.mark.parametrize("since", ["yesterday", "1y", "-1h", "2027-02-30", "0h"])
def test_a_bad_since_is_a_clear_error(
    tmp_path: Path, since: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write_config(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["usage", "--config", str(cfg), f"--since={since}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--since" in err and repr(since) in err


def test_a_state_dir_it_may_not_search_is_an_error_not_an_empty_ledger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = write_config(tmp_path)
    fill(tmp_path, rows())
    real_stat = Path.stat

    def denied(self: Path, **kw: object) -> object:
        if self.name == USAGE_FILE:
            raise PermissionError(13, "Permission denied")
        return real_stat(self, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "stat", denied)
    code, out, err = run(["usage", "--config", str(cfg)], capsys)
    assert code == 1 and out == ""
    assert "cannot look for" in err and "Permission denied" in err
