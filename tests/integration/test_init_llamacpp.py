"""``vacancyd init`` finds a real llama.cpp ``llama-server`` and writes a config that uses the
``llamacpp`` adapter with the model the server reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.component.test_init import init
from tests.support.llamacpp import require_llama_server, running_llama_server
from vacancyd.config import load_config

pytestmark = pytest.mark.llama


async def test_init_finds_a_real_llama_server(tmp_path: Path) -> None:
    require_llama_server()
    async with running_llama_server(tmp_path) as server:
        address = server.base_url.removeprefix("http://")
        path = tmp_path / "vacancyd.toml"
        code, _, err, _ = await init(
            tmp_path, f"--server={address}", f"--config={path}", "--no-gpus"
        )
    assert code == 0, err
    (up,) = load_config(path).upstream
    assert (up.adapter, str(up.target)) == ("llamacpp", f"{server.base_url}/")
    text = path.read_text()
    assert f"{address}: llamacpp" in text
    assert "footprints of" in text  # the model is listed, its footprint left to measure
    assert f"found llamacpp at {address} (1 model(s))" in err
