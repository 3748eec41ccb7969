"""The lender configuration the Kubernetes tests run: one ``chat`` upstream (openai adapter)
gated on system memory, presence ``headless``, a read token for the companion and a borrow
token for borrowers, on ephemeral loopback ports."""

from __future__ import annotations

READ = "r" * 24
BORROW = "b" * 24


def lender_toml(target: str, kubernetes: str = "") -> str:
    """Config text for ``running_daemon``; ``kubernetes`` is appended verbatim (a
    ``[kubernetes]`` table for host-side publishing)."""
    return f"""
[server]
listen = "127.0.0.1:0"
[[server.tokens]]
name = "reader"
token = "{READ}"
scopes = ["read"]
[[server.tokens]]
name = "borrower"
token = "{BORROW}"
scopes = ["borrow"]
[owner]
presence = "headless"
[collectors]
poll_s = 0.2
[[resource]]
name = "ram"
kind = "memory"
[[upstream]]
name = "chat"
adapter = "openai"
listen = "127.0.0.1:0"
target = "{target}"
resource = "ram"
{kubernetes}
"""
