"""Adapters per upstream kind. ``ADAPTERS`` maps the config's ``adapter`` value to one."""

from vacancyd.adapters import comfyui, llamacpp, ollama, openai
from vacancyd.adapters.base import Adapter, BadRequest

ADAPTERS: dict[str, Adapter] = {
    openai.ADAPTER.name: openai.ADAPTER,
    llamacpp.ADAPTER.name: llamacpp.ADAPTER,
    ollama.ADAPTER.name: ollama.ADAPTER,
    comfyui.ADAPTER.name: comfyui.ADAPTER,
}

__all__ = ["ADAPTERS", "Adapter", "BadRequest"]
