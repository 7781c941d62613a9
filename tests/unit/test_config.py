"""Valid configs: what they load into (defaults, estimates, policies, paths, vllm-mlx files)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from mlxd.config import (
    STRATEGIES,
    Config,
    ContentionPolicy,
    JournalConfig,
    Measurement,
    ModelConfig,
    builtin_demo_config,
    default_state_dir,
    load_config,
    parse_config,
    parse_memory_size,
    resolve_estimate,
    weights_fingerprint,
)
from mlxd.engines.fake import FakeFleet
from mlxd.errors import ConfigError
from mlxd.residency.manager import Manager
from mlxd.resources import demo_config_path
from mlxd.units import GIB, MIB

ETC = Path(__file__).resolve().parents[2] / "etc"
HUB = "mlx-community/Qwen2.5-0.5B-Instruct-4bit"


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own state directory."""
    state = tmp_path / "state"
    monkeypatch.setenv("MLXD_STATE_DIR", str(state))
    return state


def write(tmp_path: Path, text: str, name: str = "models.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def one_model(extra: str = "", *, manager: str = "") -> dict[str, object]:
    """A raw config (as YAML would parse it) with one Hub model."""
    import yaml

    text = (
        f"manager:\n  memory_budget_gb: 8\n{manager}"
        f"models:\n  - name: qwen\n    path: {HUB}\n    estimated_memory_gb: 0.5\n{extra}"
    )
    raw = yaml.safe_load(text)
    assert isinstance(raw, dict)
    return raw


def make_weights(folder: Path, sizes: dict[str, int]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    for name, size in sizes.items():
        (folder / name).write_bytes(b"\0" * size)
    return folder


# ---- the shipped configs -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["models.yaml", "models.demo.yaml", "vllm-mlx.models.yaml"])
def test_shipped_configs_load(name: str) -> None:
    """Each example config in etc/ loads without error and names at least one model."""
    config = load_config(ETC / name)
    assert config.models
    assert config.path == (ETC / name).absolute()


def test_builtin_demo_config_is_offline_and_shows_eviction(state_dir: Path) -> None:
    """The demo config needs no network, lives in the state dir, and its two fakes do not fit together."""
    config = builtin_demo_config()
    assert config.path == demo_config_path().absolute()
    names = [m.name for m in config.models]
    assert names == ["demo", "demo-small", "fake-a", "fake-b"]
    assert all(m.is_local for m in config.models)
    demo = config.model("demo")
    assert demo is not None and demo.demo == "tiny" and demo.engine == "mlx"
    assert Path(demo.source) == state_dir / "demo-models" / "tiny"
    assert config.journal.path == state_dir / "journal.db"
    assert (config.server.host, config.server.port) == ("127.0.0.1", 8080)
    assert config.manager.contention_policy.strategy == "wait_then_fail"
    budget = config.manager.memory_budget_bytes
    assert budget == 600 * MIB
    a, b = config.estimate("fake-a").bytes, config.estimate("fake-b").bytes
    assert a <= budget and b <= budget and a + b > budget
    demos = sum(config.estimate(n).bytes for n in ("demo", "demo-small"))
    assert demos + a <= budget  # both demo models (weights, KV, prompt caches) and one fake fit
    for fake in ("fake-a", "fake-b"):
        settings = config.model(fake).fake  # type: ignore[union-attr]
        assert settings is not None and settings.load_seconds > 0 and settings.tokens_per_second > 0


def test_vllm_mlx_config_loads_unchanged_and_reports_ignored_keys() -> None:
    """A vllm-mlx models-config loads as written; its engine keys are ignored, one warning line each."""
    config = load_config(ETC / "vllm-mlx.models.yaml")
    qwen = config.model("qwen3-8b")
    assert qwen is not None
    assert qwen.source == "mlx-community/Qwen3-8B-4bit" and qwen.source_kind == "hub"
    assert qwen.ignored_keys == (
        "continuous_batching",
        "prefill_step_size",
        "stream_interval",
        "gpu_memory_utilization",
        "max_tokens",
    )
    assert qwen.continuous_batching is True
    assert qwen.gpu_memory_utilization == pytest.approx(0.85)
    moe = config.model("qwen3-30b-a3b")
    assert moe is not None and "specprefill_draft_model" in moe.ignored_keys
    n_ignored = sum(len(m.ignored_keys) for m in config.models)
    assert len(config.warnings) == n_ignored
    assert all("\n" not in w for w in config.warnings)
    assert (
        "models[0].max_tokens (qwen3-8b): vllm-mlx engine key, ignored by mlxd"
        in config.warnings[4]
    )
    policy = config.manager.contention_policy
    assert policy == ContentionPolicy("wait_then_preempt", 60.0, 5.0)
    assert config.manager.memory_budget_bytes == 24 * GIB
    vision = config.model("gemma-vision")
    assert vision is not None and vision.mllm


def test_model_key_and_source_key_are_aliases_of_path() -> None:
    """``source:`` and ``model:`` work like ``path:``, and repeating the same value is accepted."""
    raw = one_model(
        "  - name: b\n    source: org/b\n    model: org/b\n    estimated_memory_gb: 1\n"
    )
    b = parse_config(raw).model("b")
    assert b is not None and (b.source, b.source_kind) == ("org/b", "hub")


# ---- defaults ----------------------------------------------------------------------------


def test_defaults_of_a_minimal_config(state_dir: Path) -> None:
    """A config with only a budget and one model gets DESIGN.md's defaults everywhere else."""
    config = parse_config(one_model())
    assert config.server.host == "127.0.0.1"
    assert config.server.port == 8080
    assert config.server.api_key_env == "MLXD_API_KEY"
    assert config.server.shutdown_grace_s == 10.0
    assert config.server.max_body_mb == 32.0
    assert config.journal == JournalConfig(path=state_dir / "journal.db", synchronous="full")
    assert config.manager.idle_unload_seconds == 0.0
    assert config.manager.restore_on_start is True
    assert config.manager.contention_policy == ContentionPolicy("wait_then_fail", 30.0, None)
    m = config.models[0]
    assert (m.preload, m.pin, m.mllm, m.engine) == (False, False, False, "mlx")
    assert (m.max_queue, m.max_batch_size, m.idle_unload_seconds) == (64, 8, None)
    assert m.fake is None and m.ignored_keys == () and config.warnings == ()


def test_yaml_1_1_booleans_are_booleans() -> None:
    """Unquoted ``yes``/``on`` are YAML booleans and accepted (only quoted strings are not)."""
    config = parse_config(one_model("    preload: yes\n    pin: on\n"))
    assert config.models[0].preload is True and config.models[0].pin is True


def test_every_config_section_is_frozen() -> None:
    """Every dataclass a Config is made of is frozen (a reload swaps whole configs; nothing edits one in place)."""
    from mlxd.config import model as config_model

    sections = [
        obj for obj in vars(config_model).values()
        if isinstance(obj, type) and dataclasses.is_dataclass(obj)
    ]
    assert {c.__name__ for c in sections} >= {
        "Config", "ServerConfig", "JournalConfig", "ManagerConfig", "ModelConfig",
        "FakeSettings", "MemoryEstimate", "ContentionPolicy",
    }
    assert [c.__name__ for c in sections if not c.__dataclass_params__.frozen] == []


def test_idle_unload_per_model_overrides_manager() -> None:
    """A model's idle_unload_seconds overrides the manager's; null inherits; pinned never idles."""
    raw = one_model(
        "    idle_unload_seconds: 5\n"
        "  - {name: b, path: org/b, estimated_memory_gb: 1, idle_unload_seconds: null}\n"
        "  - {name: c, path: org/c, estimated_memory_gb: 1, pin: true, idle_unload_seconds: 9}\n",
        manager="  idle_unload_seconds: 600\n",
    )
    config = parse_config(raw)
    assert config.idle_unload_for("qwen") == 5
    assert config.idle_unload_for("b") == 600
    assert config.idle_unload_for("c") == 0


def test_fake_model_needs_no_source_and_gets_default_settings() -> None:
    """An ``engine: fake`` model may omit path; its fake settings default and its source says fake."""
    config = parse_config(one_model("  - {name: f, engine: fake, estimated_memory_gb: 1}\n"))
    f = config.model("f")
    assert f is not None and f.source == "fake:f" and f.is_local
    assert f.fake is not None and f.fake.load_seconds == 2.0 and f.fake.fail_loads == ()


def test_fake_settings_are_read() -> None:
    """Every ``fake:`` key lands in FakeSettings."""
    raw = one_model(
        "  - name: f\n    engine: fake\n"
        "    fake: {load_seconds: 1.5, unload_seconds: 0.5, tokens_per_second: 30,"
        " fail_loads: [2, 3], fail_unloads: [1], reply: hi, memory_gb: 0.25}\n"
    )
    f = parse_config(raw).model("f")
    assert f is not None and f.fake is not None
    assert (f.fake.load_seconds, f.fake.unload_seconds, f.fake.tokens_per_second) == (1.5, 0.5, 30)
    assert (f.fake.fail_loads, f.fake.fail_unloads, f.fake.reply) == ((2, 3), (1,), "hi")
    assert f.fake.memory_bytes == GIB // 4


# ---- the contention policy ---------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_policy_default_timeout_per_strategy(strategy: str) -> None:
    """wait_timeout_s defaults to 30 s for every strategy except ``wait``, which is unbounded."""
    raw = one_model(manager=f"  contention_policy: {{strategy: {strategy}}}\n")
    policy = parse_config(raw).manager.contention_policy
    assert policy.strategy == strategy
    assert policy.wait_timeout_s == (None if strategy == "wait" else 30.0)
    assert policy.preempt_after_s is None
    assert ContentionPolicy.of(strategy) == policy


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_policy_explicit_null_timeout_is_unbounded(strategy: str) -> None:
    """``wait_timeout_s: null`` means no bound, whatever the strategy."""
    raw = one_model(
        manager=f"  contention_policy: {{strategy: {strategy}, wait_timeout_s: null}}\n"
    )
    assert parse_config(raw).manager.contention_policy.wait_timeout_s is None


def test_policy_explicit_timeout_bounds_wait() -> None:
    """An explicit wait_timeout_s bounds even the ``wait`` strategy."""
    raw = one_model(manager="  contention_policy: {strategy: wait, wait_timeout_s: 12.5}\n")
    assert parse_config(raw).manager.contention_policy.wait_timeout_s == 12.5


def test_policy_preempt_after_is_kept_and_delays_preemption() -> None:
    """wait_then_preempt keeps preempt_after_s; its preempt delay is that value (0 when unset)."""
    raw = one_model(
        manager="  contention_policy: {strategy: wait_then_preempt, preempt_after_s: 4}\n"
    )
    policy = parse_config(raw).manager.contention_policy
    assert policy.preempt_after_s == 4 and policy.preempt_delay_s == 4
    assert ContentionPolicy.of("wait_then_preempt").preempt_delay_s == 0.0


def test_policy_preempt_after_on_other_strategy_warns() -> None:
    """preempt_after_s on a strategy that never uses it is accepted with one warning."""
    raw = one_model(manager="  contention_policy: {strategy: wait, preempt_after_s: 3}\n")
    config = parse_config(raw)
    assert len(config.warnings) == 1
    assert config.warnings[0].startswith("manager.contention_policy.preempt_after_s: ignored")


def test_policy_timeout_on_fail_is_its_bound() -> None:
    """wait_timeout_s with strategy ``fail`` bounds its only waits (for evicted idle models to stop)."""
    raw = one_model(manager="  contention_policy: {strategy: fail, wait_timeout_s: 3}\n")
    config = parse_config(raw)
    assert config.warnings == ()
    assert config.manager.contention_policy.wait_timeout_s == 3


# ---- the memory budget -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (16, 16 * GIB),
        (0.5, GIB // 2),
        ("16gb", 16 * GIB),
        ("16GB", 16 * GIB),
        (" 16 gb ", 16 * GIB),
        ("512mb", 512 * MIB),
        ("1.5mb", int(1.5 * MIB)),
        ("1000000b", 1_000_000),
        ("1e6b", 1_000_000),
        ("2", 2 * GIB),
    ],
)
def test_memory_size_grammar(value: object, expected: int) -> None:
    """Sizes follow the seed's grammar: numbers are GB; strings end in gb, mb, b, or are GB."""
    assert parse_memory_size(value) == expected


@pytest.mark.parametrize(
    "value",
    ["", "gb", "16 gigs", "16kb", "-1gb", "0", "0mb", "nan", "inf", "0.1b", True, None, [16], -3],
)
def test_memory_size_rejects(value: object) -> None:
    """Sizes that are not positive, finite, at least a byte, or not in the grammar raise ValueError."""
    with pytest.raises(ValueError):
        parse_memory_size(value)


def test_memory_budget_string_key_is_parsed() -> None:
    """``memory_budget: 512mb`` sets the budget in bytes."""
    raw = one_model()
    raw["manager"] = {"memory_budget": "512mb"}
    assert parse_config(raw).manager.memory_budget_bytes == 512 * MIB


# ---- memory estimates --------------------------------------------------------------------


def test_estimate_order_explicit_then_measured_then_weights(tmp_path: Path) -> None:
    """The estimate is estimated_memory_gb, else the measured size, else the summed weight files."""
    model_dir = make_weights(
        tmp_path / "m", {"a.safetensors": 1000, "b.safetensors": 500, "x.bin": 7}
    )
    text = (
        "manager: {memory_budget_gb: 8}\nmodels:\n"
        "  - {name: explicit, path: ./m, estimated_memory_gb: 1}\n"
        "  - {name: measured, path: ./m}\n"
        "  - {name: weights, path: ./m}\n"
    )
    path = write(tmp_path, text)
    weights = weights_fingerprint(load_config(path).model("measured"))  # type: ignore[arg-type]
    config = load_config(
        path, measured={"explicit": Measurement(99, weights), "measured": Measurement(4242, weights)}
    )
    assert config.model("weights").source == str(model_dir)  # type: ignore[union-attr]
    assert (
        config.estimate("explicit").bytes == GIB and config.estimate("explicit").source == "config"
    )
    assert (config.estimate("measured").bytes, config.estimate("measured").source) == (
        4242,
        "measured",
    )
    assert (config.estimate("weights").bytes, config.estimate("weights").source) == (
        1500,
        "weights",
    )
    # A later measurement passed by the daemon replaces the one the config was loaded with.
    assert config.estimate("weights", {"weights": Measurement(77, weights)}).bytes == 77


def test_gguf_weights_count(tmp_path: Path) -> None:
    """``*.gguf`` files count as weights too, in nested folders."""
    make_weights(tmp_path / "m" / "sub", {"w.gguf": 321})
    path = write(tmp_path, "manager: {memory_budget_gb: 8}\nmodels:\n  - {name: g, path: ./m}\n")
    assert load_config(path).estimate("g").bytes == 321


def test_measured_size_admits_hub_model_across_restarts(tmp_path: Path) -> None:
    """A Hub model without an estimate is rejected, but accepted once the journal has measured it."""
    path = write(
        tmp_path, f"manager: {{memory_budget_gb: 8}}\nmodels:\n  - {{name: q, path: {HUB}}}\n"
    )
    with pytest.raises(ConfigError, match=r"^models\[0\]\.estimated_memory_gb: required"):
        load_config(path)
    measured = {"q": Measurement(123_456, weights_fingerprint(ModelConfig("q", HUB)))}
    first = load_config(path, measured=measured)
    second = load_config(path, measured=measured)
    assert first.estimate("q") == second.estimate("q")
    assert first.estimate("q").source == "measured"


def test_measured_may_be_read_from_the_journal_settings(tmp_path: Path) -> None:
    """``measured`` may be a function of the parsed journal settings (read before the models)."""
    seen: list[JournalConfig] = []

    def read(journal: JournalConfig) -> dict[str, Measurement]:
        seen.append(journal)
        return {"q": Measurement(5, weights_fingerprint(ModelConfig("q", HUB)))}

    text = f"journal: {{path: j.db}}\nmanager: {{memory_budget_gb: 8}}\nmodels:\n  - {{name: q, path: {HUB}}}\n"
    config = load_config(write(tmp_path, text), measured=read)
    assert seen == [config.journal] and config.journal.path == tmp_path / "j.db"
    assert config.estimate("q").bytes == 5


def test_fake_memory_is_the_last_resort(tmp_path: Path) -> None:
    """A fake model without estimated_memory_gb uses fake.memory_gb, after a measured size."""
    raw = one_model("  - {name: f, engine: fake, fake: {memory_gb: 2}}\n")
    assert parse_config(raw).estimate("f").source == "fake"
    weights = weights_fingerprint(parse_config(raw).model("f"))  # type: ignore[arg-type]
    assert parse_config(raw, measured={"f": Measurement(9, weights)}).estimate("f").source == "measured"
    explicit = one_model(
        "  - {name: f, engine: fake, estimated_memory_gb: 1, fake: {memory_gb: 2}}\n"
    )
    assert parse_config(explicit).estimate("f").bytes == GIB


def test_resolve_estimate_ignores_non_positive_measurements() -> None:
    """A zero or negative measurement is not an estimate."""
    model = ModelConfig(name="x", source="org/x", estimated_memory_bytes=None)
    weights = weights_fingerprint(model)
    assert resolve_estimate(model, {"x": Measurement(0, weights)}) is None
    assert resolve_estimate(model, {"x": Measurement(-1, weights)}) is None
    assert resolve_estimate(model, {"x": Measurement(10, weights)}).bytes == 10  # type: ignore[union-attr]


def test_estimate_of_unknown_model_is_a_key_error() -> None:
    """Asking the estimate of a model that is not configured raises KeyError."""
    with pytest.raises(KeyError):
        parse_config(one_model()).estimate("nope")


def test_estimate_of_model_built_in_code_without_one() -> None:
    """A config built in code with no estimate for a Hub model raises ConfigError from estimate()."""
    config = Config(models=(ModelConfig(name="x", source="org/x"),))
    with pytest.raises(ConfigError):
        config.estimate("x")


def test_gb_values_are_binary_gigabytes() -> None:
    """estimated_memory_gb uses 1024**3 bytes per GB, like the seed."""
    config = parse_config(one_model())
    assert config.estimate("qwen").bytes == GIB // 2
    assert math.isclose(config.manager.memory_budget_bytes / GIB, 8)


# ---- sources and paths -------------------------------------------------------------------


def test_relative_local_path_resolves_against_config_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``./model`` and a bare existing folder name are local, relative to the config file's folder."""
    make_weights(tmp_path / "conf" / "model", {"w.safetensors": 10})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    text = "manager: {memory_budget_gb: 1}\nmodels:\n  - {name: a, path: ./model}\n  - {name: b, path: model}\n"
    (tmp_path / "conf" / "models.yaml").write_text(text)
    config = load_config(tmp_path / "conf" / "models.yaml")
    for name in ("a", "b"):
        m = config.model(name)
        assert m is not None and m.source_kind == "local" and m.is_local
        assert m.source == str(tmp_path / "conf" / "model")


def test_hub_repo_id_is_kept_as_written() -> None:
    """A source shaped like org/name that is not a local folder is a Hub repo id."""
    m = parse_config(one_model()).models[0]
    assert (m.source, m.source_kind, m.is_local) == (HUB, "hub", False)


def test_state_dir_variable_expands_even_when_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``$MLXD_STATE_DIR`` and ``${MLXD_STATE_DIR}`` expand to default_state_dir() when unset."""
    monkeypatch.delenv("MLXD_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    raw = one_model(
        "  - {name: d, path: '${MLXD_STATE_DIR}/demo', demo: tiny, estimated_memory_gb: 0.01}\n"
    )
    raw["journal"] = {"path": "$MLXD_STATE_DIR/j.db"}
    config = parse_config(raw)
    assert config.journal.path == default_state_dir() / "j.db"
    assert config.model("d").source == str(default_state_dir() / "demo")  # type: ignore[union-attr]


def test_home_and_variables_expand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``~`` and ``$VAR`` expand in journal.path, image_dir and local sources."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLXD_TEST_MODELS", str(tmp_path / "models"))
    make_weights(tmp_path / "models" / "m", {"w.safetensors": 3})
    (tmp_path / "home" / "pics").mkdir(parents=True)
    raw = one_model("  - {name: v, path: $MLXD_TEST_MODELS/m, mllm: true, image_dir: ~/pics}\n")
    raw["journal"] = {"path": "~/j.db", "synchronous": "normal"}
    config = parse_config(raw)
    v = config.model("v")
    assert v is not None and v.source == str(tmp_path / "models" / "m") and v.source_kind == "local"
    assert v.image_dir == tmp_path / "home" / "pics"
    assert config.journal == JournalConfig(tmp_path / "home" / "j.db", "normal")
    assert config.warnings == ()


def test_image_dir_without_mllm_warns() -> None:
    """image_dir on a text model is accepted with a warning that it is ignored."""
    config = parse_config(one_model("    image_dir: /tmp\n"))
    assert config.warnings == ("models[0].image_dir (qwen): ignored: only mllm models read images",)


def test_demo_model_may_point_at_a_missing_folder(state_dir: Path) -> None:
    """A ``demo:`` model's folder need not exist yet (it is written on first load)."""
    raw = one_model(
        "  - {name: d, path: $MLXD_STATE_DIR/x, demo: small, estimated_memory_gb: 0.1}\n"
        "  - {name: v, path: $MLXD_STATE_DIR/v, demo: vision, mllm: true, estimated_memory_gb: 0.1}\n"
    )
    config = parse_config(raw)
    assert config.model("d").demo == "small"  # type: ignore[union-attr]
    assert config.model("v").demo == "vision"  # type: ignore[union-attr]
    assert not (state_dir / "x").exists()


def test_parse_config_errors_have_no_file_suffix() -> None:
    """Errors from parse_config (no file) are just the key path and the reason."""
    raw = one_model("    max_queue: 0\n")
    with pytest.raises(ConfigError) as e:
        parse_config(raw)
    assert e.value.message == "models[0].max_queue: must be an integer >= 1 (got 0)"
    assert e.value.param == "models[0].max_queue"


def test_relative_state_dir_is_relative_to_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative ``MLXD_STATE_DIR`` means the same folder the daemon uses, not one beside the config."""
    (tmp_path / "conf").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLXD_STATE_DIR", "state-rel")
    path = write(
        tmp_path / "conf",
        "journal: {path: $MLXD_STATE_DIR/j.db}\n"
        + "manager: {memory_budget_gb: 1}\nmodels:\n  - {name: f, engine: fake, estimated_memory_gb: 1}\n",
    )
    assert load_config(path).journal.path == tmp_path / "state-rel" / "j.db"


def test_multiple_yaml_documents_are_rejected(tmp_path: Path) -> None:
    """A file with two YAML documents is a syntax error naming the file and line."""
    path = write(tmp_path, "models: []\n---\nmodels: []\n")
    with pytest.raises(
        ConfigError,
        match=r"models\.yaml:2:1: invalid YAML: expected a single document in the stream, but found another",
    ):
        load_config(path)


def test_the_manager_budgets_with_the_configs_own_rules(tmp_path: Path) -> None:
    """Each model's budgeted size and idle timeout are Config.estimate and Config.idle_unload_for (measured sizes included)."""
    raw = {
        "manager": {"memory_budget_gb": 8, "idle_unload_seconds": 30},
        "models": [
            {"name": "set", "engine": "fake", "estimated_memory_gb": 1, "idle_unload_seconds": 5},
            {"name": "measured", "engine": "fake", "fake": {"memory_gb": 2}},
            {"name": "pinned", "engine": "fake", "estimated_memory_gb": 1, "pin": True,
             "idle_unload_seconds": 9},
        ],
    }
    config = parse_config(raw, path=tmp_path / "models.yaml")
    measured = {"measured": Measurement(3 * GIB, weights_fingerprint(config.models[1]))}
    manager = Manager(config, FakeFleet(), measured=measured)
    for model in config.models:
        spec = manager.model_snapshot(model.name).spec
        assert spec.size_bytes == config.estimate(model.name, measured).bytes
        assert spec.idle_unload_s == config.idle_unload_for(model.name)
    assert [manager.model_snapshot(n).spec.idle_unload_s for n in ("set", "measured", "pinned")] == [5, 30, 0]
    assert manager.model_snapshot("measured").spec.size_bytes == 3 * GIB
