"""Images in OpenAI chat requests: ``image_url`` content parts decoded to PIL images.

Accepted forms of ``{"type": "image_url", "image_url": {"url": URL}}`` (the
``image_url`` may also be the bare URL string):

* ``data:image/<fmt>;base64,<payload>``: always;
* ``file:///abs/path`` (or a plain absolute path): only when the model config
  sets ``image_dir`` and the resolved file lies inside it (no ``..`` or
  symlink escapes);
* ``http(s)://``: refused (the daemon does not fetch URLs on a client's behalf).

Limits: :data:`MAX_IMAGES` per request, :data:`MAX_IMAGE_BYTES` encoded bytes
per image, :data:`MAX_PIXELS` pixels per image and :data:`MAX_REQUEST_PIXELS`
pixels for all the images of one request (decompression-bomb guards: a few
kilobytes of PNG can decode to gigabytes). Every refusal is an
:class:`~mlxd.errors.InvalidRequest` whose ``param`` names the field
(``messages[1].content[0].image_url``).

Two steps, so that nothing is decoded before the request is admitted:

1. :func:`check_request_images`, in the HTTP handler before any lease: reads
   each image's bytes and only its *header* (its size), and applies every
   limit; cheap, whatever the images claim to hold;
2. :func:`decode_request_images`, in the vision engine, once the request holds
   its lease and has passed the model's queue admission, one request at a time
   per engine.

Both are CPU work: call them off the Trio thread (``trio.to_thread.run_sync``);
they do no MLX work.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from mlxd.errors import InvalidRequest

MAX_IMAGES = int(os.environ.get("MLXD_MAX_IMAGES", "16"))
MAX_IMAGE_BYTES = int(os.environ.get("MLXD_MAX_IMAGE_BYTES", str(20 * 1024 * 1024)))
MAX_PIXELS = int(os.environ.get("MLXD_MAX_IMAGE_PIXELS", str(50_000_000)))
MAX_REQUEST_PIXELS = int(os.environ.get("MLXD_MAX_REQUEST_PIXELS", str(50_000_000)))

IMAGE_PART_TYPES = ("image_url", "input_image", "image")


def image_parts(messages: Sequence[Any]) -> list[tuple[str, Any]]:
    """``(param path, url)`` for every image part of ``messages``, in order.

    ``messages`` are :class:`~mlxd.engines.base.ChatMessage` objects or plain
    dicts with ``content``.
    """
    found: list[tuple[str, Any]] = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in IMAGE_PART_TYPES:
                continue
            param = f"messages[{i}].content[{j}]"
            if part.get("type") == "image_url":
                value = part.get("image_url")
                param += ".image_url"
                if isinstance(value, dict):
                    value = value.get("url")
                    param += ".url"
            else:  # input_image (Responses API shape) / image
                value = part.get("image_url") or part.get("url") or part.get("image")
            found.append((param, value))
    return found


def decode_data_url(url: str, param: str) -> bytes:
    """The bytes of a base64 ``data:`` URL."""
    head, sep, payload = url.partition(",")
    if not sep:
        raise InvalidRequest("malformed data URL: no ',' before the payload", param=param)
    media = head[5:]  # after "data:"
    if not media.endswith(";base64"):
        raise InvalidRequest("data URLs must be base64 (data:image/png;base64,...)", param=param)
    mime = media[: -len(";base64")]
    if mime and not mime.startswith("image/"):
        raise InvalidRequest(f"data URL media type {mime!r} is not an image", param=param)
    if len(payload) > (MAX_IMAGE_BYTES * 4) // 3 + 4:
        raise InvalidRequest(f"image larger than {MAX_IMAGE_BYTES} bytes", param=param)
    try:
        return base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("data URL payload is not valid base64", param=param) from None


def read_local_file(url: str, image_dir: Path | None, param: str) -> bytes:
    """The bytes of a ``file://`` URL (or absolute path) inside ``image_dir``."""
    if image_dir is None:
        raise InvalidRequest(
            "local image files are not allowed for this model (set image_dir in its config)",
            param=param,
        )
    raw = unquote(urlparse(url).path) if url.startswith("file:") else url
    root = Path(image_dir).expanduser().resolve()
    try:
        path = Path(raw).expanduser().resolve(strict=True)
    except (OSError, RuntimeError):
        raise InvalidRequest(f"no such image file: {raw}", param=param) from None
    if not path.is_relative_to(root):
        raise InvalidRequest(f"{raw} is outside the model's image_dir", param=param)
    if not path.is_file():
        raise InvalidRequest(f"{raw} is not a file", param=param)
    size = path.stat().st_size
    if size > MAX_IMAGE_BYTES:
        raise InvalidRequest(f"image larger than {MAX_IMAGE_BYTES} bytes", param=param)
    return path.read_bytes()


def image_bytes(url: Any, image_dir: Path | None, param: str) -> bytes:
    """The encoded bytes an ``image_url`` value points to."""
    if not isinstance(url, str) or not url:
        raise InvalidRequest("image_url must carry a url string", param=param)
    if url.startswith("data:"):
        return decode_data_url(url, param)
    if url.startswith("file:") or url.startswith("/"):
        return read_local_file(url, image_dir, param)
    scheme = urlparse(url).scheme or "relative path"
    raise InvalidRequest(
        f"unsupported image URL ({scheme}): use a base64 data: URL"
        + (" or a file:// path under image_dir" if image_dir is not None else ""),
        param=param,
    )


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError as e:  # pillow comes with the vlm extra
        raise InvalidRequest(f"images need pillow (pip install 'mlxd[vlm]'): {e}") from e
    return Image


def image_size(data: bytes, param: str) -> tuple[int, int]:
    """Width and height from the image's header alone (nothing is decoded)."""
    image = _pil()
    try:
        with image.open(io.BytesIO(data)) as img:
            w, h = img.size
    except Exception as e:  # PIL.UnidentifiedImageError, truncated headers, PIL's own bomb check
        raise InvalidRequest(
            f"not a readable image: {type(e).__name__}: {e}", param=param
        ) from None
    return int(w), int(h)


def check_request_images(messages: Sequence[Any], *, image_dir: Path | None = None) -> list[bytes]:
    """Every image of a request as encoded bytes, after every limit is checked from headers.

    Refuses (400) more than :data:`MAX_IMAGES` images, an image over
    :data:`MAX_IMAGE_BYTES` or :data:`MAX_PIXELS`, and images that add up to
    more than :data:`MAX_REQUEST_PIXELS`, without decoding any of them.
    """
    parts = image_parts(messages)
    if len(parts) > MAX_IMAGES:
        raise InvalidRequest(
            f"at most {MAX_IMAGES} images per request, got {len(parts)}", param="messages"
        )
    out: list[bytes] = []
    total = 0
    for param, url in parts:
        data = image_bytes(url, image_dir, param)
        w, h = image_size(data, param)
        if w * h > MAX_PIXELS:
            raise InvalidRequest(
                f"image of {w}x{h} pixels is larger than {MAX_PIXELS} pixels", param=param
            )
        total += w * h
        if total > MAX_REQUEST_PIXELS:
            raise InvalidRequest(
                f"the images of this request add up to more than {MAX_REQUEST_PIXELS} pixels"
                f" (counted from their headers, up to this one of {w}x{h})",
                param=param,
            )
        out.append(data)
    return out


def open_image(data: bytes, param: str) -> Any:
    """Decode ``data`` to an RGB PIL image, refusing what is not an image or is too large."""
    image = _pil()
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidRequest(f"image larger than {MAX_IMAGE_BYTES} bytes", param=param)
    try:
        img = image.open(io.BytesIO(data))
        w, h = img.size
        if w * h > MAX_PIXELS:
            raise InvalidRequest(
                f"image of {w}x{h} pixels is larger than {MAX_PIXELS} pixels", param=param
            )
        img.load()
    except InvalidRequest:
        raise
    except Exception as e:  # PIL.UnidentifiedImageError, truncated files, bombs
        raise InvalidRequest(
            f"not a readable image: {type(e).__name__}: {e}", param=param
        ) from None
    return img.convert("RGB") if img.mode != "RGB" else img


def decode_request_images(
    messages: Sequence[Any], images: Sequence[Any] = (), *, image_dir: Path | None = None
) -> list[Any]:
    """Every image of a request as RGB PIL images.

    ``images``: what :func:`check_request_images` returned (encoded bytes), or
    PIL images, in the order of the parts (which then only mark where the
    images go); without them, the parts of ``messages`` are checked first.
    """
    if not images:
        images = check_request_images(messages, image_dir=image_dir)
    if len(images) > MAX_IMAGES:
        raise InvalidRequest(
            f"at most {MAX_IMAGES} images per request, got {len(images)}", param="messages"
        )
    out: list[Any] = []
    for k, given in enumerate(images):
        param = f"images[{k}]"
        if isinstance(given, bytes | bytearray):
            out.append(open_image(bytes(given), param))
        elif hasattr(given, "convert"):
            out.append(given.convert("RGB") if getattr(given, "mode", "RGB") != "RGB" else given)
        else:
            raise InvalidRequest("images must be PIL images or bytes", param=param)
    return out
