"""The mlx-vlm engine on a tiny random LLaVA, and the decoding of OpenAI image parts."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
import trio

from mlxd.config import ModelConfig
from mlxd.engines.base import ChatMessage, GenerationRequest
from mlxd.engines.mlx_vision import MlxVisionEngine
from mlxd.engines.runtime.jobs import GenerationStats
from mlxd.engines.text.images import MAX_IMAGE_BYTES, decode_request_images
from mlxd.errors import InvalidRequest
from tests.engines.mlx_helpers import collect
from tests.support.engines import Recorded

Image = pytest.importorskip("PIL.Image", reason="pillow is not installed")


def png_data_url(color: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(text: str, url: str) -> ChatMessage:
    return ChatMessage(
        "user", [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    )


# ---- images.py (pillow only) -------------------------------------------------------------


def test_data_urls_decode_to_rgb_images() -> None:
    """A base64 PNG data URL decodes to an RGB PIL image of its size."""
    (img,) = decode_request_images([image_message("hi", png_data_url((0, 255, 0), (7, 5)))])
    assert img.mode == "RGB" and img.size == (7, 5)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("https://example.com/cat.png", "unsupported image URL"),
        ("data:image/png;base64,%%%notbase64", "not valid base64"),
        ("data:text/plain;base64,aGVsbG8=", "not an image"),
        (
            "data:image/png;base64," + base64.b64encode(b"not a png").decode(),
            "not a readable image",
        ),
        ("file:///etc/hostname", "local image files are not allowed"),
    ],
)
def test_bad_image_urls_are_invalid_requests_naming_the_field(url: str, message: str) -> None:
    """Each refused image URL is an InvalidRequest whose param points at the part."""
    msgs = [ChatMessage("system", "x"), image_message("hi", url)]
    with pytest.raises(InvalidRequest, match=message) as err:
        decode_request_images(msgs)
    assert err.value.param == "messages[1].content[1].image_url.url"
    assert err.value.http_status == 400


def test_file_urls_only_inside_image_dir(tmp_path: Path) -> None:
    """file:// images are read under the model's image_dir and refused outside it (even via ..)."""
    allowed = tmp_path / "images"
    allowed.mkdir()
    Image.new("RGB", (3, 3)).save(allowed / "a.png")
    Image.new("RGB", (3, 3)).save(tmp_path / "outside.png")
    (img,) = decode_request_images(
        [image_message("x", f"file://{allowed / 'a.png'}")], image_dir=allowed
    )
    assert img.size == (3, 3)
    for escape in [f"file://{tmp_path / 'outside.png'}", f"file://{allowed}/../outside.png"]:
        with pytest.raises(InvalidRequest, match="outside the model's image_dir"):
            decode_request_images([image_message("x", escape)], image_dir=allowed)
    with pytest.raises(InvalidRequest, match="no such image file"):
        decode_request_images(
            [image_message("x", f"file://{allowed / 'missing.png'}")], image_dir=allowed
        )


def test_oversized_images_are_refused() -> None:
    """An encoded image over the byte limit is refused before it is decoded."""
    huge = "data:image/png;base64," + "A" * (MAX_IMAGE_BYTES * 4 // 3 + 100)
    with pytest.raises(InvalidRequest, match="larger than"):
        decode_request_images([image_message("x", huge)])


# ---- the engine (needs the vlm extra) ---------------------------------------------------------


class TokenCounter:
    """An engine observer that sets an event once a generation has produced ``n`` tokens."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.reached = trio.Event()

    def __call__(self, event: str, stats: GenerationStats) -> None:
        if event == "token" and stats.completion_tokens >= self.n:
            self.reached.set()


class RecordedVisionEngine(Recorded, MlxVisionEngine):
    """The mlx-vlm engine, with its generations' stats in ``history``."""


@pytest.fixture
async def vision_engine(vision_model_dir: Path):  # type: ignore[no-untyped-def]
    eng = RecordedVisionEngine(ModelConfig(name="vis", source=str(vision_model_dir), mllm=True))
    await eng.load(lambda _p: None)
    try:
        yield eng
    finally:
        await eng.stop()


@pytest.mark.mlx
async def test_vision_chat_with_a_base64_png(vision_engine: MlxVisionEngine) -> None:
    """A chat with a base64 PNG generates, counts the image tokens, and the image changes the output."""

    async def run(url: str | None) -> tuple[str, int]:
        msg = image_message("what is this?", url) if url else ChatMessage("user", "what is this?")
        req = GenerationRequest(kind="chat", messages=(msg,), max_tokens=12, temperature=0.0)
        text, fin, _ = await collect(vision_engine, req)
        assert fin.finish_reason in ("length", "stop") and fin.completion_tokens >= 1
        return text, fin.prompt_tokens

    red, n_red = await run(png_data_url((255, 0, 0)))
    noise_img = Image.effect_noise((28, 28), 80).convert("RGB")
    buf = io.BytesIO()
    noise_img.save(buf, "PNG")
    noise, n_noise = await run("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    _, n_text = await run(None)
    assert n_red == n_noise > n_text  # the <image> token expands to the image's patch tokens
    assert red != noise


@pytest.mark.mlx
async def test_vision_stream_is_cancelled_within_one_token(vision_engine: MlxVisionEngine) -> None:
    """Cancelling an image stream stops the MLX thread within one token; the engine serves the next."""
    msg = image_message("describe", png_data_url((0, 0, 255)))
    counter = vision_engine.observer = TokenCounter(3)
    req = GenerationRequest(kind="chat", messages=(msg,), max_tokens=2000, temperature=0.0)
    async with trio.open_nursery() as nursery:

        async def stream() -> None:
            async for _ev in vision_engine.generate(req):
                pass
            pytest.fail("the stream ran to its end")

        nursery.start_soon(stream)
        await counter.reached.wait()
        nursery.cancel_scope.cancel()
    vision_engine.observer = None
    stats = vision_engine.history[-1]
    req = GenerationRequest(kind="chat", messages=(msg,), max_tokens=2, temperature=0.0)
    _, fin, _ = await collect(vision_engine, req)
    assert fin.completion_tokens == 2
    assert stats.outcome == "cancelled" and stats.tokens_after_cancel <= 1
    assert stats.completion_tokens < 2000


@pytest.mark.mlx
async def test_vision_refuses_bad_images_before_queueing(vision_engine: MlxVisionEngine) -> None:
    """A bad image part is an InvalidRequest naming the part; nothing reaches the MLX thread."""
    before = len(vision_engine.history)
    with pytest.raises(InvalidRequest) as err:
        await collect(
            vision_engine,
            GenerationRequest(kind="chat", messages=(image_message("x", "file:///etc/passwd"),)),
        )
    assert err.value.param == "messages[0].content[1].image_url.url"
    assert len(vision_engine.history) == before
