"""Effects of the yield policy: reclaim execution (docs/reclaim.md)."""
