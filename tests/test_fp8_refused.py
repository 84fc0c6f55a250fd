"""fp8 is refused until it is real: a label must never claim a precision that did not run.

fp8 used to run as bf16 autocast once torchao was importable. Until float8 training is wired (torchao's
``convert_to_float8_training``, compute capability ≥ 8.9, its state in the snapshot, exercised by
``make gpu-check``), the supervisor refuses it before anything runs and the runtime refuses it on any hardware.
"""

from __future__ import annotations

import pytest
from launch_helpers import ckptrun

from ckptrun.runtime.step.precision import Decision, Policy, PrecisionUnavailable, resolve


def test_launch_with_fp8_is_refused_before_any_rank_starts_and_leaves_no_run_dir(tmp_path) -> None:
    result = ckptrun("launch", "--precision", "fp8", "--name", "eight", cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "error: --precision fp8: fp8 training is not implemented yet" in result.stderr
    assert "hint: use --precision bf16" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists(), "a refused launch leaves no run dir"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_runtime_refuses_fp8_on_any_device(device: str) -> None:
    with pytest.raises(PrecisionUnavailable, match="fp8 training is not implemented yet"):
        resolve("fp8", device)


def test_no_policy_maps_a_mode_to_another_dtype_under_its_name() -> None:
    assert Policy(Decision("fp8", "fp8", "test", "cpu")).autocast_dtype is None
