"""vacancyd: lend an idle GPU without costing its owner."""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("vacancyd")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
