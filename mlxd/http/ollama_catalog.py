"""What Ollama's discovery routes say of mlxd's models: ``/api/tags``, ``/api/show``, ``/api/ps``.

Every configured model is listed, loaded or not, under its configured name.
From the model's files (:mod:`mlxd.engines.model_files.model_facts`, never the weights):
``size`` (the weight files; for a model not on disk, the weights estimate),
``digest`` (SHA-256 of the weights' identity, :func:`mlxd.config.model.weights_fingerprint`:
it changes when a weight file does), ``details`` (family from ``config.json``,
parameter count from the safetensors headers, quantization), ``modified_at``
(the newest weight file). ``/api/show`` adds the capabilities the model really
has, learned as its engine learns them (the tokenizer's chat template, its
tool-call format and thinking markers): ``completion`` for generators,
``tools``, ``thinking``, ``vision`` for ``mllm`` models, ``embedding`` for
``embedding`` models; a fake engine has ``completion`` only, and a model whose
files are not on disk yet says only what its config does.

``/api/ps`` lists the models that hold memory (``loading`` to ``unloading``)
with ``size`` and ``size_vram`` both the committed bytes (unified memory),
``expires_at`` when the residency core would unload it for want of requests
(its last request's ``keep_alive``, else ``idle_unload_seconds``; far in the
future while it is in use, pinned or kept until evicted), and ``mlxd``: its
state, leases, pin and the keep_alive in force.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import trio

from mlxd import __version__
from mlxd.config import ModelConfig
from mlxd.config.model import weights_fingerprint
from mlxd.engines.model_files.model_facts import (
    FileFacts,
    TemplateFacts,
    file_facts,
    parameter_size,
    template_facts,
)
from mlxd.engines.text.prompt_limits import limits_for, model_dir_if_known
from mlxd.http.bodies_ollama import (
    Capability,
    OllamaDetails,
    OllamaRunning,
    OllamaRunningList,
    OllamaShow,
    OllamaTag,
    OllamaTags,
    OllamaVersion,
)
from mlxd.http.context import AppState
from mlxd.http.ollama_render import timestamp
from mlxd.residency.states import HOLDS_MEMORY

#: the Ollama version ``/api/version`` reports: clients gate features on it (mlxd's own is
#: sent beside it)
OLLAMA_VERSION = "0.12.6"
#: what Ollama reports for a model kept until evicted: now plus Go's largest duration
NEVER_S = (2**63 - 1) / 1e9
#: the states in which a model holds memory (what /api/ps lists)
HOLDING = HOLDS_MEMORY


def version() -> OllamaVersion:
    return {"version": OLLAMA_VERSION, "mlxd": __version__}


def digest(mc: ModelConfig) -> str:
    return hashlib.sha256(weights_fingerprint(mc).encode()).hexdigest()


def _facts(mc: ModelConfig) -> FileFacts | None:
    where = model_dir_if_known(mc)
    return file_facts(where) if where is not None else None


def details(mc: ModelConfig, facts: FileFacts | None) -> OllamaDetails:
    family = facts.family if facts is not None else ("" if mc.engine_kind.weights else mc.engine)
    return {
        "parent_model": "",
        "format": "safetensors" if facts is not None and facts.weights_bytes else "",
        "family": family,
        "families": [family] if family else None,
        "parameter_size": parameter_size(facts.parameter_count) if facts is not None else "",
        "quantization_level": facts.quantization if facts is not None else "",
    }


def _size(st: AppState, mc: ModelConfig, facts: FileFacts | None) -> int:
    if facts is not None and facts.weights_bytes:
        return facts.weights_bytes
    return st.manager.estimates.memory_parts(mc.name)["weights"]


def _modified(st: AppState, facts: FileFacts | None) -> str:
    return timestamp(facts.modified_at if facts is not None and facts.modified_at else st.started_at)


async def _all_facts(models: list[ModelConfig]) -> dict[str, FileFacts | None]:
    """The file facts of ``models``, read on a worker thread (the residency is read on Trio's)."""
    return await trio.to_thread.run_sync(lambda: {mc.name: _facts(mc) for mc in models})


def tag(st: AppState, mc: ModelConfig, facts: FileFacts | None) -> OllamaTag:
    return {
        "name": mc.name,
        "model": mc.name,
        "modified_at": _modified(st, facts),
        "size": _size(st, mc, facts),
        "digest": digest(mc),
        "details": details(mc, facts),
    }


async def tags(st: AppState) -> OllamaTags:
    """``/api/tags``: every configured model (its files are read on a worker thread)."""
    models = list(st.config.models)
    facts = await _all_facts(models)
    return {"models": [tag(st, mc, facts[mc.name]) for mc in models]}


def capabilities(mc: ModelConfig, template: TemplateFacts | None) -> list[Capability]:
    if mc.embedding:
        return ["embedding"]
    caps: list[Capability] = ["completion"]
    if mc.mllm:
        caps.append("vision")  # mlx-vlm models take images; their tools are refused (400)
    elif template is not None:
        if template.tools:
            caps.append("tools")
        if template.thinking:
            caps.append("thinking")
    return caps


async def template_of(mc: ModelConfig) -> TemplateFacts | None:
    """The model's template facts (None: a vision or embedding model, or none on disk: a fake's)."""
    where = model_dir_if_known(mc)
    if where is None or mc.embedding or mc.mllm:
        return None
    return await trio.to_thread.run_sync(template_facts, where)


def _model_info(mc: ModelConfig, facts: FileFacts | None) -> dict[str, Any]:
    arch = (facts.family if facts is not None else "") or ("unknown" if mc.engine_kind.weights else mc.engine)
    info: dict[str, Any] = {"general.architecture": arch, "general.basename": mc.name,
                            f"{arch}.context_length": limits_for(mc).max_prompt_tokens}
    if facts is not None:
        if facts.parameter_count:
            info["general.parameter_count"] = facts.parameter_count
        if facts.embedding_length:
            info[f"{arch}.embedding_length"] = facts.embedding_length
    return info


def _parameters(mc: ModelConfig) -> str:
    """Ollama's ``parameters`` text: the settings mlxd applies to this model."""
    rows = [("num_ctx", str(limits_for(mc).max_prompt_tokens)),
            ("num_batch", str(mc.max_batch_size))]
    return "\n".join(f"{k:<30} {v}" for k, v in rows)


async def show(st: AppState, mc: ModelConfig) -> OllamaShow:
    """``/api/show`` of one configured model."""
    facts = await trio.to_thread.run_sync(_facts, mc)
    template = await template_of(mc)
    return {
        "modelfile": f"# mlxd serves '{mc.name}' from its config; it is not built from a Modelfile\n"
                     f"FROM {mc.source}\n",
        "parameters": _parameters(mc),
        "template": template.chat_template if template is not None and template.chat_template else "",
        "details": details(mc, facts),
        "model_info": _model_info(mc, facts),
        "capabilities": capabilities(mc, template),
        "modified_at": _modified(st, facts),
        "mlxd": {"source": mc.source, "engine": mc.engine, "mllm": mc.mllm, "embedding": mc.embedding,
                 "on_disk": facts is not None or not mc.engine_kind.weights},
    }


def expires_at(st: AppState, name: str) -> str:
    """When the residency core would unload ``name`` for want of requests (see the module doc)."""
    due = st.manager.model_snapshot(name).unload_due
    wall = st.manager.wall_of(due) if due is not None else time.time() + NEVER_S
    return timestamp(min(wall, time.time() + NEVER_S) if wall is not None else None)


def running(st: AppState, mc: ModelConfig, facts: FileFacts | None) -> OllamaRunning:
    """One ``/api/ps`` entry."""
    status = st.manager.model_status(mc.name)
    return {
        "name": mc.name,
        "model": mc.name,
        "size": status["memory_bytes"],
        "digest": digest(mc),
        "details": details(mc, facts),
        "expires_at": expires_at(st, mc.name),
        "size_vram": status["memory_bytes"],
        "context_length": limits_for(mc).max_prompt_tokens,
        "mlxd": {
            "state": status["state"],
            "active_leases": status["active_leases"],
            "waiters": status["waiters"],
            "pinned": status["pinned"],
            "keep_alive_s": st.manager.model_snapshot(mc.name).keep_alive_s,
            "idle_unload_seconds": status["idle_unload_seconds"],
            "memory": status["memory"],
        },
    }


async def ps(st: AppState) -> OllamaRunningList:
    m = st.manager
    held = [mc for mc in st.config.models if m.has_model(mc.name) and m.state_of(mc.name) in HOLDING]
    facts = await _all_facts(held)
    return {"models": [running(st, mc, facts[mc.name]) for mc in held if m.has_model(mc.name)]}
