"""Model weights in the Hugging Face layout: ``model.safetensors``, or shards and ``model.safetensors.index.json``.

The way in and out of ckptrun for weights alone. Out: ``ckptrun export RUN -o
DIR --format hf`` writes a verified snapshot's model weights with the
model's own names (``huggingface_hub.save_torch_state_dict``: shards above
``--max-shard-size``, the index naming each tensor's file) and the model's
``config.json`` when the snapshot carries one, so ``from_pretrained(DIR)``
loads it. Tied weights are written under each of their names (a copy each):
``from_pretrained`` ties them again and ``load_state_dict(strict=True)``
finds every key, whichever name the model treats as the original. In:
``ckptrun launch --init-weights PATH`` starts a run from such weights (a
``.safetensors`` file or a directory as above): the launch records the
files' sha256 (:func:`digest`), and a rank that starts without a snapshot to
restore hashes them again, refuses them if they changed, and loads them
into the tracked model strictly (every name and shape, tied names may be
absent) through ``torch.distributed.checkpoint.state_dict``, which handles
DDP, FSDP2 and ``torch.compile`` alike. A restart restores its snapshot,
never the initial weights. safetensors holds no pickle: reading it runs no
code. Importable without torch (the torch parts import it when called).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
DEFAULT_MAX_SHARD = "5GB"  # transformers' own default


class WeightsError(ValueError):
    """Weights that cannot be used: the message names the problem and the fix."""


# --- the files ----------------------------------------------------------------------


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of ``path``: the file itself, or a directory's single file or indexed shards."""
    if path.is_file():
        if path.suffix != ".safetensors":
            raise WeightsError(f"{path}: not a .safetensors file (a directory with {SINGLE} or {INDEX} works too)")
        return [path]
    if not path.is_dir():
        raise WeightsError(f"{path}: no such file or directory")
    if (path / INDEX).is_file():
        try:
            names = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WeightsError(f"{path / INDEX}: not a safetensors index ({exc})") from None
        missing = [name for name in names if not (path / name).is_file()]
        if missing:
            raise WeightsError(f"{path}: the index names {', '.join(missing)}, which is not there")
        return [path / name for name in names]
    if (path / SINGLE).is_file():
        return [path / SINGLE]
    raise WeightsError(f"{path}: holds neither {SINGLE} nor {INDEX}")


def digest(path: Path) -> str:
    """sha256 over the weight files (each file's name and sha256, in order): what the launch and ranks compare."""
    lines = []
    for file in weight_files(path):
        with open(file, "rb") as handle:
            lines.append(f"{file.name} {hashlib.file_digest(handle, 'sha256').hexdigest()}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def tensor_names(path: Path) -> list[str]:
    """Every tensor name the files hold, read from their headers alone; a file that is not safetensors fails."""
    from safetensors import safe_open

    names: list[str] = []
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="numpy") as handle:
                names.extend(handle.keys())
        except Exception as exc:  # safetensors raises its own SafetensorError for any bad header
            raise WeightsError(f"{file}: not a readable safetensors file ({exc})") from None
    return names


# --- out: export ------------------------------------------------------------------


def write(state: dict[str, torch.Tensor], out_dir: Path, max_shard_size: int | str = DEFAULT_MAX_SHARD,
          metadata: dict[str, str] | None = None, config: dict[str, Any] | None = None) -> list[Path]:
    """Write ``state`` to ``out_dir`` in the Hugging Face layout (and ``config.json``); returns the files written.

    Written in a temp directory beside ``out_dir`` and moved in file by file, the index (or the single file)
    last, so a reader never sees an index naming a shard that is not there yet."""
    from huggingface_hub import save_torch_state_dict

    out_dir.mkdir(parents=True, exist_ok=True)
    temp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        save_torch_state_dict(untied(state), temp, max_shard_size=max_shard_size, metadata=metadata)
        if config is not None:
            (temp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for stale in (out_dir / SINGLE, out_dir / INDEX, *out_dir.glob("model-*-of-*.safetensors")):
            stale.unlink(missing_ok=True)  # another export's layout must not remain beside this one
        written = sorted(temp.iterdir(), key=lambda p: (p.name in (INDEX, SINGLE), p.name))
        for file in written:
            os.replace(file, out_dir / file.name)
        return [out_dir / file.name for file in written]
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy for every name after the first that shares storage with another (safetensors stores no aliases)."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for key, tensor in state.items():
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        out[key] = tensor.clone() if identity in seen else tensor
        seen.add(identity)
    return out


def model_config(model: Any) -> dict[str, Any] | None:
    """A Hugging Face model's config as JSON (its own serialisation), for ``config.json``; None for other models."""
    from ckptrun.runtime.checkpoint.wrappers import unwrap

    config = getattr(unwrap(model), "config", None)
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json) or not getattr(config, "model_type", None):
        return None
    return json.loads(to_json(use_diff=False))


# --- in: a run that starts from weights -------------------------------------------------


def load_into(model: Any, path: Path) -> int:
    """Load the weights at ``path`` into ``model`` (plain, DDP, FSDP2 or compiled) on this rank; returns the
    tensor count. Every name and shape must match; a tied name may be absent (it takes its original)."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        state.update(load_file(str(file)))
    expected = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    tied = _tied_names(model)
    missing = sorted(k for k in expected if k not in state and k not in tied)
    unexpected = sorted(k for k in state if k not in expected)
    shapes = sorted(f"{k} {tuple(state[k].shape)} (model {tuple(expected[k].shape)})" for k in state
                    if k in expected and tuple(state[k].shape) != tuple(expected[k].shape))
    problems = [f"{label}: {', '.join(names[:4])}{f' (+{len(names) - 4} more)' if len(names) > 4 else ''}"
                for label, names in (("missing", missing), ("not in the model", unexpected), ("shape", shapes)) if names]
    if problems:
        raise WeightsError(f"--init-weights {path} does not fit the model: {'; '.join(problems)}")
    present = {k: v for k, v in state.items() if k in expected}
    set_model_state_dict(model, present, options=StateDictOptions(full_state_dict=True, strict=False))
    return len(present)


def _tied_names(model: Any) -> set[str]:
    """State-dict names that alias another parameter (``lm_head.weight`` tied to the embedding)."""
    from ckptrun.runtime.checkpoint.wrappers import unwrap

    module = unwrap(model)
    every = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return every - {name for name, _ in module.named_parameters()}
