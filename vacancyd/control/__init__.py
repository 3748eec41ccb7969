"""Effects of the yield policy: reclaim execution (spec "Yield")."""
