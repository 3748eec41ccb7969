"""Adapters per upstream kind. ``ADAPTERS`` maps the config's ``adapter`` value to one."""

from vacancyd.adapters import llamacpp, openai
from vacancyd.adapters.base import Adapter, BadRequest

ADAPTERS: dict[str, Adapter] = {
    openai.ADAPTER.name: openai.ADAPTER,
    llamacpp.ADAPTER.name: llamacpp.ADAPTER,
}

__all__ = ["ADAPTERS", "Adapter", "BadRequest"]
