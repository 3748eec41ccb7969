"""``[[borrower]]``: named borrowers, each with its own borrow-scope token, and the usage
ledger's top-level keys (docs/borrowers.md)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from vacancyd.config.model.base import FrozenModel, Name, read_secret_file, secret_path
from vacancyd.core.usage import UNNAMED_LABEL

#: The label the unnamed borrower (every ``[[server.tokens]]`` token with the ``borrow``
#: scope, a trusted loopback client without a borrower's token) is shown under; no
#: ``[[borrower]]`` may take it.
RESERVED_BORROWER_NAME = UNNAMED_LABEL
#: Default of ``usage_retention_days``.
DEFAULT_USAGE_RETENTION_DAYS = 90


class BorrowerSettings(FrozenModel):
    """One named borrower: who presents ``token_file``'s token is this borrower.

    ``upstreams``: the upstream or pool names it may use (None: every one).
    ``max_concurrent``: its borrowed jobs at once, over every upstream (None: no cap of its
    own). ``daily_busy_s``: seconds of borrowed busy time per local day (None: no quota).
    """

    name: Name
    token_file: Path
    upstreams: list[Name] | None = None
    max_concurrent: int | None = Field(None, ge=1, le=1024)
    daily_busy_s: float | None = Field(None, gt=0, le=100 * 86400)

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, value: str) -> str:
        if value == RESERVED_BORROWER_NAME:
            raise ValueError(
                f"the name {RESERVED_BORROWER_NAME!r} is the label of the unnamed borrower "
                "(the [[server.tokens]] borrow tokens); choose another"
            )
        return value

    def secret(self, credentials: Path | None = None) -> str:
        """The borrower's token, read from ``token_file`` (from ``credentials`` when the
        service was passed it: :func:`secret_path`). Raises ValueError if it cannot be used."""
        return read_secret_file(secret_path(self.token_file, credentials))
