"""What a model's files say about it without loading its weights (Ollama's ``/api/tags``, ``/api/show``).

Two levels, both cached by the files' identity (path and modification times):

* :func:`file_facts`: read from ``config.json`` and the safetensors headers
  (a few KB each, never the weights): family (``model_type``), parameter
  count, quantization, context length, embedding width, the weights' size and
  newest modification time. Cheap enough for every ``/api/tags``.
* :func:`template_facts`: the chat template and what it supports, learned the
  way the engine learns it when it loads (mlx-lm's tokenizer wrapper:
  ``has_chat_template``, the tool-call format, the thinking markers). It loads
  the tokenizer (no weights), so it runs on a worker thread and is cached.

A model whose files are not on disk (a Hub repo not downloaded yet, a fake
engine) has no facts: the callers say so rather than guess.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from mlxd.engines.text.prompt_limits import context_from_config

#: dtypes as Ollama names quantization levels
_DTYPE_LEVEL = {"F16": "F16", "BF16": "BF16", "F32": "F32", "F64": "F64", "I8": "Q8_0"}
#: bytes of a safetensors header we read at most (a header larger than this is not believed)
_MAX_HEADER = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class FileFacts:
    """What ``config.json`` and the safetensors headers of a model directory say."""

    family: str
    parameter_count: int | None
    #: ``Q4``, ``Q8``, ``F16``, ``BF16``, ``F32`` ('' unknown)
    quantization: str
    context_length: int | None
    embedding_length: int | None
    weights_bytes: int
    #: newest modification time of a weight file (None: no weight file)
    modified_at: float | None
    #: the whole parsed config.json ({} when unreadable)
    config: dict[str, Any]


@dataclass(frozen=True, slots=True)
class TemplateFacts:
    """What the model's tokenizer and chat template support, as the engine would learn it."""

    chat_template: str | None
    tools: bool
    thinking: bool
    #: the thinking markers ('' without thinking)
    think_start: str = ""
    think_end: str = ""


def _stamp(directory: Path) -> tuple[tuple[str, int, int], ...]:
    """Names, sizes and mtimes of the files facts are read from (the cache key)."""
    files = []
    for p in sorted(directory.glob("*.json")) + sorted(directory.glob("*.safetensors")):
        try:
            st = p.stat()
        except OSError:
            continue
        files.append((p.name, st.st_size, st.st_mtime_ns))
    return tuple(files)


def file_facts(directory: Path) -> FileFacts:
    """The :class:`FileFacts` of a model directory (cached while its files are unchanged)."""
    return _file_facts(str(directory), _stamp(directory))


def template_facts(directory: Path) -> TemplateFacts:
    """The :class:`TemplateFacts` of a model directory; loads its tokenizer (seconds the
    first time: call it on a worker thread). Cached while its files are unchanged."""
    return _template_facts(str(directory), _stamp(directory))


def _read_config(directory: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file ({} when it is not one)."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _MAX_HEADER:
                return {}
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error):
        return {}
    return header if isinstance(header, dict) else {}


def _count(headers: list[dict[str, Any]], bits: int | None) -> tuple[int | None, Counter[str]]:
    """Parameters in the tensors (packed quantized weights unpacked; scales and biases of
    quantization not counted), and the dtypes of the float tensors by element count."""
    total = 0
    dtypes: Counter[str] = Counter()
    for header in headers:
        for name, info in header.items():
            if name == "__metadata__" or not isinstance(info, dict):
                continue
            shape = info.get("shape")
            if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
                continue
            n = 1
            for d in shape:
                n *= d
            dtype = str(info.get("dtype", ""))
            if bits and name.endswith((".scales", ".biases")):
                continue
            if bits and dtype == "U32":
                n = n * 32 // bits  # mlx packs 32 // bits weights into each uint32
            else:
                dtypes[dtype] += n
            total += n
    return (total or None), dtypes


def _quantization(cfg: dict[str, Any], dtypes: Counter[str]) -> str:
    q = cfg.get("quantization") or cfg.get("quantization_config")
    if isinstance(q, dict) and isinstance(q.get("bits"), int):
        return f"Q{q['bits']}"
    if dtypes:
        return _DTYPE_LEVEL.get(dtypes.most_common(1)[0][0], "")
    return ""


@lru_cache(maxsize=256)
def _file_facts(directory: str, stamp: tuple[tuple[str, int, int], ...]) -> FileFacts:
    root = Path(directory)
    cfg = _read_config(root)
    q = cfg.get("quantization")
    bits = q.get("bits") if isinstance(q, dict) and isinstance(q.get("bits"), int) else None
    weights = [root / name for name, _, _ in stamp if name.endswith(".safetensors")]
    params, dtypes = _count([safetensors_header(p) for p in weights], bits)
    sizes = [size for name, size, _ in stamp if name.endswith(".safetensors")]
    mtimes = [mtime for name, _, mtime in stamp if name.endswith(".safetensors")]
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    width = text.get("hidden_size") if isinstance(text, dict) else None
    return FileFacts(
        family=str(cfg.get("model_type") or ""),
        parameter_count=params,
        quantization=_quantization(cfg, dtypes),
        context_length=context_from_config(cfg),
        embedding_length=width if isinstance(width, int) and not isinstance(width, bool) else None,
        weights_bytes=sum(sizes),
        modified_at=max(mtimes) / 1e9 if mtimes else None,
        config=cfg,
    )


@lru_cache(maxsize=64)
def _template_facts(directory: str, stamp: tuple[tuple[str, int, int], ...]) -> TemplateFacts:
    from mlx_lm.utils import load_tokenizer

    from mlxd.engines.text.tool_calls import tool_format

    tokenizer = load_tokenizer(Path(directory))  # type: ignore[no-untyped-call]
    has_template = bool(getattr(tokenizer, "has_chat_template", False))
    template = getattr(tokenizer, "chat_template", None)
    thinking = bool(getattr(tokenizer, "has_thinking", False))
    return TemplateFacts(
        chat_template=template if has_template and isinstance(template, str) else None,
        tools=has_template and tool_format(tokenizer) is not None,
        thinking=thinking,
        think_start=str(tokenizer.think_start) if thinking else "",
        think_end=str(tokenizer.think_end) if thinking else "",
    )


def parameter_size(count: int | None) -> str:
    """Ollama's ``parameter_size``: ``7.6B``, ``25.3M`` ('' unknown)."""
    if not count:
        return ""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)
