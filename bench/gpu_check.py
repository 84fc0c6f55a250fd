"""`make gpu-check`: the precision policy's CUDA paths on a real GPU (≤ 5 minutes).

Skipped, with a message and exit 0, where no CUDA device is present. On a GPU
it checks: `auto` picks bf16 on compute capability ≥ 8.0; an fp16 step with an
inf is skipped by GradScaler("cuda"); fp32/tf32 set the matmul flags; the CUDA
RNG state round-trips through a real snapshot; fp8 is refused (not implemented
yet: it must never run as bf16 under its name). Prints one line per check and the figures.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu-check: skipped: no CUDA device on this machine")
        return 0
    from ckptrun.runtime import stepper
    from ckptrun.runtime.precision import Policy, PrecisionUnavailable, resolve

    major, minor = torch.cuda.get_device_capability()
    print(f"gpu-check: {torch.cuda.get_device_name()} (compute capability {major}.{minor}), torch {torch.__version__}")
    auto = resolve("auto", "cuda")
    assert auto.mode == ("bf16" if major >= 8 else "fp32"), auto
    print(f"ok  auto -> {auto.mode}: {auto.reason}")

    policy = Policy(resolve("fp16", "cuda"))
    model = torch.nn.Linear(64, 64).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = policy.make_scaler()
    with policy.autocast():
        out = model(torch.randn(8, 64, device="cuda"))
    assert out.dtype == torch.float16
    scaler.scale(out.float().pow(2).mean()).backward()
    model.weight.grad.view(-1)[0] = float("inf")
    before = model.weight.detach().clone()
    stats = stepper.optimizer_step(model, optimizer, scaler, max_norm=None)
    assert stats.skipped and torch.equal(before, model.weight) and scaler.get_scale() == stats.loss_scale / 2
    print(f"ok  fp16 overflow skipped by GradScaler('cuda'); scale {stats.loss_scale:.0f} -> {scaler.get_scale():.0f}")

    for mode, expected in (("fp32", "ieee"), ("tf32", "tf32")):
        try:
            Policy(resolve(mode, "cuda")).apply_matmul_flags()
        except PrecisionUnavailable as exc:
            print(f"--  {mode}: {exc}")
            continue
        flag = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
        value = flag if flag is not None else ("tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee")
        assert value == expected, (mode, value)
        print(f"ok  {mode}: matmul fp32 precision = {value}")

    figures = _bench_matmul()
    print("ok  bf16 vs fp32 matmul (4096², 20 iters): " + ", ".join(f"{k} {v:.1f} TFLOP/s" for k, v in figures.items()))
    _rng_round_trip()
    try:
        resolve("fp8", "cuda")
        raise AssertionError("fp8 resolved, but nothing implements it")
    except PrecisionUnavailable as exc:
        print(f"ok  fp8 refused: {exc}")
    return 0


def _bench_matmul() -> dict[str, float]:
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(4096, 4096, device="cuda", dtype=dtype)
        a @ a
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
        out[name] = 20 * 2 * 4096**3 / (time.perf_counter() - start) / 1e12
    return out


def _rng_round_trip() -> None:
    """A killed run's CUDA RNG comes back: save at step 5, kill at 7, resume, compare losses."""
    script = Path(tempfile.mkdtemp()) / "job.py"
    script.write_text(
        "import torch, ckptrun.runtime as ckr\n"
        "run = ckr.init(config={})\n"
        "data = torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randn(256, 1))\n"
        "loader = ckr.DataLoader(data, batch_size=16)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 1)).cuda()\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
        "run.track(model=model, optimizer=opt, loader=loader); run.restore()\n"
        "for x, y in run.batches(loader, steps=10):\n"
        "    noise = torch.randn(1, device='cuda')\n"
        "    run.train_step([(x.cuda(), y.cuda())], forward=lambda b: model(b[0]) + noise, loss=lambda o, b: (o - b[1]).pow(2).mean())\n"
        "run.finish()\n"
    )
    from ckptrun.runtime.records import losses_by_attempt

    def launch(run_dir: Path, **extra: str) -> int:
        env = {**os.environ, "CKPTRUN_RUN_DIR": str(run_dir), "CKPTRUN_SAVE_EVERY_STEPS": "5", **extra}
        return subprocess.run([sys.executable, str(script)], env=env, capture_output=True).returncode

    root = script.parent
    assert launch(root / "ref") == 0
    assert launch(root / "run", CKPTRUN_FAULT="kill:step=7") != 0
    assert launch(root / "run", CKPTRUN_ATTEMPT="2") == 0
    ref, resumed = losses_by_attempt(root / "ref")[1], losses_by_attempt(root / "run")[2]
    assert all(resumed[s] == ref[s] for s in resumed), "CUDA RNG (dropout, randn) did not round-trip"
    print(f"ok  CUDA RNG round trip through a snapshot: steps {min(resumed)}-{max(resumed)} bitwise equal")


if __name__ == "__main__":
    sys.exit(main())
