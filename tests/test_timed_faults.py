"""``kill-at`` and ``slow-save``: faults on a timer and in every save phase, parsed and fired for real.

The firing test runs a real process that is busy "saving" and checks that the timer's SIGKILL lands
without waiting for it, and that the record says which save phase it hit.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ckptrun.runtime.faults import Fault, FaultSpecError, parse_faults
from ckptrun.runtime.records import read_events


def test_timed_and_slow_save_faults_parse() -> None:
    assert parse_faults("kill-at:rank=1:after=2.5:attempt=3;slow-save:ms=40:attempt=any") == [
        Fault("kill-at", rank=1, after=2.5, attempt=3),
        Fault("slow-save", ms=40, attempt=None),
    ]


@pytest.mark.parametrize("spec, message", [
    ("kill-at:rank=0", "needs after=SECONDS"),
    ("kill-at:rank=0:after=soon", "after must be seconds, got 'soon'"),
    ("kill-at:rank=0:after=-1", "after must be a finite number of seconds >= 0"),
    ("slow-save:rank=0", "needs ms=M"),
])
def test_timed_fault_errors_name_the_bad_part(spec: str, message: str) -> None:
    with pytest.raises(FaultSpecError) as caught:
        parse_faults(spec)
    assert str(caught.value).startswith(f"fault {spec!r}: {message}")


@pytest.mark.timeout(60)
def test_kill_at_fires_from_a_timer_in_the_middle_of_a_save(tmp_path) -> None:
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from ckptrun.runtime.worker.fault_injection import FaultInjector
        from ckptrun.runtime.faults import parse_faults
        injector = FaultInjector(parse_faults("kill-at:rank=0:after=0.3"), rank=0, attempt=1, run_dir=Path({str(tmp_path)!r}))
        injector.during_save(7, "stage")
        injector.during_save(7, "persist")  # a save in flight: the timer must not wait for it
        injector.arm_timers()  # armed once the save is in flight: a slow machine cannot fire it before "persist"
        time.sleep(30)
        print("survived")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert result.returncode == -9 and "survived" not in result.stdout, result.stderr
    assert "injected fault kill-at 0.3s after init" in result.stderr
    [fired] = read_events(tmp_path, "fault_injected")
    assert (fired["kind"], fired["rank"], fired["save_step"], fired["save_phase"]) == ("kill-at", 0, 7, "persist")
