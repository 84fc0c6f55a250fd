"""`make gpu-check`: ckptrun's CUDA paths on real GPUs (about 5 minutes on one GPU).

Skipped, with a message and exit 0, where no CUDA device is present (CI has
none). On GPUs it checks, in process: `auto` picks bf16 on compute capability
≥ 8.0; an fp16 step with an inf is skipped by GradScaler("cuda"); fp32/tf32
set the matmul flags; fp8 is refused (not implemented yet: it must never run
as bf16 under its name). Then, with real `ckptrun launch` runs on every
visible GPU (gpu_launch_checks.py): a kill and an exact resume in bf16 and in
fp16 (DDP over NCCL, CUDA RNG included), the same for the FSDP2 template, and
async staging under load. Prints one line per check and the figures.
"""

from __future__ import annotations

import sys
import time

import torch

import gpu_launch_checks


def main() -> int:
    if not torch.cuda.is_available():
        print(f"gpu-check: skipped: no CUDA device on this machine (torch {torch.__version__}); nothing was checked")
        return 0
    from ckptrun.runtime.step import stepper
    from ckptrun.runtime.step.precision import Policy, PrecisionUnavailable, resolve

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
    try:
        resolve("fp8", "cuda")
        raise AssertionError("fp8 resolved, but nothing implements it")
    except PrecisionUnavailable as exc:
        print(f"ok  fp8 refused: {exc}")
    gpu_launch_checks.run_all(torch.cuda.device_count())
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


if __name__ == "__main__":
    sys.exit(main())
