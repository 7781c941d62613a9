"""Images through Ollama's API: ``messages[].images`` (base64) for ``mllm: true`` models (real mlx-vlm, tiny LLaVA)."""

from __future__ import annotations

import base64
from pathlib import Path

import ollama
import pytest

from tests.integration.conftest import config_of
from tests.integration.test_vision_http import png_data_url
from tests.support.daemon import serving
from tests.support.official import run

pytestmark = pytest.mark.usefixtures("vision_extra")


def png(color: tuple[int, int, int]) -> bytes:
    return base64.b64decode(png_data_url(color).split(",", 1)[1])


async def test_ollama_images_reach_the_vision_model(vision_model: Path, tmp_path: Path) -> None:
    """The official client's images (chat and generate) are answered by the mllm model, whose
    show says vision; a text model refuses images with a 400 naming the field."""
    cfg = config_of({"manager": {"memory_budget_gb": 2},
                     "models": [{"name": "llava", "path": str(vision_model), "mllm": True,
                                 "estimated_memory_gb": 0.01},
                                {"name": "fake-text", "engine": "fake", "estimated_memory_gb": 0.1}]},
                    tmp_path)
    async with serving(cfg, tmp_path) as s:
        c = ollama.Client(host=s.url, timeout=120)
        s.on_close(c.close)
        assert (await run(lambda: c.show("llava"))).capabilities == ["completion", "vision"]
        ask = [{"role": "user", "content": "What is in the image?", "images": [png((200, 30, 30))]}]
        r = await run(lambda: c.chat("llava", ask, options={"num_predict": 4, "seed": 1}))
        assert r.done and r.eval_count and r.prompt_eval_count and r.prompt_eval_count > 10  # image tokens
        g = await run(lambda: c.generate("llava", "Describe it", images=[png((0, 0, 200))],
                                         options={"num_predict": 4}))
        assert g.done and g.eval_count
        with pytest.raises(ollama.ResponseError) as e:
            await run(lambda: c.chat("fake-text", ask))
        assert e.value.status_code == 400 and "messages[0].images" in e.value.error
        plain = base64.b64encode(png((1, 2, 3))).decode()
        async with s.client() as h:
            r2 = await h.post("/api/chat", json={"model": "llava", "stream": False, "options": {"num_predict": 2},
                                                  "messages": [{"role": "user", "content": "x", "images": [plain]}]})
        assert r2.status_code == 200 and r2.json()["done"] is True, r2.text
