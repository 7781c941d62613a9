"""``mlxd demo-model``: loadable random models (large: the agents bench's), and one-line refusals on bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlxd.cli import main
from mlxd.config.kv import kv_bytes_per_token
from mlxd.engines.model_files.demo_model import is_model_dir, text_config


def model_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def test_tiny_demo_model_is_a_small_complete_llama(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """demo-model writes a fp32 llama with a tokenizer and chat template, under 1 MB, with progress on stderr."""
    out = tmp_path / "tiny"
    assert main(["demo-model", str(out)]) == 0
    assert is_model_dir(out) and model_bytes(out) < 1_000_000
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["hidden_size"] == 64
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()
    err = capsys.readouterr().err
    assert "demo-model:" in err and "parameters" in err
    assert not list(tmp_path.glob(".*partial*"))  # written aside, then moved into place


def test_existing_directories_are_not_overwritten_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A non-empty target is refused with exit 2 and one line; --force replaces it."""
    out = tmp_path / "taken"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    assert main(["demo-model", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not empty" in err and "--force" in err
    assert (out / "precious.txt").read_text() == "keep me"
    assert main(["demo-model", str(out), "--force"]) == 0
    assert is_model_dir(out) and not (out / "precious.txt").exists()


def test_bad_arguments_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file as target, or --vision with --size small, exits 2 with a one-line message."""
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["demo-model", str(f)]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["demo-model", str(tmp_path / "v"), "--vision", "--size", "small"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--vision" in err
    assert not (tmp_path / "v").exists()


@pytest.mark.usefixtures("vision_extra")
def test_vision_demo_model_has_a_processor(tmp_path: Path) -> None:
    """demo-model --vision writes a LLaVA config with an image token and a processor config."""
    out = tmp_path / "vis"
    assert main(["demo-model", str(out), "--vision"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llava" and cfg["image_token_index"] >= 0
    assert (out / "processor_config.json").is_file()
    assert model_bytes(out) < 1_000_000


@pytest.mark.mlx
async def test_the_builtin_demo_config_makes_its_models_on_first_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a fresh machine, each MLX model of the offline demo config writes itself on first load and serves."""
    from mlxd.config import builtin_demo_config
    from mlxd.engines import DefaultEngines
    from mlxd.engines.base import Finished, GenerationRequest

    monkeypatch.setenv("MLXD_STATE_DIR", str(tmp_path / "state"))
    config = builtin_demo_config()
    demos = [m for m in config.models if m.engine == "mlx" and m.demo]
    assert demos, "the demo config has no demo models"
    factory = DefaultEngines()
    for model in demos:
        assert not is_model_dir(Path(model.source))
        engine = factory(model)
        await engine.load(lambda _p: None)
        try:
            assert is_model_dir(Path(model.source))
            assert str(tmp_path / "state") in model.source
            req = GenerationRequest(kind="completion", prompt="hello", max_tokens=3, temperature=0)
            events = [ev async for ev in engine.generate(req)]
            assert isinstance(events[-1], Finished) and events[-1].completion_tokens == 3
        finally:
            await engine.stop()


def large_config(tmp_path: Path) -> dict[str, Any]:
    """The config.json ``--size large`` writes, made without its weights (small's tokenizer)."""
    from transformers import AutoTokenizer

    small = tmp_path / "small"
    assert main(["demo-model", str(small), "--size", "small"]) == 0
    return text_config("large", AutoTokenizer.from_pretrained(str(small)))


@pytest.mark.mlx
def test_large_demo_model_is_the_size_its_help_states(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--size large is a 735M-parameter llama (2.7 GiB fp32) with 128-wide heads, 32 KiB of KV a token and small's vocabulary, as its help says."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    cfg = large_config(tmp_path)
    small = json.loads((tmp_path / "small" / "config.json").read_text())
    assert cfg["vocab_size"] == small["vocab_size"] and cfg["eos_token_id"] == small["eos_token_id"]
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 128
    assert kv_bytes_per_token(cfg) == 32 * 1024
    assert cfg["max_position_embeddings"] >= 32768 + 1024  # a 32k prompt and its template
    model = llama.Model(llama.ModelArgs.from_dict(cfg))  # lazy: nothing is computed
    n = sum(int(v.size) for _, v in tree_flatten(model.parameters()))
    with pytest.raises(SystemExit):
        main(["demo-model", "--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    assert f"{round(n / 1e6)}M params" in helptext and f"{n * 4 / 2**30:.1f} GiB" in helptext


@pytest.mark.stress
@pytest.mark.mlx
def test_large_demo_model_loads_and_generates(tmp_path: Path) -> None:
    """demo-model --size large writes a model mlx-lm loads and generates from, with small's tokenizer and template, every token text."""
    from mlx_lm import load, stream_generate

    out = tmp_path / "large"
    assert main(["demo-model", str(out), "--size", "large"]) == 0
    assert json.loads((out / "config.json").read_text()) == large_config(tmp_path)
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (tmp_path / "small" / name).read_bytes()
    model, tok = load(str(out))
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    steps = list(stream_generate(model, tok, prompt, max_tokens=3))
    assert len(steps) == 3 and steps[-1].generation_tokens == 3
    assert all(step.text for step in steps)  # whole characters: a stream's every chunk has text
