"""What every subcommand shares: loading the config and saying things on stderr."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vacancyd.config import Settings, load_config, load_default_config

DEFAULT_URL = "http://127.0.0.1:9470"  # vacancyd.runtime.apitarget.DEFAULT_URL


def _load(path: Path | None) -> Settings:
    return load_default_config() if path is None else load_config(path)


def _configure_logging(args: argparse.Namespace) -> bool:
    """Set up logging from --log-level/--log-format; False (after saying why) when invalid."""
    from vacancyd.runtime import logging as vlogging

    try:
        vlogging.configure(args.log_level, args.log_format)
    except ValueError as exc:
        print(f"vacancyd: {exc}", file=sys.stderr)
        return False
    return True


def _say(args: argparse.Namespace, level: str, message: str) -> None:
    """One line on stderr in the chosen log format (JSON lines stay JSON)."""
    if args.log_format == "json":
        line = json.dumps({"level": level, "name": "vacancyd", "message": message})
    else:
        line = f"vacancyd: {message}"
    print(line, file=sys.stderr)
