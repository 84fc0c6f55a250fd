"""A model that is torch.compile'd in one attempt and not in the next (either way) resumes.

Snapshots store canonical keys (no ``_orig_mod.``), so the compile switch is invisible to them.
Single-process runs of a tiny job; the ``eager`` backend keeps compiling cheap (the wrapper, and so
the keys, are the same for every backend).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptrun.runtime.records import read_events
from workers import run_job, shared_tensors

JOB = Path(__file__).parent / "fixtures" / "compiled_job.py"


def compile_args(on: bool) -> tuple[str, ...]:
    return ("--compile", "eager") if on else ()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("first,second", [(True, False), (False, True)], ids=["compiled-then-eager", "eager-then-compiled"])
def test_switching_torch_compile_between_attempts_resumes(tmp_path, first, second):
    run_dir = tmp_path / "run"
    before = run_job(run_dir, script=JOB, args=("--steps", "4", *compile_args(first)), save_every_steps=4)
    assert before.returncode == 0, before.stderr[-3000:]
    snapshot = run_dir / "checkpoints" / "step-000000004"
    tree = json.loads((snapshot / "state.json").read_text())["objects"]
    assert sorted(tree["model"]) == ["0.bias", "0.weight", "2.bias", "2.weight"], "canonical keys, no _orig_mod."
    saved = shared_tensors(snapshot)
    after = run_job(run_dir, script=JOB, args=("--steps", "6", *compile_args(second)), save_every_steps=2, attempt=2)
    assert after.returncode == 0, after.stderr[-3000:]
    assert "Traceback" not in after.stderr
    assert [e["step"] for e in read_events(run_dir, "restored")] == [4]
    # the restored state is the saved one: the next snapshot's optimizer step counts continue from it
    resumed = shared_tensors(run_dir / "checkpoints" / "step-000000006")
    assert set(resumed) == set(saved), "model and optimizer state are keyed the same with and without compile"
    steps = [k for k in saved if k.startswith("optimizer.") and k.endswith(".step")]
    assert steps and all(torch.equal(resumed[k], saved[k] + 2) for k in steps)


def test_snapshots_name_the_model_inside_torch_compile_and_old_prefixed_keys_still_load():
    from ckptrun.runtime.checkpoint.wrappers import canonical, unwrap

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    compiled = torch.compile(model, backend="eager")
    assert unwrap(compiled) is model and unwrap(model) is model
    old = compiled.state_dict()  # what a snapshot of an older ckptrun holds: _orig_mod.0.weight, ...
    assert all(key.startswith("_orig_mod.") for key in old)
    unwrap(compiled).load_state_dict(canonical(compiled, old))
    assert canonical(object(), {"_orig_mod.x": 1}) == {"_orig_mod.x": 1}, "only modules' keys are rewritten"
