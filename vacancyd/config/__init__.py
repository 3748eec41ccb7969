"""Configuration: TOML read with tomllib into frozen pydantic v2 models."""

from vacancyd.config.load import ConfigError, load_config, load_default_config, parse_config
from vacancyd.config.model import Settings

__all__ = ["ConfigError", "Settings", "load_config", "load_default_config", "parse_config"]
