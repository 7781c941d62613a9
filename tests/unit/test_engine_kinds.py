"""The engine kinds' capabilities are asked, never their names compared (mlxd.config.engine_kinds).

Outside the engine layer (``mlxd/engines``, which picks the class for a name)
and the module that defines the kinds, no code compares an ``engine:`` value
with a kind's name: it asks ``model.engine_kind``. The config parser
(``rules.py``, ``distributed.py``) may compare the value it is parsing (a bare
name), never a model's ``.engine``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mlxd
from mlxd.config import ModelConfig
from mlxd.config.engine_kinds import ENGINE_KINDS, ENGINES
from mlxd.config.kv import eligibility
from mlxd.config.model import DistributedHost, DistributedSettings

PACKAGE = Path(mlxd.__file__).parent
#: where names are compared by design: the factory and the kinds' definition
EXEMPT = ("engines/", "config/engine_kinds.py")
#: the config key's parser: it may compare the value it reads (a bare name)
PARSERS = ("config/rules.py", "config/distributed.py")


def _names_in(node: ast.expr) -> list[str]:
    """The engine names written as constants in ``node`` (or in a tuple/list/set of them)."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and i.value in ENGINES]


def name_comparisons(source: str, *, parser: bool = False) -> list[int]:
    """Lines of ``source`` comparing (``==``, ``!=``, ``in``, ``match``) something with an
    engine name; with ``parser``, comparing a bare name (the value being parsed) is allowed."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if not any(_names_in(o) for o in operands):
                continue
            others = [o for o in operands if not _names_in(o)]
            if parser and all(isinstance(o, ast.Name) for o in others):
                continue
            lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and _names_in(node.value):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_engine_name_is_compared_outside_the_engine_layer() -> None:
    """No module outside mlxd/engines and the config parser compares an engine's name."""
    offending = []
    for file in sorted(PACKAGE.rglob("*.py")):
        rel = file.relative_to(PACKAGE).as_posix()
        if rel.startswith(EXEMPT):
            continue
        text = file.read_text(encoding="utf-8")
        source_lines = text.splitlines()
        for line in name_comparisons(text, parser=rel in PARSERS):
            offending.append(f"mlxd/{rel}:{line}: {source_lines[line - 1].strip()}")
    assert not offending, "ask model.engine_kind instead:\n" + "\n".join(offending)


@pytest.mark.parametrize(
    ("source", "parser", "found"),
    [
        ('if model.engine == "fake": pass', False, [1]),
        ('x = 1\nok = mc.engine != "mlx"', False, [2]),
        ('if m.engine in ("fake", "other"): pass', False, [1]),
        ('if "fake" == engine: pass', False, [1]),
        ('match model.engine:\n    case "fake":\n        pass', False, [2]),
        ('if engine == "fake": pass', True, []),
        ('if model.engine == "fake": pass', True, [1]),
        ('if model.engine_kind.weights: pass', False, []),
        ('label = "fake"', False, []),
        ('if source == "fake-ish": pass', False, []),
    ],
)
def test_the_check_finds_each_spelling(source: str, parser: bool, found: list[int]) -> None:
    """The check flags each way of comparing an engine name, and only those."""
    assert name_comparisons(source, parser=parser) == found


def test_every_engine_value_has_a_kind() -> None:
    """Each value ``engine:`` accepts names a kind, which a model of it reports."""
    assert set(ENGINES) == set(ENGINE_KINDS)
    for name in ENGINES:
        assert ModelConfig("m", "/x", engine=name).engine_kind.name == name


def test_a_kind_that_cannot_batch_keeps_its_models_serial() -> None:
    """The eligibility rule starts from the kind: a fake never batches, keeps no prompt cache
    and holds no KV, whatever max_batch_size says; an mlx text model does all three."""
    fake = eligibility(ModelConfig("f", "fake:f", engine="fake", max_batch_size=8))
    assert (fake.batches, fake.prompt_cache, fake.kv) == (False, False, False)
    assert fake.serial_because == ENGINE_KINDS["fake"].serial_because
    real = eligibility(ModelConfig("t", "/x", engine="mlx", max_batch_size=8))
    assert (real.batches, real.prompt_cache, real.kv, real.serial_because) == (True, True, True, None)


def test_every_model_that_commits_kv_counts_it_per_request_but_a_distributed_one() -> None:
    """The rule says which models count their requests' KV (the plan and the process engine
    read it): a text model does, a distributed one commits KV but books none per request,
    a fake does not."""
    hosts = (DistributedHost("a"), DistributedHost("b"))
    dist = eligibility(ModelConfig("d", "/x", distributed=DistributedSettings("ring", hosts)))
    assert (dist.kv, dist.per_request) == (True, False)
    assert eligibility(ModelConfig("t", "/x")).per_request
    assert not eligibility(ModelConfig("f", "fake:f", engine="fake")).per_request
