"""The snapshot format with no pickle in it (issue 27 item 1), in one process with real saves and real files.

Every file of a new snapshot is JSON or a safetensors-layout tensor file; a restore reads each stored chunk
straight into the live tensor it fills and equals the saved state bitwise; a flipped byte anywhere in a data
file (header included) fails the load naming it; snapshots in the format before (``torch.save`` items, a
pickled ``.metadata``) still load. DDP and FSDP2 at the same and other world sizes: test_reshard.py and
test_sharded_state.py, which save in this format.
"""

from __future__ import annotations

import io
import json
import pickletools
from pathlib import Path

import pytest
import torch

from ckptrun.runtime.checkpoint import snapshot, tensor_file
from snapshot_factory import flip_byte, save_state


def state(step: int) -> tuple[snapshot.State, dict[str, torch.Tensor]]:
    """Tensors of several dtypes and shapes (a 0-d one, an empty one), shared and per rank."""
    torch.manual_seed(step)
    shared = {"model.w": torch.randn(300, 7), "model.b": torch.randn(5).to(torch.bfloat16),
              "optim.step": torch.tensor(3.0), "optim.mask": torch.rand(11) > 0.5,
              "optim.count": torch.arange(6, dtype=torch.int64), "model.empty": torch.empty(0, 4)}
    tree = {"objects": {"model": {k.split(".", 1)[1]: {"__tensor__": k} for k in shared}}, "counters": {"step": step}}
    own = {"rng.torch": torch.randint(0, 255, (5056,), dtype=torch.uint8), "rng.noise": torch.randn(3)}
    return snapshot.State(tree, shared, {"rng": {}}, own), {**shared, **own}


def save(ckpt_dir: Path, step: int, legacy: bool = False) -> tuple[Path, dict[str, torch.Tensor]]:
    staged, tensors = state(step)
    return save_state(ckpt_dir, staged, step, "raw", legacy), tensors


def is_pickle(data: bytes) -> bool:
    """Whether ``data`` opens as a pickle stream (or a ``torch.save`` zip, which holds one)."""
    if data.startswith(b"PK\x03\x04"):
        return True
    try:
        for opcode, _, _ in pickletools.genops(io.BytesIO(data)):
            if opcode.name == "STOP":
                return True
    except Exception:  # noqa: BLE001 - not a pickle: any parse error says so
        return False
    return False


def test_no_file_of_a_new_snapshot_is_a_pickle_and_each_parses_as_json_or_tensors(tmp_path):
    path, _ = save(tmp_path / "ckpt", 1)
    files = sorted(p for p in path.rglob("*") if p.is_file())
    assert {p.relative_to(path).as_posix() for p in files} == {
        "manifest.json", "state.json", "rank-00000.json", "rank-00000.safetensors", "dcp/metadata.json",
        "dcp/__0_0.safetensors"}
    for file in files:
        data = file.read_bytes()
        assert not is_pickle(data), f"{file.name} is a pickle"
        if file.suffix == ".json":
            json.loads(data)
        else:
            entries, _, start = tensor_file.parse(data)
            assert start + max(end for *_, end in entries.values()) == len(data), f"{file.name}: bytes past its tensors"
    assert is_pickle(b"\x80\x04K\x01."), "the check itself finds a pickle"


def test_a_restore_reads_each_chunk_into_the_live_tensor_and_equals_the_saved_state_bitwise(tmp_path):
    path, saved = save(tmp_path / "ckpt", 1)
    live = {key: torch.zeros_like(value) for key, value in saved.items() if key.startswith(("model.", "optim."))}
    addresses = {key: value.data_ptr() for key, value in live.items()}
    loaded = snapshot.load(path, live=live)
    for key, value in saved.items():
        got = {**loaded.shared_tensors, **loaded.rank_tensors}[key]
        assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value), key
    assert all(loaded.shared_tensors[k].data_ptr() == addresses[k] for k in live), "restored in place"
    assert torch.equal(live["model.w"], saved["model.w"])


@pytest.mark.parametrize("where", ["header", "first-tensor", "last-tensor"])
def test_a_flipped_byte_anywhere_in_a_data_file_fails_the_load_naming_where(tmp_path, where):
    path, _ = save(tmp_path / "ckpt", 1)
    data = path / "dcp" / "__0_0.safetensors"
    entries, _, start = tensor_file.parse(data.read_bytes())
    ordered = sorted(entries.items(), key=lambda item: item[1][2])
    name, (_, _, begin, end) = ordered[0] if where == "first-tensor" else ordered[-1]
    if where == "last-tensor":
        name, (_, _, begin, end) = next((n, e) for n, e in reversed(ordered) if e[3] > e[2])
    flip_byte(data, 20 if where == "header" else start + (begin + end) // 2)
    with pytest.raises(snapshot.LoadError) as caught:
        snapshot.load(path)
    said = "its header" if where == "header" else f"tensor {name!r}"
    assert "DigestMismatch: dcp/__0_0.safetensors bytes" in str(caught.value) and said in str(caught.value)


def test_a_snapshot_in_the_format_before_raw_tensors_still_loads_bitwise(tmp_path):
    path, saved = save(tmp_path / "ckpt", 1, legacy=True)
    names = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "rank-00000.pt"} <= names, names
    loaded = snapshot.load(path)
    assert all(torch.equal({**loaded.shared_tensors, **loaded.rank_tensors}[k], v) for k, v in saved.items())


def test_a_tensor_file_header_that_does_not_fit_its_bytes_is_refused():
    pieces = tensor_file.encode({"w": torch.randn(4)})
    data = bytearray(b"".join(bytes(p) for p in pieces))
    assert torch.equal(tensor_file.decode(data)["w"], torch.frombuffer(bytearray(pieces[1]), dtype=torch.float32))
    with pytest.raises(tensor_file.TensorFileError, match="does not fit"):
        tensor_file.decode(data[:-4])
    with pytest.raises(tensor_file.TensorFileError, match="unknown dtype"):
        tensor_file.dtype_of("Tensor")
