"""Precision policy and the training step: dtypes per mode, fp16 skipped steps, scaler restore,
accumulation, clipping, anomalies with rollback, the per-op report."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ckptrun.runtime.step import stepper
from ckptrun.runtime.step.precision import Decision, Policy, bf16_native, resolve, to_float
from ckptrun.runtime.records import losses_by_attempt, read_events, read_fatal, read_metrics
from workers import run_job

FIXTURES = Path(__file__).parent / "fixtures"
FAST = ("--num-workers", "0", "--hidden", "128")


def policy(mode: str) -> Policy:
    return Policy(Decision(mode, mode, "test", "cpu"))


@pytest.mark.parametrize("mode,matmul", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_dtypes_inside_autocast_per_mode(mode, matmul):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    chosen = policy(mode)
    scaler = chosen.make_scaler()
    with chosen.autocast():
        logits = model(torch.randn(4, 8))
    assert logits.dtype == matmul
    loss = F.cross_entropy(to_float(logits), torch.tensor([0, 1, 2, 0]))
    assert loss.dtype == torch.float32
    (scaler.scale(loss) if scaler else loss).backward()
    stepper.optimizer_step(model, optimizer, scaler, max_norm=None)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(v.dtype == torch.float32 for s in optimizer.state.values() for v in s.values() if v.is_floating_point())
    assert (scaler is not None) == (mode == "fp16")


def test_auto_follows_the_one_predicate():
    native, fact = bf16_native("cpu")
    decision = resolve("auto", "cpu")
    assert decision.mode == ("bf16" if native else "fp32") and fact in decision.reason
    assert resolve("tf32", "cpu").mode == "fp32"


def test_four_micro_batches_equal_one_batch_of_four_times_the_size():
    torch.manual_seed(0)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    grads = []
    for chunks in (1, 4):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        batches = list(zip(x.chunk(chunks), y.chunk(chunks)))
        loss, _ = stepper.accumulate(model, batches, lambda b: model(b[0]), lambda out, b: F.cross_entropy(out, b[1]),
                                  policy("fp32"), None, before_micro=lambda index: None)
        grads.append((loss, torch.cat([p.grad.flatten() for p in model.parameters()])))
    assert math.isclose(grads[0][0], grads[1][0], rel_tol=1e-6)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-6)


def test_clipping_reports_the_pre_clip_norm():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    (model(torch.randn(4, 8)).pow(2).sum() * 100).backward()
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])).item()
    stats = stepper.optimizer_step(model, optimizer, None, max_norm=1.0)
    assert math.isclose(stats.grad_norm, expected, rel_tol=1e-5) and stats.clipped
    after = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])).item()
    assert after <= 1.0 + 1e-5


@pytest.mark.timeout(120)
def test_fp16_inf_on_one_rank_skips_the_step_on_both(tmp_path):
    run_dir = tmp_path / "run"
    result = run_job(run_dir, nproc=2, script=FIXTURES / "fp16_job.py", args=("--steps", "6"),
                     precision="fp16", fault="inf-grad:rank=1:step=3")
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [[json.loads(line) for line in (run_dir / f"steps-rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    for records in ranks:
        skipped = [r for r in records if r["after"] == r["before"]]
        assert [r["before"] for r in skipped] == [3], "exactly the step with the inf is skipped"
        index = records.index(skipped[0])
        previous = records[index - 1]
        assert skipped[0]["scale"] == previous["scale"] / 2, "scale halved"
        assert skipped[0]["lr"] == previous["lr"], "scheduler did not advance"
        assert skipped[0]["params"] == previous["params"], "parameters unchanged"
        assert records[-1]["after"] == 6
    assert ranks[0] == ranks[1], "both ranks saw the same steps"
    metrics = [m for m in read_metrics(run_dir) if m["step"] == 4]
    assert [m["skipped"] for m in metrics] == [True, False]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_scaler_and_state_restore_continue_bitwise(tmp_path, mode):
    fields = dict(precision=mode, save_every_steps=4, loss_scale_growth_interval=3)
    if mode == "fp16":  # 2 good steps, an overflow (scale halves), 2 good steps: tracker 2 at the step-4 snapshot
        fields["fault"] = "inf-grad:step=2;kill:step=6"
    else:
        fields["fault"] = "kill:step=6"
    reference = tmp_path / "reference"
    assert run_job(reference, args=("--steps", "12", *FAST), **{**fields, "fault": fields["fault"].split(";")[0] if mode == "fp16" else None}).returncode == 0
    run_dir = tmp_path / "run"
    assert run_job(run_dir, args=("--steps", "12", *FAST), **fields).returncode == -9
    assert run_job(run_dir, args=("--steps", "12", *FAST), **{**fields, "fault": None, "attempt": 2}).returncode == 0
    if mode == "fp16":
        state = json.loads((run_dir / "checkpoints" / "step-000000004" / "state.json").read_text())
        scaler = state["objects"]["scaler"]
        assert scaler["scale"] == 32768.0 and scaler["_growth_tracker"] == 2, "non-default scaler state saved"
        restored = json.loads((run_dir / "checkpoints" / "step-000000012" / "state.json").read_text())["objects"]["scaler"]
        expected = json.loads((reference / "checkpoints" / "step-000000012" / "state.json").read_text())["objects"]["scaler"]
        assert restored == expected
    assert [e["step"] for e in read_events(run_dir, "restored")] == [4]
    assert losses_by_attempt(run_dir)[2] == {s: l for s, l in losses_by_attempt(reference)[1].items() if s > 4}


@pytest.mark.timeout(120)
def test_bf16_and_fp32_both_learn_and_agree(tmp_path):
    finals = {}
    for mode in ("fp32", "bf16"):
        run_dir = tmp_path / mode
        assert run_job(run_dir, args=("--steps", "50", "--num-workers", "0"), precision=mode).returncode == 0
        losses = [m["loss"] for m in read_metrics(run_dir)]
        assert losses[-1] <= 0.8 * losses[0], f"{mode} loss fell less than 20%: {losses[0]} -> {losses[-1]}"
        finals[mode] = sum(losses[-10:]) / 10
    assert abs(finals["bf16"] - finals["fp32"]) / finals["fp32"] < 0.02
    report = json.loads((tmp_path / "bf16" / "precision.json").read_text())
    assert report["classes"]["matmul/linear"]["inputs"].get("bfloat16", 0) > 0
    assert set(report["parameters"]) == {"float32"} and report["classes"]["loss"]["outputs"].keys() == {"float32"}


@pytest.mark.timeout(60)
def test_fp8_on_cpu_is_refused_naming_what_is_missing(tmp_path):
    result = run_job(tmp_path / "run", args=("--steps", "2", *FAST), precision="fp8")
    assert result.returncode == 2
    assert "fp8 training is not implemented yet" in result.stderr and "Traceback" not in result.stderr
    assert read_fatal(tmp_path / "run")[0]["exit_code"] == 2


@pytest.mark.timeout(60)
def test_script_precision_conflicting_with_the_launch_is_refused(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import ckptrun.runtime as ckr\nckr.init(precision='fp16')\n")
    result = run_job(tmp_path / "run", script=script, precision="bf16")
    assert result.returncode == 2
    assert "asks for precision 'fp16' but the run was launched with 'bf16'" in result.stderr


@pytest.mark.timeout(120)
def test_rollback_on_injected_nan_restores_lowers_lr_and_completes(tmp_path):
    run_dir = tmp_path / "run"
    result = run_job(run_dir, args=("--steps", "12", *FAST), precision="fp32", save_every_steps=5,
                     on_anomaly="rollback", fault="nan:step=7")
    assert result.returncode == 0, result.stderr[-3000:]
    [rollback] = read_events(run_dir, "rollback")
    assert rollback["from_step"] == 8 and rollback["to_step"] == 5 and rollback["lr_factor"] == 0.5
    metrics = read_metrics(run_dir)
    assert metrics[-1]["step"] == 12 and read_events(run_dir, "completed")
    lr_before = next(m["lr"] for m in metrics if m["step"] == 6)
    lr_after = [m["lr"] for m in metrics if m["step"] == 6][-1]
    assert math.isclose(lr_after, lr_before * 0.5, rel_tol=1e-9), "replayed step 6 runs at half the LR"
    stop = run_job(tmp_path / "stop", args=("--steps", "12", *FAST), precision="fp32", on_anomaly="stop", fault="nan:step=7")
    assert stop.returncode == 4 and "anomaly at step 8" in stop.stderr


def test_precision_report_command(tmp_path):
    document = {"mode": "bf16", "requested": "auto", "reason": "auto: test", "device": "cpu", "parameters": ["float32"],
                "optimizer_state": ["float32"], "schema_version": 1,
                "classes": {"matmul/linear": {"inputs": {"bfloat16": 4}, "outputs": {"bfloat16": 2}, "count": 2,
                                              "ops": ["mm"], "accumulation": "fp32"}}}
    (tmp_path / "precision.json").write_text(json.dumps(document))
    table = subprocess.run([sys.executable, "-m", "ckptrun.cli.main", "precision-report", str(tmp_path)], capture_output=True, text=True)
    assert table.returncode == 0 and "matmul/linear" in table.stdout and "bfloat16×4" in table.stdout
    missing = subprocess.run([sys.executable, "-m", "ckptrun.cli.main", "precision-report", str(tmp_path / "nope")], capture_output=True, text=True)
    assert (missing.returncode, missing.stderr.splitlines()) == (2, [
        f"error: {tmp_path / 'nope'}: no such run directory",
        "hint: pass the RUN_DIR that `ckptrun launch` printed (runs/NAME)"])  # two lines, no traceback
    assert not (tmp_path / "nope").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["precision.json"]
