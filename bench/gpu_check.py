"""`make gpu-check`: ckptrun's CUDA paths on a real GPU, in one script sized for a short window (< 8 min, 1 H200).

Skipped, with a message and exit 0, where no CUDA device is present (CI has none). On a GPU it runs
each check below, prints a row per check (PASS/FAIL and its figure) on stderr as it goes, writes one
JSON document (``--out``, default ``gpu-check.json``; rewritten after every check) and prints it on
stdout at the end, followed by nothing else; ``--table`` prints a markdown table instead (the README's).

In process: ``auto`` picks bf16 on compute capability >= 8.0; an fp16 step with an inf is skipped by
GradScaler("cuda"); the fp32/tf32 matmul flags; fp32 matmul throughput with TF32 **off** (and bf16);
fp8 refused; torch's determinism error on a CUDA op parsed into the one-line refusal. Then
(gpu_state_checks.py) FSDP2 staging's device memory, the staging stall against a D2H floor, a 1 GiB
restore against ``torch.load``. Then (gpu_launch_checks.py) real ``ckptrun launch`` runs with warm
workers, killed and resumed bitwise: bf16, fp16 with GradScaler("cuda"), torch.compile, the FSDP2 template.
Exit 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import gpu_launch_checks
import gpu_state_checks
from gpu_report import Report


def check_auto() -> tuple[bool, str, dict[str, Any]]:
    from ckptrun.runtime.step.precision import resolve

    major, minor = torch.cuda.get_device_capability()
    auto = resolve("auto", "cuda")
    return auto.mode == ("bf16" if major >= 8 else "fp32"), f"auto -> {auto.mode} on {major}.{minor}: {auto.reason}", {}


def check_fp16_overflow() -> tuple[bool, str, dict[str, Any]]:
    from ckptrun.runtime.step import stepper
    from ckptrun.runtime.step.precision import Policy, resolve

    policy = Policy(resolve("fp16", "cuda"))
    model = torch.nn.Linear(64, 64).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = policy.make_scaler()
    with policy.autocast():
        out = model(torch.randn(8, 64, device="cuda"))
    scaler.scale(out.float().pow(2).mean()).backward()
    model.weight.grad.view(-1)[0] = float("inf")
    before = model.weight.detach().clone()
    stats = stepper.optimizer_step(model, optimizer, scaler, max_norm=None)
    passed = out.dtype == torch.float16 and stats.skipped and torch.equal(before, model.weight) \
        and scaler.get_scale() == stats.loss_scale / 2
    return passed, f"skipped; scale {stats.loss_scale:.0f} -> {scaler.get_scale():.0f}", {}


def check_matmul_flags() -> tuple[bool, str, dict[str, Any]]:
    from ckptrun.runtime.step.precision import Policy, resolve

    seen = {}
    for mode in ("fp32", "tf32"):
        Policy(resolve(mode, "cuda")).apply_matmul_flags()
        flag = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
        seen[mode] = flag if flag is not None else ("tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee")
    return seen == {"fp32": "ieee", "tf32": "tf32"}, f"fp32 -> {seen['fp32']}, tf32 -> {seen['tf32']}", seen


def _matmul_tflops(dtype: torch.dtype, n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    a @ a
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        a @ a
    torch.cuda.synchronize()
    return iters * 2 * n**3 / (time.perf_counter() - started) / 1e12


def check_matmul_throughput() -> tuple[bool, str, dict[str, Any]]:
    from ckptrun.runtime.step.precision import Policy, resolve

    Policy(resolve("fp32", "cuda")).apply_matmul_flags()  # TF32 off: what --precision fp32 runs
    tf32_off = not torch.backends.cuda.matmul.allow_tf32
    fp32 = _matmul_tflops(torch.float32)
    bf16 = _matmul_tflops(torch.bfloat16)
    return tf32_off and bf16 > fp32, f"8192² matmul: fp32 (TF32 off) {fp32:.1f} TFLOP/s, bf16 {bf16:.1f} TFLOP/s", \
        {"fp32_tf32_off_tflops": fp32, "bf16_tflops": bf16, "tf32_off": tf32_off}


def check_fp8_refused() -> tuple[bool, str, dict[str, Any]]:
    from ckptrun.runtime.step.precision import PrecisionUnavailable, resolve

    try:
        resolve("fp8", "cuda")
    except PrecisionUnavailable as exc:
        return True, f"refused: {exc}", {}
    return False, "fp8 resolved, but nothing implements it", {}


def check_determinism_message() -> tuple[bool, str, dict[str, Any]]:
    from ckptrun.runtime.worker.determinism import message, nondeterministic_op

    torch.use_deterministic_algorithms(True)
    try:
        torch.histc(torch.rand(1000, device="cuda"), bins=10)  # no deterministic CUDA kernel for float input
    except RuntimeError as exc:
        op = nondeterministic_op(exc)
        return op is not None, f"torch names {op!r}: {message(op)[0] if op else str(exc)[:120]}", {"torch": str(exc)[:400]}
    finally:
        torch.use_deterministic_algorithms(False)
    return False, "histc on CUDA did not raise under deterministic algorithms", {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check.json"))
    parser.add_argument("--table", action="store_true", help="print a markdown table on stdout instead of the JSON")
    parser.add_argument("--skip-launches", action="store_true", help="only the in-process checks (~1 min)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"gpu-check: skipped: no CUDA device on this machine (torch {torch.__version__}); nothing was checked")
        return 0
    major, minor = torch.cuda.get_device_capability()
    report = Report(args.out, {"device": torch.cuda.get_device_name(), "capability": f"{major}.{minor}",
                               "gpus": torch.cuda.device_count(), "torch": torch.__version__, "cuda": torch.version.cuda,
                               "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    print(f"gpu-check: {report.header['device']} ({major}.{minor}), torch {torch.__version__}", file=sys.stderr)
    for name, item, fn in (("auto precision pick", "-", check_auto), ("fp16 overflow skipped (GradScaler cuda)", "-", check_fp16_overflow),
                           ("matmul flags fp32/tf32", "6", check_matmul_flags), ("matmul throughput", "6", check_matmul_throughput),
                           ("fp8 refused", "-", check_fp8_refused), ("determinism error -> one line", "7", check_determinism_message)):
        report.run(name, item, fn)
    gpu_state_checks.run_all(report)
    if not args.skip_launches:
        scratch, nproc = Path(tempfile.mkdtemp(prefix="gpu-check-")), torch.cuda.device_count()
        job = gpu_launch_checks.JOB
        report.run("launch bf16, warm workers, kill+resume", "1, 3", lambda: gpu_launch_checks.exact_resume(
            "bf16", job, ["--steps", "12"], "bf16", nproc, scratch))
        report.run("launch fp16 + GradScaler, kill+resume", "1, 3", lambda: gpu_launch_checks.exact_resume(
            "fp16", job, ["--steps", "12"], "fp16", nproc, scratch))
        report.run("launch torch.compile bf16, kill+resume", "1", lambda: gpu_launch_checks.exact_resume(
            "compile", job, ["--steps", "12", "--compile"], "bf16", nproc, scratch))
        report.run("launch FSDP2 template, kill+resume", "1, 2", lambda: gpu_launch_checks.fsdp_template(nproc, scratch))
    document = report.document()
    report.save()
    print(report.table() if args.table else json.dumps(document, indent=2, default=str))
    print(f"gpu-check: {document['passed']} passed, {document['failed']} failed in {document['total_s']:.0f} s; "
          f"JSON in {args.out}", file=sys.stderr)
    return 0 if document["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
