"""Host copies of the state a rank writes, in buffers allocated once and reused by every save.

First touch of new memory is slow, so buffers persist across saves. A rank
stages only the tensors it writes (see :func:`dcp_io.owned_keys`): FSDP2's
DTensors as their local shard, in a *host* DTensor built once per buffer the way
DCP's own staging builds one (``torch/distributed/_state_dict_utils.py``, its
``dtensor_func``: a CPU DTensor whose local tensor is the pinned buffer), so DCP
still sees the global tensor. Never ``DTensor.from_local(buffer, mesh)``: on a
CUDA mesh that moves the buffer back to the GPU (``torch/distributed/tensor/_api.py``),
a second device copy of the state at every save. Staging allocates no device memory.

What is fenced, on a GPU. The device-to-host copies run on one side stream that
first waits for the current (training) stream, so they read the state as of this
step; the buffers are pinned, so the copies are asynchronous for the CPU. Then the
training stream waits (``wait_event``, on the GPU: the CPU does not block) for an event
recorded after the copies: nothing the training stream queues after staging (the next
forward's in-place writes — BatchNorm running statistics, DDP's ``broadcast_buffers``,
spectral-norm vectors — the backward, the optimizer step) can run before every tensor
was read. Each source tensor is marked in use by the side stream (``record_stream``), so
the allocator does not hand a freed temporary's memory to the training stream early.
The CPU waits on the same event (:meth:`Stager.fence`) only before the writer reads the
buffers and before the next staging call reuses them. On the CPU the copies are synchronous.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes this rank holds: a DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def first_nonfinite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The first floating tensor holding a NaN or an inf, named, or None. Exact, read-only, in two tiers:

    a screen, one fused L2 norm per dtype over every float tensor (``torch._foreach_norm``, 16-bit floats
    normed in fp32: the fastest full read torch has here, see bench/finite_check.py), whose result is finite
    only when every element is (IEEE arithmetic never turns a NaN or an inf into a finite value); then an exact
    ``isfinite`` only of the tensors whose norm is not finite, so finite values whose squares overflow (fp32
    beyond ~1e19, the dtype's max) are never taken for a blow-up. The common case reads each byte once."""
    keys = [k for k, t in tensors.items() if local(t).is_floating_point() and local(t).numel()]
    if not keys:
        return None
    norms: dict[str, torch.Tensor] = {}
    for dtype in {local(tensors[k]).dtype for k in keys}:  # one fused call per dtype; 16-bit floats in fp32
        group = [k for k in keys if local(tensors[k]).dtype == dtype]  # (their own norm overflows at 65504)
        wide = {} if dtype in (torch.float32, torch.float64) else {"dtype": torch.float32}
        norms.update(zip(group, torch._foreach_norm([local(tensors[k]).detach() for k in group], 2, **wide)))
    finite = torch.isfinite(torch.stack([norms[k].double() for k in keys]).cpu()).tolist()  # fp64 norms stay fp64
    suspects = (k for k, ok in zip(keys, finite) if not ok)
    return next((f"non-finite values in {k}" for k in suspects if not bool(torch.isfinite(local(tensors[k])).all())), None)


def local_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors.values())


class Stager:
    """Reused host buffers plus their own accounting (what was staged, what had to be allocated)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._hosts: dict[str, DTensor] = {}  # key -> the host DTensor around its buffer (FSDP2 shards)
        self._event: Any = None
        self._stream: Any = None

    def bytes_needed(self, tensors: dict[str, torch.Tensor]) -> int:
        """Bytes of buffers this stage would have to allocate (0 once they exist)."""
        return local_bytes({k: t for k, t in tensors.items() if not self._fits(k, local(t))})

    def _fits(self, key: str, tensor: torch.Tensor) -> bool:
        buffer = self._buffers.get(key)
        return buffer is not None and buffer.shape == tensor.shape and buffer.dtype == tensor.dtype

    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` into the buffers; buffers of keys no longer staged are freed."""
        self.fence()  # the previous copy is done before its buffers are reused
        self._buffers = {k: b for k, b in self._buffers.items() if k in tensors}
        self._hosts = {k: h for k, h in self._hosts.items() if k in tensors}
        on_gpu = any(local(t).is_cuda for t in tensors.values())
        with self._copy_stream() if on_gpu else contextlib.nullcontext():
            staged = {key: self._copy(key, tensor) for key, tensor in tensors.items()}
        if on_gpu:
            self._event = torch.cuda.Event()
            self._event.record(self._stream)
            torch.cuda.current_stream().wait_event(self._event)  # training's next kernels run after the copies
        return staged

    @contextlib.contextmanager
    def _copy_stream(self) -> Any:
        """The side stream, created once, ordered after everything the training stream queued so far."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            yield

    def _copy(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        source = local(tensor).detach()
        if not self._fits(key, source):
            self._buffers[key] = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=source.is_cuda)
            self._hosts.pop(key, None)
        buffer = self._buffers[key]
        if source.is_cuda:
            source.record_stream(self._stream)
        buffer.copy_(source, non_blocking=source.is_cuda)
        if isinstance(tensor, DTensor):
            return self._host_dtensor(key, tensor, buffer)
        return buffer

    def _host_dtensor(self, key: str, tensor: DTensor, buffer: torch.Tensor) -> DTensor:
        """The global tensor as DCP sees it, its local tensor ``buffer`` on the host: DCP's own construction
        (``_state_dict_utils``: a CPU DTensor with the buffer as ``_local_tensor``), made once per buffer."""
        host = self._hosts.get(key)
        if host is None or host._spec != tensor._spec:
            host = self._hosts[key] = DTensor(buffer, tensor._spec, requires_grad=False)
        return host

    def fence(self) -> None:
        """Block until the last device-to-host copy is complete (a no-op on CPU and once it is)."""
        event = self._event
        if event is not None:
            event.synchronize()
