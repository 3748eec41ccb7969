"""The gated reverse proxy: one aiohttp listener per ``[[upstream]]``."""
