"""Service files: the plist `mlxd launchd-plist` prints, the static plist template and the systemd unit."""

from __future__ import annotations

import configparser
import os
import plistlib
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from mlxd.cli import service_files
from mlxd.cli.service_files import EXIT_MARGIN_S, plist_dict, render_plist
from tests.support.daemon import MLXD, REPO

FILES = REPO / "systemd-like-plists"
TEMPLATE = FILES / "com.mlxd.daemon.plist"
UNIT = FILES / "mlxd.service"


def launchd_plist(*args: str, cwd: Path = REPO) -> tuple[dict[str, Any], str, str]:
    """Run `mlxd launchd-plist ARGS`; its plist parsed, its raw stdout and its stderr."""
    r = subprocess.run([*MLXD, "launchd-plist", *args], capture_output=True, text=True, cwd=cwd,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    return plistlib.loads(r.stdout.encode()), r.stdout, r.stderr


def write_config(path: Path, grace: float, key_env: str = "MLXD_API_KEY") -> Path:
    raw = {"server": {"shutdown_grace_s": grace, "api_key_env": key_env},
           "manager": {"memory_budget_gb": 1},
           "models": [{"name": "a", "engine": "fake", "estimated_memory_gb": 0.1}]}
    path.write_text(yaml.safe_dump(raw))
    return path


def test_default_plist_runs_serve_at_load_and_keeps_it_alive() -> None:
    """Without options the printed plist parses and runs `mlxd serve` at load, kept alive, labelled com.mlxd.daemon."""
    job, _, stderr = launchd_plist()
    assert job["Label"] == "com.mlxd.daemon"
    assert job["RunAtLoad"] is True and job["KeepAlive"] is True
    program = job["ProgramArguments"]
    access_log = str(Path.home() / "Library" / "Logs" / "mlxd" / "access.log")
    assert program[-3:] == ["serve", "--access-log", access_log]
    assert Path(program[0]).is_absolute() and Path(program[0]).exists()
    assert program[1:-2] in (["serve"], ["-m", "mlxd", "serve"])
    assert job["ExitTimeOut"] > 10  # the default shutdown grace
    assert job["ProcessType"] in ("Interactive", "Background")
    assert job["SoftResourceLimits"]["NumberOfFiles"] >= 1024
    logs = Path.home() / "Library" / "Logs" / "mlxd"
    assert Path(job["StandardOutPath"]).parent == logs == Path(job["StandardErrorPath"]).parent
    assert job["EnvironmentVariables"]["MLXD_API_KEY"] == ""
    assert Path(job["WorkingDirectory"]).is_absolute()
    assert "launchctl bootstrap gui/$(id -u) ~/Library/LaunchAgents/com.mlxd.daemon.plist" in stderr
    assert "launchctl bootout gui/$(id -u)/com.mlxd.daemon" in stderr


def test_plist_follows_the_config_and_label(tmp_path: Path) -> None:
    """With --config (relative) and --label the plist serves that config by absolute path, waits past its grace, and names its key variable."""
    write_config(tmp_path / "models.yaml", grace=25, key_env="MY_KEY")
    job, _, stderr = launchd_plist("--config", "models.yaml", "--label", "org.example.mlxd",
                                   cwd=tmp_path)
    assert job["Label"] == "org.example.mlxd"
    access_log = str(Path.home() / "Library" / "Logs" / "mlxd" / "access.log")
    assert job["ProgramArguments"][-5:-2] == ["serve", "--access-log", access_log]
    assert job["ProgramArguments"][-2:] == ["--config", str(tmp_path / "models.yaml")]
    assert job["ExitTimeOut"] > 25
    assert job["ExitTimeOut"] == 25 + EXIT_MARGIN_S
    assert "MY_KEY" in job["EnvironmentVariables"]
    assert "MLXD_API_KEY" not in job["EnvironmentVariables"]
    assert "launchctl bootout gui/$(id -u)/org.example.mlxd" in stderr


def test_plist_explains_its_choices_in_comments() -> None:
    """The printed plist carries XML comments before ExitTimeOut, ProcessType and the API key."""
    _, text, _ = launchd_plist()
    for key in ("ExitTimeOut", "ProcessType", "MLXD_API_KEY", "SoftResourceLimits"):
        assert re.search(rf"<!-- [^\n]+ -->\n\s*<key>{key}</key>", text), key


def test_bad_config_exits_2(tmp_path: Path) -> None:
    """A config that does not load makes `mlxd launchd-plist` exit 2 with one line, before any plist."""
    r = subprocess.run([*MLXD, "launchd-plist", "--config", str(tmp_path / "missing.yaml")],
                       capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert r.returncode == 2
    assert r.stdout == "" and r.stderr.startswith("mlxd: ") and r.stderr.count("\n") == 1


def test_comments_never_break_the_xml(monkeypatch: pytest.MonkeyPatch) -> None:
    """A comment text with `--` (illegal inside an XML comment) is refused rather than written."""
    job = plist_dict(label="x", program=["/bin/mlxd", "serve"], home=Path("/h"), grace_s=1,
                     api_key_env="MLXD_API_KEY")
    assert plistlib.loads(render_plist(job).encode()) == job
    monkeypatch.setitem(service_files.COMMENTS, ("Label",), "use --label")
    with pytest.raises(ValueError, match="XML comment"):
        render_plist(job)


def test_template_is_the_printed_plist_with_placeholders() -> None:
    """The static template parses and has exactly the keys and values the command prints, with placeholder paths."""
    template = plistlib.loads(TEMPLATE.read_bytes())
    home = Path("/Users/YOU")
    program = template["ProgramArguments"]
    assert program[1:] == ["serve", "--access-log", "/Users/YOU/Library/Logs/mlxd/access.log",
                           "--config", "/Users/YOU/.config/mlxd/models.yaml"]
    assert template == plist_dict(label="com.mlxd.daemon", program=program, home=home,
                                  grace_s=10, api_key_env="MLXD_API_KEY")
    printed, _, _ = launchd_plist()
    assert set(template) == set(printed)


def unit_settings() -> dict[str, list[str]]:
    """Every `Key=value` of the systemd unit's [Service] section (keys may repeat)."""
    settings: dict[str, list[str]] = {}
    section = ""
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
            continue
        key, _, value = line.partition("=")
        settings.setdefault(f"{section}{key}", []).append(value)
    return settings


def test_systemd_unit_runs_serve_and_stops_after_the_grace() -> None:
    """The systemd user unit runs `mlxd serve`, stops it with SIGTERM after more than the grace, restarts on failure."""
    s = unit_settings()
    assert s["[Service]Type"] == ["simple"]
    assert re.fullmatch(r"\S+/mlxd serve( --config \S+)?", s["[Service]ExecStart"][0])
    assert s["[Service]KillSignal"] == ["SIGTERM"]
    assert int(s["[Service]TimeoutStopSec"][0]) > 10
    assert s["[Service]Restart"] == ["on-failure"]
    assert "MALLOC_MMAP_THRESHOLD_=131072" in s["[Service]Environment"]
    assert s["[Service]EnvironmentFile"] == ["-%h/.config/mlxd/env"]
    assert s["[Install]WantedBy"] == ["default.target"]
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.read_string(UNIT.read_text())  # well-formed INI sections
    assert parser.sections() == ["Unit", "Service", "Install"]


def test_readme_has_install_and_removal_for_both() -> None:
    """The README in systemd-like-plists gives the launchctl and systemctl install and removal commands."""
    text = (FILES / "README.md").read_text()
    for command in ("launchctl bootstrap gui/$(id -u)", "launchctl bootout gui/$(id -u)/com.mlxd.daemon",
                    "systemctl --user enable --now mlxd", "systemctl --user disable --now mlxd"):
        assert command in text, command


def test_launchd_plist_help() -> None:
    """`mlxd launchd-plist --help` exits 0 and lists --config and --label."""
    r = subprocess.run([*MLXD, "launchd-plist", "--help"], capture_output=True, text=True,
                       cwd=REPO, timeout=60, check=False)
    assert r.returncode == 0
    assert "--config" in r.stdout and "--label" in r.stdout
