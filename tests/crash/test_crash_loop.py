"""Promise 8: after kill -9 at any moment the daemon restarts, recovers and loses nothing acknowledged.

The supervisor (``tests/crash/supervisor.py``) runs the real ``mlxd serve``
with fake engines, kills it at random moments and at named crash points, and
checks the journal after every kill and every restart. The default suite runs
61 kills (about two minutes on 2 cores); ``--stress`` runs 1,000 and writes
``bench/results/crash.md``. ``MLXD_CRASH_SEED`` replays a given sequence.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import random
from pathlib import Path

import pytest

from tests.crash.journal_view import Ack, Snapshot, ack_is_journaled
from tests.crash.supervisor import POINTS, CrashLoop, Summary, schedule

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "crash.md"


def _run(tmp_path: Path, random_kills: int, per_point: int) -> Summary:
    seed = int(os.environ.get("MLXD_CRASH_SEED") or random.SystemRandom().randrange(2**32))
    loop = CrashLoop(tmp_path, seed)
    summary = loop.run(schedule(random.Random(seed), random_kills, per_point))
    print("\n" + summary.markdown())
    return summary


def _assert_sound(summary: Summary, at_least: int) -> None:
    assert summary.violations == [], "\n".join(summary.violations[:20])
    assert summary.lost_acks == 0 and summary.illegal_pairs == 0
    assert summary.total >= at_least
    assert summary.acks > 0  # the traffic really had transitions acknowledged
    # every named point really killed the daemon at least once
    assert {k for k in summary.kills if k in POINTS} == set(POINTS)


def test_crash_loop_loses_nothing_acknowledged(tmp_path: Path) -> None:
    """61 SIGKILLs (random and at each named point) leave a sound journal, no lost ack, a right restore."""
    summary = _run(tmp_path, random_kills=24, per_point=6)
    _assert_sound(summary, 50)


@pytest.mark.stress
def test_crash_loop_a_thousand_kills(tmp_path: Path) -> None:
    """1,000 SIGKILLs leave a sound journal, no lost ack and a right restore every time."""
    summary = _run(tmp_path, random_kills=400, per_point=100)
    RESULTS.write_text(
        "# Crash loop\n\n"
        f"Machine: {platform.system()} {platform.release()} {platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}; date {dt.date.today()}; "
        "command: `.venv/bin/python -m pytest tests/crash/test_crash_loop.py --stress -s`\n\n"
        "The real `mlxd serve` (four fake models, 3 GB budget, wait_then_preempt, "
        "restore_on_start, journal synchronous=FULL) under three client threads (admin "
        "loads/unloads, chat, streaming chat), killed with SIGKILL at random moments and "
        "at the named crash points of `mlxd/crash_points.py`, then restarted. See "
        "`tests/crash/supervisor.py` for what is checked after each kill and restart.\n\n"
        + summary.markdown()
        + "\n"
    )
    _assert_sound(summary, 1000)


def test_the_ack_check_needs_the_acknowledged_state_in_the_reply_window() -> None:
    """An ack counts as journaled only if the model was in that state at the send or moved there before the reply."""
    snap = Snapshot(exists=True, transitions=[
        (1, 1, 10.0, "a", "unloaded", "loading", "admin"),
        (2, 1, 11.0, "a", "loading", "loaded", "admin"),
        (3, 1, 20.0, "a", "loaded", "unloading", "admin"),
    ])  # fmt: skip
    assert ack_is_journaled(snap, Ack("a", "loaded", 9.0, 12.0))  # loaded within the window
    assert ack_is_journaled(snap, Ack("a", "loaded", 15.0, 16.0))  # already loaded when asked
    assert ack_is_journaled(snap, Ack("b", "unloaded", 1.0, 2.0))  # never loaded
    assert not ack_is_journaled(snap, Ack("a", "loaded", 9.0, 10.5))  # the loaded row came later
    assert not ack_is_journaled(
        snap, Ack("a", "unloaded", 21.0, 22.0)
    )  # the unloaded row is missing
