"""Which precision each operator class actually ran in, observed for one real training step.

"Mixed precision on" says little; this records, with a ``TorchDispatchMode``,
the input and output dtypes of every op of one optimizer step on rank 0,
groups them by operator class and writes ``RUN_DIR/precision.json``. The
accumulation dtype is not observable from Python, so it comes from what torch
documents for each class.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPORT = "precision.json"

CLASSES: dict[str, tuple[str, ...]] = {
    "matmul/linear": ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation"),
    "conv": ("convolution", "_convolution", "convolution_backward", "mkldnn_convolution", "cudnn_convolution"),
    "attention/softmax": ("_softmax", "softmax", "_softmax_backward_data", "_scaled_dot_product_flash_attention",
                          "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
                          "scaled_dot_product_attention"),
    "normalisation": ("native_layer_norm", "native_layer_norm_backward", "native_batch_norm", "_native_batch_norm_legit",
                      "_native_batch_norm_legit_functional", "native_batch_norm_backward", "native_group_norm",
                      "native_group_norm_backward", "_fused_rms_norm", "rms_norm"),
    "loss": ("nll_loss_forward", "nll_loss", "nll_loss_backward", "_log_softmax", "_log_softmax_backward_data",
             "mse_loss", "mse_loss_backward", "binary_cross_entropy", "binary_cross_entropy_with_logits",
             "smooth_l1_loss", "cross_entropy_loss"),
    "reductions": ("sum", "mean", "linalg_vector_norm", "norm", "amax", "var_mean", "std_mean"),
}
ACCUMULATION = {
    "matmul/linear": "fp32 (cuBLAS / oneDNN accumulate bf16 and fp16 products in fp32)",
    "conv": "fp32 (cuDNN / oneDNN accumulate in fp32)",
    "attention/softmax": "fp32 internally for bf16/fp16 inputs (opmath)",
    "normalisation": "fp32 statistics for bf16/fp16 inputs (opmath)",
    "loss": "fp32 (the step helper computes the loss on .float() outputs)",
    "reductions": "fp32 for bf16/fp16 inputs (opmath)",
    "optimizer update": "the parameter dtype (fp32 master weights)",
    "gradient all-reduce": "the gradient dtype (DDP reduces .grad buckets in the parameter dtype)",
}
_BY_OP = {op: cls for cls, ops in CLASSES.items() for op in ops}


def _dtypes(values: Any) -> list[str]:
    found: list[str] = []
    for value in values if isinstance(values, (list, tuple)) else [values]:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            found.append(str(value.dtype).replace("torch.", ""))
        elif isinstance(value, (list, tuple)):
            found.extend(_dtypes(value))
    return found


class DtypeRecorder(TorchDispatchMode):
    """Counts input/output dtypes per operator class; ``phase`` = 'optimizer' files every op there."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "step"
        self.table: dict[str, dict[str, Any]] = defaultdict(
            lambda: {"inputs": defaultdict(int), "outputs": defaultdict(int), "count": 0, "ops": set()})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name.startswith(("_record_function", "_local_scalar_dense")):
            return out
        cls = "optimizer update" if self.phase == "optimizer" else _BY_OP.get(name)
        if cls is not None:
            row = self.table[cls]
            row["count"] += 1
            row["ops"].add(name)
            for dtype in _dtypes(list(args) + list((kwargs or {}).values())):
                row["inputs"][dtype] += 1
            for dtype in _dtypes(out):
                row["outputs"][dtype] += 1
        return out

    def note_gradients(self, parameters: list[torch.Tensor]) -> None:
        """Gradients as DDP all-reduces them (the reduction itself runs in C++, outside the dispatcher)."""
        row = self.table["gradient all-reduce"]
        for p in parameters:
            if p.grad is not None:
                dtype = str(p.grad.dtype).replace("torch.", "")
                row["inputs"][dtype] += 1
                row["outputs"][dtype] += 1
                row["count"] += 1

    def to_json(self) -> dict[str, Any]:
        return {cls: {"inputs": dict(row["inputs"]), "outputs": dict(row["outputs"]), "count": row["count"],
                      "ops": sorted(row["ops"]), "accumulation": ACCUMULATION.get(cls, "")}
                for cls, row in sorted(self.table.items())}


def write_report(run_dir: Path, decision: Any, recorder: DtypeRecorder, parameters: list[torch.Tensor],
                 optimizer: torch.optim.Optimizer) -> Path:
    state_dtypes = sorted({str(v.dtype).replace("torch.", "") for s in optimizer.state.values()
                           for v in s.values() if isinstance(v, torch.Tensor) and v.is_floating_point()})
    document = {
        "schema_version": 1, "requested": decision.requested, "mode": decision.mode, "reason": decision.reason,
        "device": decision.device,
        "parameters": sorted({str(p.dtype).replace("torch.", "") for p in parameters}),
        "optimizer_state": state_dtypes,
        "classes": recorder.to_json(),
    }
    path = run_dir / REPORT
    path.write_text(json.dumps(document, indent=1, sort_keys=True))
    return path
