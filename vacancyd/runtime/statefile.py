"""Atomic JSON documents in the state directory now live in
:mod:`vacancyd.control.statefile` (the control layer writes them); these names stay
importable from here."""

from vacancyd.control.statefile import read_json, remove, write_json

__all__ = ["read_json", "remove", "write_json"]
