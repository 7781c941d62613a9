"""Images through the HTTP API: `image_url` parts for `mllm: true` models (real mlx-vlm, tiny LLaVA)."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import config_of
from tests.support.daemon import serving

pytestmark = pytest.mark.usefixtures("vision_extra")


def png_data_url(color: tuple[int, int, int]) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (28, 28), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(model: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": model, "max_tokens": 4, "seed": 1,
            "messages": [{"role": "user", "content": parts}]}


async def test_image_parts_reach_the_vision_model(vision_model: Path, tmp_path: Path) -> None:
    """A base64 PNG in an image_url part is answered by the mllm model; text models and unlisted files refuse images with a 400 naming the field."""
    image_dir = tmp_path / "images"
    image_dir.mkdir()
    cfg = config_of(
        {
            "manager": {"memory_budget_gb": 2},
            "models": [
                {"name": "llava", "path": str(vision_model), "mllm": True,
                 "estimated_memory_gb": 0.01, "image_dir": str(image_dir)},
                {"name": "fake-text", "engine": "fake", "estimated_memory_gb": 0.1},
            ],
        },
        tmp_path,
    )
    parts = [{"type": "text", "text": "What is in the image?"},
             {"type": "image_url", "image_url": {"url": png_data_url((200, 30, 30))}}]
    async with serving(cfg, tmp_path) as s, s.client(timeout=120) as c:
        r = await c.post("/v1/chat/completions", json=chat("llava", parts))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] >= 1
        assert body["usage"]["prompt_tokens"] > 10  # the image's tokens are in the prompt

        r = await c.post("/v1/chat/completions", json=chat("fake-text", parts))
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "messages[0].content[1]"

        outside = tmp_path / "secret.png"
        outside.write_bytes(base64.b64decode(png_data_url((1, 2, 3)).split(",", 1)[1]))
        bad = [parts[0], {"type": "image_url", "image_url": {"url": outside.as_uri()}}]
        r = await c.post("/v1/chat/completions", json=chat("llava", bad))
        assert r.status_code == 400 and "image_url" in (r.json()["error"]["param"] or "")

        inside = image_dir / "ok.png"
        inside.write_bytes(outside.read_bytes())
        good = [parts[0], {"type": "image_url", "image_url": {"url": inside.as_uri()}}]
        r = await c.post("/v1/chat/completions", json=chat("llava", good))
        assert r.status_code == 200, r.text
