"""Every random number generator a training step can touch, captured per rank.

Python's and numpy's states become JSON (numpy's legacy state is a uint32 array
that ``torch.load(weights_only=True)`` would refuse, so it is stored as a list);
torch's CPU and CUDA states are byte tensors. Seeding lives here too, so that
init and restore agree on what "the RNG" means.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def capture() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(json_state, tensors) of python, numpy, torch CPU and every CUDA device."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss},
        "numpy": {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    tensors = {"torch_cpu": torch.get_rng_state()}
    for index in range(state["cuda_devices"]):
        tensors[f"torch_cuda_{index}"] = torch.cuda.get_rng_state(index)
    return state, tensors


def restore(state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state((npy["name"], np.asarray(npy["keys"], dtype=np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(tensors["torch_cpu"])
    devices = state.get("cuda_devices", 0)
    if devices and torch.cuda.is_available():
        for index in range(min(devices, torch.cuda.device_count())):
            torch.cuda.set_rng_state(tensors[f"torch_cuda_{index}"], index)
