"""Issue 10 item 4: a hyperparameter changed on resume (`resume --allow-change lr -- --lr X`) takes effect.

End-to-end under `ckptrun launch`: the default job is killed part-way (no restart budget), resumed
with a new ``--lr`` — refused until the key is allowed, then run — and ``metrics.jsonl``'s ``lr``
follows the new cosine schedule from the resumed step on. Units: ``hparams.set_lr`` on a restored
optimizer and scheduler; ``resume --lr`` (an option resume does not know) is refused with a hint.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from ckptrun.runtime.step import hparams
from ckptrun.runtime.records import read_events, read_metrics
from launch_helpers import COMMON, ckptrun, one

STEPS, OLD_LR, NEW_LR = 12, 0.003, 0.01


def cosine(base: float, step: int) -> float:
    """The lr the default job's CosineAnnealingLR(T_max=STEPS) gives optimizer step ``step`` (1-based)."""
    return base * (1 + math.cos(math.pi * (step - 1) / STEPS)) / 2


@pytest.mark.e2e
@pytest.mark.timeout(360)
def test_resume_with_a_new_lr_follows_the_new_schedule(tmp_path):
    run_dir = tmp_path / "runs" / "lr"
    job = ["--steps", str(STEPS), "--num-workers", "0"]
    first = ckptrun("launch", *COMMON, "--run-dir", str(run_dir), "--max-restarts", "0",
                    "--inject-fault", "kill:rank=1:step=7", "--", *job, "--lr", str(OLD_LR), cwd=tmp_path, timeout=240)
    assert first.returncode == 1, first.stderr[-3000:]
    new_args = [*job, "--lr", str(NEW_LR)]
    refused = ckptrun("resume", "--latest", "--run-dir", str(run_dir), "--", *new_args, cwd=tmp_path, timeout=240)
    assert refused.returncode == 4, refused.stderr[-3000:]
    assert "allow it with --allow-change lr" in refused.stderr
    resumed = ckptrun("resume", "--latest", "--run-dir", str(run_dir), "--allow-change", "lr", "--inject-fault", "none",
                      "--", "--lr", str(NEW_LR), cwd=tmp_path, timeout=240)  # the other stored arguments are kept
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"ckptrun: resuming the default job --steps {STEPS} --num-workers 0 --lr {NEW_LR}" in resumed.stderr
    assert json.loads((run_dir / "run.json").read_text())["spec"]["inject_fault"] is None

    assert json.loads((run_dir / "run.json").read_text())["spec"]["script_args"] == new_args
    assert read_events(run_dir, "resume")[-1]["script_args"] == new_args
    assert one(run_dir, "config_changed")["changed"] == {"lr": [OLD_LR, NEW_LR]}
    last_attempt = max(int(r["attempt"]) for r in read_metrics(run_dir))
    lrs = {int(r["step"]): (int(r["attempt"]), r["lr"]) for r in read_metrics(run_dir)}  # later attempts win
    assert [step for step, (attempt, _) in lrs.items() if attempt == last_attempt] == list(range(6, STEPS + 1))
    for step, (attempt, lr) in lrs.items():  # the lr each step used: old schedule before the resume, new after
        assert lr == pytest.approx(cosine(NEW_LR if attempt == last_attempt else OLD_LR, step), rel=1e-9), step


def test_set_lr_after_restore_matches_a_schedule_started_with_that_lr():
    def build(lr: float):
        params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
        optimizer = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": lr / 10}], lr=lr)
        return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)

    old_optimizer, old_scheduler = build(0.1)
    for _ in range(4):
        old_optimizer.step()
        old_scheduler.step()
    restored_optimizer, restored_scheduler = build(0.1)  # a resumed process: built fresh, then restored
    restored_optimizer.load_state_dict(old_optimizer.state_dict())
    restored_scheduler.load_state_dict(old_scheduler.state_dict())
    hparams.set_lr(restored_optimizer, restored_scheduler, 0.3)
    fresh_optimizer, fresh_scheduler = build(0.3)
    for _ in range(4):
        fresh_optimizer.step()
        fresh_scheduler.step()
    for _ in range(3):
        assert [g["lr"] for g in restored_optimizer.param_groups] == pytest.approx(
            [g["lr"] for g in fresh_optimizer.param_groups], rel=1e-12)
        assert restored_scheduler.get_last_lr() == pytest.approx(fresh_scheduler.get_last_lr(), rel=1e-12)
        for optimizer, scheduler in ((restored_optimizer, restored_scheduler), (fresh_optimizer, fresh_scheduler)):
            optimizer.step()
            scheduler.step()
    assert [g["initial_lr"] for g in restored_optimizer.param_groups] == pytest.approx([0.3, 0.03], rel=1e-12)


def test_config_changes_name_old_and_new_values():
    assert hparams.config_changes({"lr": 0.001, "steps": 10}, {"lr": 0.01, "steps": 10}) == {"lr": (0.001, 0.01)}


def test_resume_refuses_an_unknown_option_and_points_after_the_double_dash(tmp_path):
    result = ckptrun("resume", "--latest", "--lr", "0.01", cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "error: No such option: --lr", result.stderr
    assert lines[1].startswith("hint: ") and "-- --lr" in lines[1], result.stderr
    assert not (tmp_path / "runs").exists()


def test_set_lr_refuses_what_it_cannot_rescale():
    """A zero base rate cannot be scaled, and OneCycleLR keeps its own max_lr: one clear error, not a silent no-op."""
    import torch

    from ckptrun.runtime.step.hparams import set_lr

    model = torch.nn.Linear(2, 2)
    zero = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="old base rate is 0"):
        set_lr(zero, None, 0.1)
    one_cycle = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(one_cycle, max_lr=0.1, total_steps=10)
    with pytest.raises(ValueError, match="OneCycleLR"):
        set_lr(one_cycle, scheduler, 0.2)
