"""Pure decision logic: no I/O, no clocks, no event loop.

Everything here takes time as an argument (monotonic seconds) and returns values.
"""
