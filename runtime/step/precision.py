"""The precision policy: which mode runs, why, and the autocast / scaler / matmul flags that make it so.

One predicate decides whether bf16 is native (CUDA: compute capability ≥ 8.0
without emulation; CPU: AMX tiles), and ``auto`` uses it everywhere — the
choice, the message and the report. A mode asked for explicitly that this
hardware cannot run is refused (exit 2) rather than silently downgraded, as
torch itself would do for CPU autocast or ``GradScaler("cuda")`` without CUDA.
A mode the contract names but nothing implements (fp8) is refused everywhere.
Master weights and optimizer state stay fp32 in every mode.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ContextManager

import torch

from ckptrun.runtime.env import NOT_IMPLEMENTED

MODES = ("auto", "fp32", "tf32", "bf16", "fp16", "fp8")


class PrecisionUnavailable(RuntimeError):
    """The mode asked for cannot run on this hardware; the message says what is missing."""


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def bf16_native(device: str) -> tuple[bool, str]:
    """The one predicate: is bf16 native here? Returns (answer, the fact it rests on)."""
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return native, f"CUDA compute capability {major}.{minor} ({'≥' if native else '<'} 8.0)"
    amx = _cpu_has_amx()
    return amx, "CPU with AMX tiles" if amx else "CPU without AMX (bf16 autocast would be slower than fp32)"


def _cpu_has_amx() -> bool:
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if probe is not None:
        return bool(probe())
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@dataclass(frozen=True)
class Decision:
    """The mode that runs, the one asked for, and why."""

    requested: str
    mode: str
    reason: str
    device: str
    notes: tuple[str, ...] = field(default=())


def resolve(requested: str, device: str | None = None) -> Decision:
    """Turn a requested mode into the one that runs; raise :class:`PrecisionUnavailable` if it cannot."""
    device = device or device_type()
    if requested not in MODES:
        raise PrecisionUnavailable(f"unknown precision {requested!r}; use one of {', '.join(MODES)}")
    if requested == "auto":
        native, fact = bf16_native(device)
        return Decision("auto", "bf16" if native else "fp32", f"auto: {fact} -> {'bf16' if native else 'fp32'}", device)
    if requested in NOT_IMPLEMENTED:
        raise PrecisionUnavailable("; ".join(NOT_IMPLEMENTED[requested]))
    if requested == "bf16" and device == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise PrecisionUnavailable("bf16 needs CUDA compute capability ≥ 8.0; use fp16 (with loss scaling) or fp32")
    if requested == "tf32" and device != "cuda":
        return Decision("tf32", "fp32", "tf32 is a CUDA matmul mode; on CPU it runs as fp32", device, ("tf32 runs as fp32 on CPU",))
    if requested == "tf32":
        major, minor = torch.cuda.get_device_capability()
        if major < 8:
            raise PrecisionUnavailable(f"tf32 needs compute capability ≥ 8.0; this GPU has {major}.{minor}")
    return Decision(requested, requested, f"{requested}: asked for explicitly", device)


@dataclass
class ScalerConfig:
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


class Policy:
    """Applies a :class:`Decision`: matmul flags at init, autocast around the forward, a scaler for fp16."""

    def __init__(self, decision: Decision, scaler: ScalerConfig | None = None) -> None:
        self.decision = decision
        self.mode = decision.mode
        self.device = decision.device
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.mode)
        self.scaler_config = scaler or ScalerConfig()
        self.entered = False  # autocast ran at least once (run.train_step enters it; a script's own loop may not)
        self.told = False  # the first step said which mode actually ran, when it is not the decided one

    @property
    def applied_mode(self) -> str:
        """The mode as it ran: a mixed mode only once its autocast was entered, else fp32 (what ran)."""
        return self.mode if self.autocast_dtype is None or self.entered else "fp32"

    def apply_matmul_flags(self) -> None:
        """fp32: IEEE matmul; tf32: TF32 on CUDA. One flag family, and only on CUDA (CPU defaults are IEEE)."""
        if self.device != "cuda":
            return
        precision = "tf32" if self.mode in ("tf32",) else "ieee"
        matmul = torch.backends.cuda.matmul
        if hasattr(matmul, "fp32_precision"):  # torch ≥ 2.9: the new family only
            matmul.fp32_precision = precision
            torch.backends.cudnn.conv.fp32_precision = precision  # type: ignore[attr-defined]
        else:
            torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
            torch.backends.cudnn.allow_tf32 = precision == "tf32"

    def autocast(self) -> ContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        self.entered = True
        return torch.autocast(self.device, dtype=self.autocast_dtype)

    def make_scaler(self) -> torch.amp.GradScaler | None:
        if self.mode != "fp16":
            return None
        c = self.scaler_config
        return torch.amp.GradScaler(self.device, init_scale=c.init_scale, growth_factor=c.growth_factor,
                                    backoff_factor=c.backoff_factor, growth_interval=c.growth_interval)


def to_float(output: Any) -> Any:
    """Outputs to fp32 for the loss (CPU autocast keeps log_softmax and reductions in low precision)."""
    if isinstance(output, torch.Tensor):
        return output.float() if output.is_floating_point() else output
    if isinstance(output, (tuple, list)):
        return type(output)(to_float(o) for o in output)
    if isinstance(output, dict):
        return {k: to_float(v) for k, v in output.items()}
    return output
