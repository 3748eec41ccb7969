"""Collectors: independent sampling loops writing timestamped observations into state."""
