"""Wiring: task supervision, logging, and the daemon's lifecycle."""
