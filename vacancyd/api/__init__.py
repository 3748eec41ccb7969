"""The API listener: health, readiness, status, metrics and admin switches."""
