"""Malformed configs: each is rejected by ``mlxd check-config`` with exit 2, its error naming the key path first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlxd.cli import main

BUDGET = "manager:\n  memory_budget_gb: 8\n"
QWEN = (
    "  - name: qwen\n"
    "    path: mlx-community/Qwen2.5-0.5B-Instruct-4bit\n"
    "    estimated_memory_gb: 0.5\n"
)


def cfg(model_extra: str = "", *, manager: str = BUDGET, top: str = "") -> str:
    """A valid config with one Hub model, plus extra model keys / sections."""
    return f"{top}{manager}models:\n{QWEN}{model_extra}"


def fake(extra: str = "") -> str:
    return cfg(f"  - name: f\n    engine: fake\n{extra}")


# Nine levels of nested aliases ("billion laughs"): 10**9 leaves if walked naively.
LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n"
    for p, n in zip("abcdefgh", "bcdefghi", strict=True)
)


# (id, YAML text, the key path the one-line error starts with, a fragment it contains)
# fmt: off
CASES: list[tuple[str, str, str, str]] = [
    # YAML itself
    ("yaml-unclosed-flow", "models: [\n", "{file}:2", "invalid YAML"),
    ("yaml-bad-mapping", "manager: memory_budget_gb: 8\n", "{file}:1", "invalid YAML"),
    ("yaml-tab-indent", "models:\n\t- name: a\n", "{file}:2", "invalid YAML"),
    ("yaml-python-tag", "models: !!python/object:os.system []\n", "{file}:1", "invalid YAML"),
    ("yaml-duplicate-key", cfg("    name: again\n"), "models[0].name", "given twice"),
    ("yaml-alias-bomb", LAUGHS + cfg(), "a", "unknown key"),
    # top level
    ("top-is-list", "- a\n- b\n", "top level", "must be a mapping"),
    ("top-empty-file", "", "models", "required"),
    ("top-unknown-key-hint", cfg(top="model: []\n"), "model", "did you mean 'models'?"),
    ("top-non-string-key", cfg(top="1: x\n"), "top level", "keys must be strings"),
    # models list
    ("models-not-list", BUDGET + "models: {qwen: x}\n", "models", "must be a list"),
    ("models-empty", BUDGET + "models: []\n", "models", "at least one model"),
    ("models-null", BUDGET + "models:\n", "models", "required"),
    ("model-not-mapping", BUDGET + "models:\n  - qwen\n", "models[0]", "must be a mapping (got 'qwen')"),
    ("model-unknown-key-hint", cfg("    estimated_memory_g: 1\n"), "models[0].estimated_memory_g", "did you mean 'estimated_memory_gb'?"),
    ("model-unknown-key-no-hint", cfg("    zzz: 1\n"), "models[0].zzz", "unknown key"),
    ("model-non-string-key", cfg("    2: x\n"), "models[0]", "keys must be strings (got 2)"),
    # names
    ("name-missing", BUDGET + "models:\n  - path: mlx-community/x\n    estimated_memory_gb: 1\n", "models[0].name", "required"),
    ("name-not-string", BUDGET + "models:\n  - name: 123\n    engine: fake\n    estimated_memory_gb: 1\n", "models[0].name", "must be a string (got 123)"),
    ("name-empty", BUDGET + "models:\n  - name: ''\n    engine: fake\n    estimated_memory_gb: 1\n", "models[0].name", "must not be empty"),
    ("name-whitespace", BUDGET + "models:\n  - name: my model\n    engine: fake\n    estimated_memory_gb: 1\n", "models[0].name", "whitespace"),
    ("name-control-char", BUDGET + 'models:\n  - name: "a\\tb"\n    engine: fake\n    estimated_memory_gb: 1\n', "models[0].name", "control characters"),
    ("name-too-long", BUDGET + f"models:\n  - name: {'x' * 129}\n    engine: fake\n    estimated_memory_gb: 1\n", "models[0].name", "at most 128"),
    ("name-duplicate", cfg("  - name: qwen\n    engine: fake\n    estimated_memory_gb: 1\n"), "models[1].name", "models[0].name has it too"),
    # sources
    ("source-missing", BUDGET + "models:\n  - name: a\n    estimated_memory_gb: 1\n", "models[0].path", "required"),
    ("source-two-different", BUDGET + "models:\n  - name: a\n    path: org/a\n    source: org/b\n    estimated_memory_gb: 1\n", "models[0].source", "conflicts with path"),
    ("source-three-keys", BUDGET + "models:\n  - name: a\n    path: org/a\n    source: org/a\n    model: org/c\n    estimated_memory_gb: 1\n", "models[0].model", "conflicts with path"),
    ("source-not-string", BUDGET + "models:\n  - name: a\n    path: 42\n    estimated_memory_gb: 1\n", "models[0].path", "must be a string (got 42)"),
    ("source-bad-repo-id", BUDGET + "models:\n  - name: a\n    source: not/a/repo\n    estimated_memory_gb: 1\n", "models[0].source", "neither an existing local path"),
    ("source-repo-id-dashes", BUDGET + "models:\n  - name: a\n    model: org/bad--name\n    estimated_memory_gb: 1\n", "models[0].model", "Hugging Face repo id"),
    ("source-local-missing", BUDGET + "models:\n  - name: a\n    path: ./no-such-model\n", "models[0].path", "does not exist"),
    ("source-unset-variable", BUDGET + "models:\n  - name: a\n    path: $MLXD_TEST_NO_SUCH_VAR/m\n", "models[0].path", "$MLXD_TEST_NO_SUCH_VAR is not set"),
    ("source-is-a-file", BUDGET + "models:\n  - name: a\n    path: ./weights.txt\n", "models[0].path", "is a file"),
    # estimates
    ("estimate-missing-hub", BUDGET + "models:\n  - name: a\n    path: mlx-community/a\n", "models[0].estimated_memory_gb", "Hugging Face repo id"),
    ("estimate-missing-local-no-weights", BUDGET + "models:\n  - name: a\n    path: ./empty-model\n", "models[0].estimated_memory_gb", "no *.safetensors or *.gguf"),
    ("estimate-negative", cfg("  - name: b\n    path: org/b\n    estimated_memory_gb: -1\n"), "models[1].estimated_memory_gb", "must be a positive number (got -1)"),
    ("estimate-zero", cfg("  - name: b\n    path: org/b\n    estimated_memory_gb: 0\n"), "models[1].estimated_memory_gb", "positive number"),
    ("estimate-string", cfg("  - name: b\n    path: org/b\n    estimated_memory_gb: '0.5'\n"), "models[1].estimated_memory_gb", "(got '0.5')"),
    ("estimate-nan", cfg("  - name: b\n    path: org/b\n    estimated_memory_gb: .nan\n"), "models[1].estimated_memory_gb", "finite"),
    ("estimate-inf", cfg("  - name: b\n    path: org/b\n    estimated_memory_gb: .inf\n"), "models[1].estimated_memory_gb", "finite"),
    ("estimate-bool", cfg("  - name: b\n    path: org/b\n    estimated_memory_gb: true\n"), "models[1].estimated_memory_gb", "(got true)"),
    ("estimate-missing-fake", fake(), "models[1].estimated_memory_gb", "fake.memory_gb"),
    # booleans
    ("preload-quoted-yes", cfg('    preload: "yes"\n'), "models[0].preload", "true or false (got 'yes')"),
    ("pin-integer", cfg("    pin: 1\n"), "models[0].pin", "true or false (got 1)"),
    ("mllm-null", cfg("    mllm:\n"), "models[0].mllm", "(got null)"),
    ("restore-string", cfg(manager=BUDGET + "  restore_on_start: 'no'\n"), "manager.restore_on_start", "true or false"),
    # engine and per-model numbers
    ("engine-unknown", cfg("    engine: torch\n"), "models[0].engine", "one of mlx, fake"),
    ("max-queue-zero", cfg("    max_queue: 0\n"), "models[0].max_queue", "integer >= 1 (got 0)"),
    ("max-queue-float", cfg("    max_queue: 2.5\n"), "models[0].max_queue", "must be an integer (got 2.5)"),
    ("max-batch-bool", cfg("    max_batch_size: true\n"), "models[0].max_batch_size", "must be an integer"),
    ("model-idle-negative", cfg("    idle_unload_seconds: -5\n"), "models[0].idle_unload_seconds", ">= 0 (got -5)"),
    # fake
    ("fake-on-mlx-model", cfg("    fake: {load_seconds: 1}\n"), "models[0].fake", "only allowed with engine: fake"),
    ("fake-not-mapping", fake("    fake: fast\n"), "models[1].fake", "must be a mapping"),
    ("fake-unknown-key", fake("    fake: {load_secs: 1}\n"), "models[1].fake.load_secs", "did you mean 'load_seconds'?"),
    ("fake-fail-loads-zero", fake("    fake: {memory_gb: 1, fail_loads: [1, 0]}\n"), "models[1].fake.fail_loads[1]", ">= 1 (got 0)"),
    ("fake-fail-unloads-not-list", fake("    fake: {memory_gb: 1, fail_unloads: 2}\n"), "models[1].fake.fail_unloads", "must be a list"),
    ("fake-tokens-zero", fake("    fake: {memory_gb: 1, tokens_per_second: 0}\n"), "models[1].fake.tokens_per_second", "positive"),
    ("fake-load-negative", fake("    fake: {memory_gb: 1, load_seconds: -1}\n"), "models[1].fake.load_seconds", ">= 0"),
    ("fake-memory-negative", fake("    fake: {memory_gb: -2}\n"), "models[1].fake.memory_gb", "positive"),
    # demo and images
    ("demo-unknown-kind", BUDGET + "models:\n  - name: d\n    path: ./d\n    demo: huge\n    estimated_memory_gb: 0.1\n", "models[0].demo", "one of tiny, small, vision"),
    ("demo-vision-without-mllm", BUDGET + "models:\n  - name: d\n    path: ./d\n    demo: vision\n    estimated_memory_gb: 0.1\n", "models[0].demo", "mllm: true"),
    ("demo-on-fake", fake("    demo: tiny\n    estimated_memory_gb: 1\n"), "models[1].demo", "only for engine: mlx"),
    ("demo-hub-source", BUDGET + "models:\n  - name: d\n    path: org/d\n    demo: tiny\n    estimated_memory_gb: 0.1\n", "models[0].demo", "needs a local path"),
    ("demo-missing-estimate", BUDGET + "models:\n  - name: d\n    path: ./d\n    demo: tiny\n", "models[0].estimated_memory_gb", "demo model"),
    ("image-dir-is-file", cfg("    mllm: true\n    image_dir: ./weights.txt\n"), "models[0].image_dir", "not a directory"),
    # vllm-mlx engine keys
    ("gpu-util-above-one", cfg("    gpu_memory_utilization: 1.5\n"), "models[0].gpu_memory_utilization", "in (0, 1] (got 1.5)"),
    ("gpu-util-zero", cfg("    gpu_memory_utilization: 0\n"), "models[0].gpu_memory_utilization", "(0, 1]"),
    ("gpu-util-nan", cfg("    gpu_memory_utilization: .nan\n"), "models[0].gpu_memory_utilization", "finite"),
    ("gpu-util-string", cfg("    gpu_memory_utilization: '0.9'\n"), "models[0].gpu_memory_utilization", "(got '0.9')"),
    ("continuous-batching-string", cfg("    continuous_batching: 'true'\n"), "models[0].continuous_batching", "true or false"),
    ("prefill-step-string", cfg("    prefill_step_size: '2048'\n"), "models[0].prefill_step_size", "must be an integer"),
    # manager: memory budget
    ("budget-missing", "models:\n" + QWEN, "manager.memory_budget_gb", "required"),
    ("budget-both-keys", cfg(manager="manager:\n  memory_budget_gb: 8\n  memory_budget: 8gb\n"), "manager.memory_budget", "conflicts with memory_budget_gb"),
    ("budget-bad-unit", cfg(manager="manager:\n  memory_budget: 16 gigs\n"), "manager.memory_budget", "a size like '16gb'"),
    ("budget-negative-string", cfg(manager="manager:\n  memory_budget: -5gb\n"), "manager.memory_budget", "positive size"),
    ("budget-nan-string", cfg(manager="manager:\n  memory_budget: nan\n"), "manager.memory_budget", "finite"),
    ("budget-below-one-byte", cfg(manager="manager:\n  memory_budget: 0.5b\n"), "manager.memory_budget", "at least one byte"),
    ("budget-list", cfg(manager="manager:\n  memory_budget: [16]\n"), "manager.memory_budget", "(got a list)"),
    ("budget-gb-string", cfg(manager="manager:\n  memory_budget_gb: '16'\n"), "manager.memory_budget_gb", "(got '16')"),
    ("budget-gb-inf", cfg(manager="manager:\n  memory_budget_gb: .inf\n"), "manager.memory_budget_gb", "finite"),
    ("budget-gb-bool", cfg(manager="manager:\n  memory_budget_gb: true\n"), "manager.memory_budget_gb", "(got true)"),
    ("budget-gb-zero", cfg(manager="manager:\n  memory_budget_gb: 0\n"), "manager.memory_budget_gb", "positive"),
    ("manager-idle-negative", cfg(manager=BUDGET + "  idle_unload_seconds: -1\n"), "manager.idle_unload_seconds", ">= 0"),
    ("manager-unknown-key", cfg(manager=BUDGET + "  memory_budget_bg: 3\n"), "manager.memory_budget_bg", "did you mean"),
    # contention policy
    ("policy-bad-strategy", cfg(manager=BUDGET + "  contention_policy: {strategy: wait_and_see}\n"), "manager.contention_policy.strategy", "fail, wait, preempt, wait_then_fail, wait_then_preempt"),
    ("policy-not-mapping", cfg(manager=BUDGET + "  contention_policy: wait\n"), "manager.contention_policy", "must be a mapping"),
    ("policy-unknown-key", cfg(manager=BUDGET + "  contention_policy: {wait_timeout: 3}\n"), "manager.contention_policy.wait_timeout", "did you mean 'wait_timeout_s'?"),
    ("policy-timeout-zero", cfg(manager=BUDGET + "  contention_policy: {wait_timeout_s: 0}\n"), "manager.contention_policy.wait_timeout_s", "positive"),
    ("policy-timeout-negative", cfg(manager=BUDGET + "  contention_policy: {wait_timeout_s: -1}\n"), "manager.contention_policy.wait_timeout_s", "(got -1)"),
    ("policy-preempt-negative", cfg(manager=BUDGET + "  contention_policy: {strategy: wait_then_preempt, preempt_after_s: -1}\n" ), "manager.contention_policy.preempt_after_s", ">= 0"),
    # server
    ("server-not-mapping", cfg(top="server: 8080\n"), "server", "must be a mapping (got 8080)"),
    ("server-port-too-big", cfg(top="server: {port: 70000}\n"), "server.port", "from 0 to 65535 (got 70000)"),
    ("server-port-negative", cfg(top="server: {port: -1}\n"), "server.port", "from 0 to 65535"),
    ("server-ollama-port-too-big", cfg(top="server: {ollama_port: 70000}\n"), "server.ollama_port", "from 0 to 65535 (got 70000)"),
    ("server-ollama-port-string", cfg(top="server: {ollama_port: '11434'}\n"), "server.ollama_port", "must be an integer"),
    ("server-ollama-port-same", cfg(top="server: {port: 8080, ollama_port: 8080}\n"), "server.ollama_port", "must differ from server.port (8080)"),
    ("server-port-string", cfg(top="server: {port: '8080'}\n"), "server.port", "must be an integer (got '8080')"),
    ("server-unknown-key-hint", cfg(top="server: {prot: 8080}\n"), "server.prot", "did you mean 'port'?"),
    ("server-host-empty", cfg(top="server: {host: ''}\n"), "server.host", "must not be empty"),
    ("server-host-space", cfg(top="server: {host: 'local host'}\n"), "server.host", "host name or address"),
    ("server-grace-negative", cfg(top="server: {shutdown_grace_s: -1}\n"), "server.shutdown_grace_s", ">= 0"),
    ("server-body-zero", cfg(top="server: {max_body_mb: 0}\n"), "server.max_body_mb", "positive"),
    ("server-api-key-env", cfg(top="server: {api_key_env: MY-KEY}\n"), "server.api_key_env", "environment variable name"),
    # journal
    ("journal-synchronous", cfg(top="journal: {synchronous: extra}\n"), "journal.synchronous", "one of full, normal"),
    ("journal-path-unset-var", cfg(top="journal: {path: $MLXD_TEST_NO_SUCH_VAR/j.db}\n"), "journal.path", "is not set"),
    ("journal-path-number", cfg(top="journal: {path: 5}\n"), "journal.path", "must be a string"),
]
# fmt: on


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A config folder with a stray file and an empty model folder; the state dir in tmp."""
    monkeypatch.setenv("MLXD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("MLXD_TEST_NO_SUCH_VAR", raising=False)
    (tmp_path / "weights.txt").write_text("not a model")
    (tmp_path / "empty-model").mkdir()
    return tmp_path


def check_rejected(
    path: Path, capsys: pytest.CaptureFixture[str], key_path: str, fragment: str
) -> str:
    rc = main(["check-config", str(path)])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2, (out, err)
    if len(lines) > 1:  # several mistakes: a count, then one line each (the first is this one)
        assert lines[0] == f"mlxd: {len(lines) - 1} errors:", err
        lines = lines[1:]
    assert "Traceback" not in err
    assert out == ""
    assert lines[0].startswith(f"mlxd: {key_path.format(file=path)}"), lines[0]
    assert fragment in lines[0], lines[0]
    return lines[0]


def test_case_count() -> None:
    """The suite covers well over 40 distinct malformed configs."""
    assert len(CASES) >= 40
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(
    ("text", "key_path", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_malformed_config_is_rejected_with_key_path(
    workdir: Path, capsys: pytest.CaptureFixture[str], text: str, key_path: str, fragment: str
) -> None:
    """A malformed config exits 2 with one stderr line that starts with the offending key path."""
    path = workdir / "models.yaml"
    path.write_text(text)
    check_rejected(path, capsys, key_path, fragment)


def test_missing_file_names_the_file(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A config file that does not exist is a one-line error naming the file."""
    path = workdir / "nope.yaml"
    check_rejected(path, capsys, "{file}", "No such file")


def test_directory_instead_of_file(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A directory given as the config is a one-line error naming it."""
    check_rejected(workdir, capsys, "{file}", "cannot read config")


def test_non_utf8_file(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A config that is not UTF-8 text is a one-line error naming the file."""
    path = workdir / "latin1.yaml"
    path.write_bytes("models: [caf\xe9]\n".encode("latin-1"))
    check_rejected(path, capsys, "{file}", "not UTF-8")


def test_error_names_the_line(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An error in a file ends with the file and the line of the offending key."""
    path = workdir / "models.yaml"
    path.write_text(cfg("  - name: b\n    path: org/b\n    estimated_memory_gb: -1\n"))
    line = check_rejected(path, capsys, "models[1].estimated_memory_gb", "(got -1)")
    assert line.endswith(f"({path}, line 9)")


def test_missing_key_names_the_parent_line(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A required key that is absent points at the line of the entry that lacks it."""
    path = workdir / "models.yaml"
    path.write_text(cfg("  - name: b\n    path: org/b\n"))
    line = check_rejected(path, capsys, "models[1].estimated_memory_gb", "required")
    assert line.endswith("line 7)")


def _mlxd_executable() -> Path:
    exe = Path(sys.executable).parent / "mlxd"
    if not exe.exists():
        pytest.skip("the mlxd console script is not installed next to this Python")
    return exe


@pytest.mark.parametrize(
    ("text", "key_path"),
    [
        (
            cfg("    estimated_memory_g: 1\n"),
            "models[0].estimated_memory_g: unknown key (did you mean 'estimated_memory_gb'?)",
        ),
        (
            cfg(top="server: {port: 70000}\n"),
            "server.port: must be an integer from 0 to 65535 (got 70000)",
        ),
        ("models: [\n", "{file}:2:1: invalid YAML"),
    ],
    ids=["unknown-key", "bad-port", "yaml-syntax"],
)
def test_real_subprocess_rejects_with_one_line(workdir: Path, text: str, key_path: str) -> None:
    """The installed ``mlxd check-config`` exits 2 with exactly one stderr line and no traceback."""
    path = workdir / "models.yaml"
    path.write_text(text)
    proc = subprocess.run(
        [str(_mlxd_executable()), "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"mlxd: {key_path.format(file=path)}")
    assert "Traceback" not in proc.stderr


def test_real_subprocess_accepts_valid_config(workdir: Path) -> None:
    """The installed ``mlxd check-config`` exits 0 on a valid config and prints its report."""
    path = workdir / "models.yaml"
    path.write_text(cfg())
    proc = subprocess.run(
        [str(_mlxd_executable()), "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "qwen" in proc.stdout
    assert "8.00 GiB" in proc.stdout
