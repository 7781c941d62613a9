"""What each ``engine:`` value can do: the one place the kinds of engine differ.

A model's ``engine:`` key names a kind of engine (``mlx``, the default, or
``fake``, for tests and demos). The rest of mlxd asks the kind's capabilities
(:attr:`ModelConfig.engine_kind <mlxd.config.model.ModelConfig.engine_kind>`)
instead of comparing its name: whether there are weight files to size,
fingerprint and read a template from, whether it can batch and keeps KV, whether
it takes tools and grammars. Only the config reader (which parses the key) and
the engine factory (which picks the class) look at the name itself; a test
(``tests/unit/test_engine_kinds.py``) holds that.

What a *model* of a kind does (an mllm, an embedding model or a distributed one
never batches, for instance) is the eligibility rule of :mod:`mlxd.config.kv`,
which starts from these capabilities. Imports nothing of mlxd: the config, the
engines and HTTP all read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EngineName = Literal["mlx", "fake"]


@dataclass(frozen=True, slots=True)
class EngineKind:
    """The capabilities of one kind of engine (see the module docstring)."""

    name: EngineName
    #: loads weight files from its source: their sizes make its estimate, their stats its
    #: fingerprint, and its ``config.json`` and chat template are read from its directory.
    #: Without (the fake) there is nothing on disk to size, download or read
    weights: bool
    #: its generations hold KV and it keeps a prompt cache, both sized from ``config.json``
    kv: bool
    #: takes tools (a chat template's) and grammar-constrained output (a model may still not)
    constrains: bool
    #: why a model of this kind generates one at a time, in words (None: it may batch)
    serial_because: str | None = None

    @property
    def batches(self) -> bool:
        """Its generations can share decode steps (a model may still not: mlxd.config.kv)."""
        return self.serial_because is None


MLX = EngineKind("mlx", weights=True, kv=True, constrains=True)
FAKE = EngineKind(
    "fake", weights=False, kv=False, constrains=False,
    serial_because="the fake engine serves one at a time",
)
#: the kinds by the ``engine:`` value that names them
ENGINE_KINDS: dict[str, EngineKind] = {kind.name: kind for kind in (MLX, FAKE)}
#: the values ``engine:`` accepts (the first is the default)
ENGINES: tuple[EngineName, ...] = tuple(kind.name for kind in (MLX, FAKE))
