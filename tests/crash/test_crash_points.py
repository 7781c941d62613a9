"""The crash points themselves: MLXD_CRASH_AT names a point and the Nth arrival SIGKILLs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from mlxd.crash_points import parse, parse_spec
from tests.support.daemon import REPO

_PROBE = """
import sys
from mlxd.crash_points import crash_point
for i in range(1, 6):
    crash_point("other")
    crash_point("here")
    print(i, flush=True)
"""


def _probe(spec: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MLXD_CRASH_AT"}
    if spec is not None:
        env["MLXD_CRASH_AT"] = spec
    return subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("spec", "printed", "killed"),
    [
        (None, "1 2 3 4 5", False),
        ("here", "", True),
        ("here:3", "1 2", True),
        ("elsewhere:1,here:2", "1", True),
        ("here:9", "1 2 3 4 5", False),
    ],
)
def test_the_nth_arrival_at_an_armed_point_kills_the_process(
    spec: str | None, printed: str, killed: bool
) -> None:
    """Only the armed point's Nth arrival kills, with SIGKILL, and nothing runs after it."""
    result = _probe(spec)
    assert result.stdout.split() == printed.split()
    assert result.returncode == (-signal.SIGKILL if killed else 0)
    assert ("crash point here:" in result.stderr) is killed


def test_a_malformed_spec_is_refused() -> None:
    """A count that is not a positive integer is an error, not a silently disarmed point."""
    assert parse("a:2, b") == {"a": 2, "b": 1}
    for bad in ("a:0", "a:x", ":3"):
        with pytest.raises(ValueError):
            parse(bad)


def test_a_point_can_abort_instead_of_kill() -> None:
    """``=abort`` ends the process with SIGABRT at the armed arrival, as an MLX assertion would."""
    result = _probe("here:2=abort")
    assert result.stdout.split() == ["1"]
    assert result.returncode == -signal.SIGABRT
    assert "crash point here:2 reached, abort" in result.stderr


def test_actions_are_parsed_and_unknown_ones_refused() -> None:
    assert parse_spec("a:2=stall,b=abort,c") == {"a": (2, "stall"), "b": (1, "abort"), "c": (1, "kill")}
    with pytest.raises(ValueError):
        parse_spec("a=explode")
