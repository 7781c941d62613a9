"""input_image parts of /v1/responses reach a vision (mllm) model; text models refuse them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import config_of
from tests.integration.test_vision_http import png_data_url
from tests.support.daemon import serving

pytestmark = pytest.mark.usefixtures("vision_extra")


async def test_input_image_parts_reach_the_vision_model(vision_model: Path, tmp_path: Path) -> None:
    """A base64 PNG in an input_image part is read by the mllm model (its tokens are in the prompt); a text model's answer is a 400 naming the part."""
    cfg = config_of(
        {"manager": {"memory_budget_gb": 2},
         "models": [{"name": "llava", "path": str(vision_model), "mllm": True,
                     "estimated_memory_gb": 0.01},
                    {"name": "fake-text", "engine": "fake", "estimated_memory_gb": 0.1}]},
        tmp_path,
    )
    text = {"type": "input_text", "text": "What is in the image?"}
    image = {"type": "input_image", "image_url": png_data_url((200, 30, 30))}

    def body(model: str, parts: list[dict[str, str]]) -> dict[str, object]:
        return {"model": model, "max_output_tokens": 4, "seed": 1,
                "input": [{"role": "user", "content": parts}]}

    async with serving(cfg, tmp_path) as s, s.client(timeout=120) as c:
        with_image = await c.post("/v1/responses", json=body("llava", [text, image]))
        assert with_image.status_code == 200, with_image.text
        without = await c.post("/v1/responses", json=body("llava", [text]))
        assert without.status_code == 200, without.text
        assert with_image.json()["usage"]["input_tokens"] > without.json()["usage"]["input_tokens"] + 1
        refused = await c.post("/v1/responses", json=body("fake-text", [text, image]))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "input[0].content[1]"
