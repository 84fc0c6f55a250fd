"""Split a ``state_dict`` into a JSON tree and a flat dict of tensors, and join them back.

Snapshots store tensors through formats that run no code (DCP's tensor files,
``torch.load(weights_only=True)``) and everything else as JSON. JSON loses
tuples, non-string keys and the int/float distinction of numpy scalars, so the
tree tags them; floats survive exactly because ``json`` writes ``repr``.
"""

from __future__ import annotations

from typing import Any

import torch

TENSOR, TUPLE, DICT = "__tensor__", "__tuple__", "__dict__"


def split(obj: Any, prefix: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """Return (json_tree, tensors); tensors are keyed ``prefix.path.to.leaf``."""
    tensors: dict[str, torch.Tensor] = {}
    return _encode(obj, prefix, tensors), tensors


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj
        return {TENSOR: path}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not any(k in (TENSOR, TUPLE, DICT) for k in obj):
            return {k: _encode(v, f"{path}.{k}", tensors) for k, v in obj.items()}
        return {DICT: [[_encode(k, f"{path}.k{i}", tensors), _encode(v, f"{path}.{_key(k)}", tensors)] for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, tuple):
        return {TUPLE: [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if hasattr(obj, "item") and hasattr(obj, "dtype"):  # numpy scalar
        return obj.item()
    raise TypeError(f"{path}: cannot store {type(obj).__name__} in a snapshot; give it a state_dict of tensors and plain values")


def _key(key: Any) -> str:
    return str(key).replace(".", "_")


def join(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split`."""
    if isinstance(tree, dict):
        if TENSOR in tree:
            return tensors[tree[TENSOR]]
        if TUPLE in tree:
            return tuple(join(v, tensors) for v in tree[TUPLE])
        if DICT in tree:
            return {join(k, tensors): join(v, tensors) for k, v in tree[DICT]}
        return {k: join(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [join(v, tensors) for v in tree]
    return tree


def tensor_keys(tree: Any) -> list[str]:
    """The tensor keys a tree refers to, so a loader can allocate exactly those."""
    keys: list[str] = []
    _collect(tree, keys)
    return keys


def _collect(tree: Any, keys: list[str]) -> None:
    if isinstance(tree, dict):
        if TENSOR in tree:
            keys.append(tree[TENSOR])
            return
        for value in tree.values():
            _collect(value, keys)
    elif isinstance(tree, list):
        for value in tree:
            _collect(value, keys)
