"""``vacancyd usage``: what was lent, to whom, from the usage ledger (docs/borrowers.md).

Offline (the default) it opens the ledger file in the config's ``state_dir`` read-only; with
``--url``, ``--token``, ``--token-file`` or ``--ca-file`` it asks the running daemon's
``GET /usage`` (read scope) instead. Either way it prints one row per group of ``--by``:
requests, busy seconds, prompt and completion tokens, energy in J and kWh, and the cost when
the config sets ``energy_price_per_kwh``.
"""

from __future__ import annotations

import argparse
import csv
import http.client
import io
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from vacancyd.cli.apiclient import _client_tls, _http_refusal, _opener, _target, _unreachable
from vacancyd.core.usage import GROUP_BY, Since, groups_from_rows, parse_since, report_rows

FORMATS = ("table", "json", "csv")
#: The config ``vacancyd usage`` reads offline when none is given and it exists.
DEFAULT_CONFIG = Path("/etc/vacancyd/vacancyd.toml")  # vacancyd.runtime.apitarget


def since_arg(text: str) -> Since:
    """An argparse type: a ``--since`` value (:func:`vacancyd.core.usage.parse_since`)."""
    try:
        return parse_since(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_usage(args: argparse.Namespace) -> int:
    """Print the report; 0, 1 when the ledger or the API cannot be read, 2 for a config or
    token that cannot be used."""
    online = any(getattr(args, k, None) for k in ("url", "token", "token_file", "ca_file"))
    answer = _online(args) if online else _offline(args)
    if isinstance(answer, int):
        return answer
    rows, priced = answer
    print(render(rows, args.by, args.format, args.since.text, priced=priced), end="")
    return 0


def _offline(args: argparse.Namespace) -> tuple[list[dict[str, object]], bool] | int:
    from vacancyd.config import ConfigError, load_config, load_default_config
    from vacancyd.runtime.usage import (
        USAGE_FILE,
        LedgerUnreadable,
        ledger_exists,
        read_groups,
        since_wall,
    )

    config = args.config
    if config is None and DEFAULT_CONFIG.is_file():
        config = DEFAULT_CONFIG
    try:
        settings = load_default_config() if config is None else load_config(config)
    except ConfigError as exc:
        print(f"vacancyd usage: {exc}", file=sys.stderr)
        return 2
    path = settings.state_dir / USAGE_FILE
    try:
        exists = ledger_exists(path)
        groups = read_groups(path, since_wall(args.since, time.time()), args.by)
    except LedgerUnreadable as exc:
        print(
            f"vacancyd usage: {exc} (run as a user who may read {settings.state_dir}, or ask "
            "the daemon with --url)",
            file=sys.stderr,
        )
        return 1
    if not exists:
        print(f"vacancyd usage: no usage ledger at {path} yet", file=sys.stderr)
    rows = report_rows(
        groups,
        args.by,
        price_per_kwh=settings.energy_price_per_kwh,
        currency=settings.energy_currency,
    )
    return rows, settings.energy_price_per_kwh is not None


def _online(args: argparse.Namespace) -> tuple[list[dict[str, object]], bool] | int:
    target = _target(args, "read", "usage")
    if isinstance(target, int):
        return target
    tls = _client_tls(args, "usage")
    if isinstance(tls, int):
        return tls
    query = urllib.parse.urlencode({"since": args.since.text, "by": args.by})
    url = f"{target.url}/usage?{query}"
    request = urllib.request.Request(url)
    if target.token:
        request.add_header("Authorization", f"Bearer {target.token}")
    try:
        with _opener(tls).open(request, timeout=30.0) as resp:
            data: Any = json.load(resp)
        if not isinstance(data, dict):
            raise ValueError("the answer is not a JSON object")
        rows = data.get("rows")
        groups_from_rows(rows, args.by)  # the shape is checked before anything is printed
    except urllib.error.HTTPError as exc:
        print(_http_refusal("usage", target.url, exc, target, "read"), file=sys.stderr)
        return 1
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        print(_unreachable("usage", url, exc, "cannot read"), file=sys.stderr)
        return 1
    assert isinstance(rows, list)
    return rows, data.get("energy_price_per_kwh") is not None


COLUMNS = (
    ("requests", "REQUESTS"),
    ("busy_s", "BUSY S"),
    ("prompt_tokens", "PROMPT TOKENS"),
    ("completion_tokens", "COMPLETION TOKENS"),
    ("energy_kwh", "ENERGY KWH"),
)


def render(
    rows: list[dict[str, object]], by: str, fmt: str, since: str, *, priced: bool | None = None
) -> str:
    """``rows`` (:func:`~vacancyd.core.usage.report_rows`) as ``fmt``: ``json`` is exactly
    ``{"rows": rows}``; ``csv`` has a header line of the row keys; ``table`` aligned columns
    with a total line, or a line saying there is nothing since ``since``. ``priced``: whether
    a price is set, so the CSV header has ``cost`` and ``currency`` even without rows (None:
    whether a row has a cost)."""
    if fmt == "json":
        return json.dumps({"rows": rows}, indent=2) + "\n"
    if priced is None:
        priced = any("cost" in r for r in rows)
    if fmt == "csv":
        keys = [by, *(k for k, _ in COLUMNS), "energy_j"]
        keys.insert(keys.index("energy_kwh"), keys.pop())
        if priced:
            keys += ["cost", "currency"]
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=keys, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: "" if r.get(k) is None else r.get(k) for k in keys})
        return out.getvalue()
    if not rows:
        return f"no borrowed jobs ended since {since}\n"
    currency = next((str(r.get("currency") or "") for r in rows if "cost" in r), "")
    header = [by.upper(), *(title for _, title in COLUMNS)]
    if priced:
        header.append(f"COST {currency}".strip())
    table = [header]
    for r in rows:
        table.append([_cell(r.get(by), "-"), *(_cell(r.get(k)) for k, _ in COLUMNS)])
        if priced:
            table[-1].append(_cell(r.get("cost")))
    if len(rows) > 1:
        total = ["TOTAL"]
        for key, _ in COLUMNS + ((("cost", ""),) if priced else ()):
            values = [r.get(key) for r in rows]
            known = [float(v) for v in values if isinstance(v, int | float)]
            total.append(_cell(_sum(known, key) if known else None))
        table.append(total)
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i])
            for i, cell in enumerate(line)
        ).rstrip()
        for line in table
    ]
    return "\n".join(lines) + "\n"


def _sum(values: list[float], key: str) -> float | int:
    total = sum(values)
    return int(total) if key in ("requests", "prompt_tokens", "completion_tokens") else total


def _cell(value: object, none: str = "-") -> str:
    if value is None:
        return none
    if isinstance(value, float):
        return f"{value:.6f}".rstrip("0").rstrip(".") if value < 1 else f"{value:,.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return _printable(str(value))


def _printable(text: str) -> str:
    """``text`` with every character that is not printable (escape sequences, newlines: a
    borrower names its model) written as a ``\\x1b``-style escape, so a table cannot act on
    the owner's terminal or break its lines."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def add_usage(sub: Any) -> None:
    """``vacancyd usage``: its parser (called by :mod:`vacancyd.cli.parser`)."""
    usage = sub.add_parser(
        "usage",
        help="what was lent to whom: requests, busy time, tokens, energy and cost per "
        "borrower, day or model, from the usage ledger",
    )
    usage.add_argument(
        "--config",
        type=Path,
        help="read the ledger in this config's state_dir (default: /etc/vacancyd/vacancyd.toml "
        "when it exists, else the embedded default's); with --url, also where a read token "
        "may come from",
    )
    usage.add_argument(
        "--since",
        type=since_arg,
        default=parse_since("24h"),
        help="jobs that ended in the last 30m, 1h, 24h (default), 7d, 4w..., or since a "
        "date YYYY-MM-DD (local midnight)",
    )
    usage.add_argument("--by", choices=GROUP_BY, default="borrower", help="group rows by")
    usage.add_argument("--format", choices=FORMATS, default="table", help="output format")
    usage.add_argument(
        "--url",
        help="ask the running daemon's API (GET /usage, read scope) instead of reading the file",
    )
    usage.add_argument(
        "--token",
        help="bearer token with the read scope (visible to other users in ps: prefer "
        "--token-file or the VACANCYD_TOKEN environment variable)",
    )
    usage.add_argument("--token-file", type=Path, help="file holding the read-scope token")
    usage.add_argument(
        "--ca-file",
        type=Path,
        help="PEM CA bundle to trust for an https:// API (default: $VACANCYD_CA_FILE, else "
        "the system's CAs)",
    )
    usage.set_defaults(func=cmd_usage)
