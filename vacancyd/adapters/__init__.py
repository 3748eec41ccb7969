"""Adapters per upstream kind. ``ADAPTERS`` maps the config's ``adapter`` value to one."""

from vacancyd.adapters import comfyui, llamacpp, ollama, openai, vllm
from vacancyd.adapters.base import Adapter, BadRequest

ADAPTERS: dict[str, Adapter] = {
    openai.ADAPTER.name: openai.ADAPTER,
    llamacpp.ADAPTER.name: llamacpp.ADAPTER,
    ollama.ADAPTER.name: ollama.ADAPTER,
    comfyui.ADAPTER.name: comfyui.ADAPTER,
    vllm.ADAPTER.name: vllm.ADAPTER,
}

__all__ = ["ADAPTERS", "Adapter", "BadRequest"]
