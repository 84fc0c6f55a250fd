"""``ckptrun export SNAPSHOT -o FILE``: a verified snapshot's weights as a plain ``state_dict`` file.

For evaluation and inference, where the training state (optimizer, RNG, data
position) is not wanted. The snapshot is verified first — every byte against
its manifest — and an unverified one is refused (exit 1). The model's tensors
are read in this one process through the runtime's safe DCP reader (no
unpickling of anything but DCP's own metadata) and joined with the JSON tree
``state.json`` keeps, so the keys are exactly those of ``model.state_dict()``
(DDP's ``module.`` never appears: the runtime unwraps it before saving).
``--ema`` takes the tracked ``ema`` object instead, an ``AveragedModel``: its
``module.`` prefix is stripped and its ``n_averaged`` counter dropped, so the
file loads into the bare model. ``.pt`` files are written with ``torch.save``
and load with ``torch.load(weights_only=True)``; ``.safetensors`` needs the
``export`` extra. ``--format hf`` writes a directory in the Hugging Face layout instead
(:mod:`ckptrun.runtime.checkpoint.hf_weights`): ``from_pretrained`` loads it. ``--format dcp`` writes every
tensor of the snapshot (model, optimizer, EMA) as torch's own DCP directory, pickled ``.metadata`` and all, for
tools that read only that (``dcp_to_torch_save``): a snapshot holds no pickle, so this is the way to them.
torch is imported only inside the command.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from ckptrun.cli.commands.store_flag import storage_option_flag
from ckptrun.cli.errors import EXIT_NO, EXIT_OK, CkptrunError, command
from ckptrun.cli.humanize import human_bytes
from ckptrun.cli.supervision.spec import RUN_JSON
from ckptrun.runtime import records
from ckptrun.cli import store_location
from ckptrun.runtime.manifest import MANIFEST_NAME, read_manifest
from ckptrun.runtime.storage.store import LINEAGE_NAME, list_entries
from ckptrun.runtime.checkpoint import hf_weights
from ckptrun.runtime.checkpoint.verify import OK, SnapshotReport, newest_verified, verify_snapshot

if TYPE_CHECKING:
    import torch

FORMATS = {".pt": "torch", ".pth": "torch", ".safetensors": "safetensors"}
PATH_HINT = "pass a snapshot directory (step-NNNNNNNNN), a checkpoint directory or a run directory"


@command
def export(
    snapshot: str = typer.Argument(..., metavar="SNAPSHOT", help="A snapshot directory, a checkpoint/run directory or an object-store URL (its newest verified snapshot)."),
    output: Path = typer.Option(..., "--output", "-o", metavar="FILE|DIR", help="Where to write: FILE.pt (torch.save), FILE.safetensors, or DIR with --format hf or dcp."),
    output_kind: Optional[str] = typer.Option(None, "--format", metavar="hf|dcp", help="hf: DIR in the Hugging Face layout (model.safetensors, or shards + model.safetensors.index.json, and config.json) that from_pretrained loads. dcp: DIR as torch's own DCP checkpoint of every tensor (model, optimizer, EMA), with its pickled .metadata, for torch's dcp_to_torch_save and dcp.load's default reader. [default: from the -o suffix]", show_default=False),
    max_shard_size: str = typer.Option(hf_weights.DEFAULT_MAX_SHARD, "--max-shard-size", help="--format hf: shards no larger than this (e.g. 500MB), with an index naming each tensor's file."),
    config: Optional[Path] = typer.Option(None, "--config", help="--format hf: the config.json to write (a file, or a directory holding one). [default: the model's own, kept in the snapshot]", show_default=False),
    ema: bool = typer.Option(False, "--ema", help="Export the EMA weights (the tracked `ema` AveragedModel) instead of the model's."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (snapshot, step, tensors, bytes, file) on stdout."),
    storage_option: Optional[list[str]] = storage_option_flag(),
) -> int:
    """Write the model (or EMA) weights of a verified snapshot as a plain state_dict file (.pt or .safetensors), or a Hugging Face or DCP directory (--format).

    \b
    Examples:
      ckptrun export runs/demo -o model.pt
      ckptrun export runs/demo/checkpoints/step-000000020 --ema -o ema.safetensors
      ckptrun export runs/demo --format hf -o hf_model
      ckptrun export runs/demo --format dcp -o dcp_all
    Load with: model.load_state_dict(torch.load("model.pt", weights_only=True)),
    or AutoModelForCausalLM.from_pretrained("hf_model") (any model class of the run's),
    or torch.distributed.checkpoint.format_utils.dcp_to_torch_save("dcp_all", "all.pt").
    """
    kind = dir_format(output, output_kind, config, ema) if output_kind is not None else output_format(output)
    report = verified_snapshot(snapshot, storage_option)
    name = "all" if kind == "dcp" else "ema" if ema else "model"
    state = read_every_tensor(report.path) if kind == "dcp" else read_weights(report.path, name)
    metadata = {"snapshot": str(report.path), "step": str(report.step), "object": name}
    if kind == "dcp":
        files = write_dcp(state, output)
        size = sum(file.stat().st_size for file in files)
    elif kind == "hf":
        files = write_hf(state, output, max_shard_size, metadata, config, report.path)
        size = sum(file.stat().st_size for file in files)
    else:
        output.parent.mkdir(parents=True, exist_ok=True)
        size, files = write_state_dict(state, output, kind, metadata), [output]
    what = "every tracked object" if kind == "dcp" else name
    print(f"ckptrun: exported {len(state)} tensors ({human_bytes(size)}) of {what} from {report.path.name} "
          f"(step {report.step}, verified) to {output}", file=sys.stderr)
    if as_json:
        document = {"snapshot": str(report.path), "step": report.step, "object": name, "format": kind,
                    "tensors": len(state), "bytes": size, "file": str(output), "files": [str(f) for f in files]}
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    return EXIT_OK


def output_format(output: Path) -> str:
    """torch or safetensors, from the suffix; refuses other suffixes and a missing safetensors package."""
    kind = FORMATS.get(output.suffix.lower())
    if kind is None:
        raise CkptrunError(f"-o {output}: unknown format {output.suffix or '(no suffix)'}",
                           "name the file .pt (torch.save) or .safetensors")
    if kind == "safetensors":
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            raise CkptrunError("writing .safetensors needs the safetensors package",
                               "pip install 'ckptrun[export]' (or write a .pt file)") from None
    taken = next((p for p in [output.parent, *output.parent.parents] if p.exists()), None)
    if taken is not None and not taken.is_dir():
        raise CkptrunError(f"-o {output}: {taken} is a file, not a directory", "pass a path inside a directory")
    return kind  # a missing directory is created once the weights are read (as report -o and init do)


def dir_format(output: Path, given: str, config: Path | None, ema: bool) -> str:
    """``--format hf`` or ``dcp``: DIR is a directory (or not there yet); hf: the packages are here, ``--config``
    exists; dcp: DIR is empty (a DCP directory is written whole or not at all), and ``--ema`` is not asked."""
    if given == "dcp":
        if ema:
            raise CkptrunError("--ema with --format dcp: dcp writes every tensor of the snapshot, the EMA's included",
                               "drop --ema (or write the EMA alone: --ema -o ema.safetensors)")
        if output.exists() and (not output.is_dir() or any(output.iterdir())):
            raise CkptrunError(f"-o {output}: not an empty directory; --format dcp writes a whole DCP directory",
                               "pass a new or empty directory")
        return "dcp"
    if given != "hf":
        raise CkptrunError(f"--format {given}: unknown format",
                           "pass --format hf or dcp, or name -o FILE.pt / FILE.safetensors")
    try:
        import huggingface_hub  # noqa: F401
        import safetensors.torch  # noqa: F401
    except ImportError:
        raise CkptrunError("--format hf needs the safetensors and huggingface_hub packages",
                           "pip install 'ckptrun[export]'") from None
    if output.exists() and not output.is_dir():
        raise CkptrunError(f"-o {output}: a file; --format hf writes a directory", "pass a directory path")
    if config is not None and not (config.is_file() or (config / hf_weights.CONFIG).is_file()):
        raise CkptrunError(f"--config {config}: no such file (nor {hf_weights.CONFIG} in it)",
                           "pass the model's config.json, or drop --config to use the one the snapshot keeps")
    return "hf"


def write_hf(state: dict[str, torch.Tensor], output: Path, max_shard_size: str, metadata: dict[str, str],
             config: Path | None, snapshot_dir: Path) -> list[Path]:
    """The Hugging Face layout, with ``--config`` or the model's own config (a warning when there is neither)."""
    from ckptrun.runtime.checkpoint.snapshot import STATE_JSON

    if config is not None:
        document = json.loads((config if config.is_file() else config / hf_weights.CONFIG).read_text())
    else:
        document = json.loads((snapshot_dir / STATE_JSON).read_text()).get("model_config")
        if document is None:
            print(f"ckptrun: warning: no {hf_weights.CONFIG} written: the model has no Hugging Face config; "
                  "pass --config (from_pretrained needs one)", file=sys.stderr)
    try:
        return hf_weights.write(state, output, max_shard_size, metadata, document)
    except ValueError as exc:  # huggingface_hub's size parser: "5GB", "500MB", or bytes
        raise CkptrunError(f"--max-shard-size {max_shard_size}: {exc}", "pass a size like 5GB or 500MB") from None


# --- which snapshot ---------------------------------------------------------------------


def verified_snapshot(given: str | Path, storage_option: list[str] | None = None) -> SnapshotReport:
    """The snapshot at ``path`` once it verifies, or the newest verified one of a checkpoint/run directory
    or object store (downloaded with every byte hashed, or its verified local copy)."""
    path = store_location.location(given)
    remote = store_location.store_at(path, storage_option)
    if remote is not None:
        cache = store_location.cache_of_run(path) if isinstance(path, Path) else None
        choice = store_location.fetch_newest(remote, cache, store_location.say)
        return SnapshotReport(choice.path, choice.step, OK, manifest=read_manifest(choice.path))
    if not path.is_dir():
        raise CkptrunError(f"{path}: no such directory", PATH_HINT)
    if (path / MANIFEST_NAME).exists():
        report = verify_snapshot(path)
        if not report.ok:
            problems = "; ".join(report.problems[:3]) + (f" (+{len(report.problems) - 3} more)" if len(report.problems) > 3 else "")
            raise CkptrunError(f"snapshot {path} does not verify ({report.status}): {problems}",
                               f"export another one; `ckptrun verify {path.parent}` lists those that verify", EXIT_NO)
        return report
    ckpt_dir = checkpoint_dir(path)
    report = newest_verified(ckpt_dir, log=lambda line: print(f"ckptrun: {line}", file=sys.stderr))
    if report is None:
        raise CkptrunError(f"no snapshot in {ckpt_dir} verifies", f"`ckptrun verify {ckpt_dir}` says what is wrong", EXIT_NO)
    return report


def checkpoint_dir(path: Path) -> Path:
    if (path / LINEAGE_NAME).exists() or any(e.kind == "published" for e in list_entries(path)):
        return path
    if (path / RUN_JSON).exists() or (path / records.EVENTS).exists():
        try:
            spec = json.loads((path / RUN_JSON).read_text())["spec"]
            return Path(spec["ckpt_dir"]) if spec.get("ckpt_dir") else path / "checkpoints"
        except (OSError, ValueError, KeyError, TypeError):
            return path / "checkpoints"
    raise CkptrunError(f"{path} holds no snapshot", PATH_HINT)


# --- reading and writing the weights ----------------------------------------------------------


def read_every_tensor(snapshot_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor the snapshot's ``dcp/`` holds, under its stored key, read with the safe DCP reader."""
    from ckptrun.runtime.checkpoint.dcp_io import load_metadata, tensor_table
    from ckptrun.runtime.checkpoint.snapshot import DCP_DIR

    metadata = load_metadata(snapshot_dir / DCP_DIR)
    return _load(snapshot_dir, metadata, sorted(tensor_table(metadata)))


def _load(snapshot_dir: Path, metadata: Any, keys: list[str]) -> dict[str, torch.Tensor]:
    """``keys`` read in this one process, every byte checked against its digest as it is read."""
    import torch.distributed.checkpoint as dcp
    from ckptrun.runtime.checkpoint.dcp_io import SafeReader, allocate_from_metadata
    from ckptrun.runtime.checkpoint.snapshot import DCP_DIR

    tensors = allocate_from_metadata(metadata, keys)
    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": that is the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=SafeReader(snapshot_dir / DCP_DIR), no_dist=True)
    return tensors


def write_dcp(state: dict[str, torch.Tensor], output: Path) -> list[Path]:
    """torch's own DCP layout (``FileSystemWriter``: a pickled ``.metadata``), written beside ``output`` and
    renamed into place, so a DCP directory is there whole or not at all."""
    import shutil

    import torch.distributed.checkpoint as dcp

    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=True)
        if output.exists():
            output.rmdir()  # empty: checked before anything was read
        os.replace(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(path for path in output.rglob("*") if path.is_file())


def read_weights(snapshot_dir: Path, name: str) -> dict[str, torch.Tensor]:
    """The tracked object ``name``'s tensors, read with the safe DCP reader in this one process."""
    from ckptrun.runtime.checkpoint.dcp_io import load_metadata
    from ckptrun.runtime.checkpoint.snapshot import DCP_DIR, STATE_JSON
    from ckptrun.runtime.checkpoint.treecodec import join, tensor_keys

    shared = json.loads((snapshot_dir / STATE_JSON).read_text())
    objects, aliases = shared.get("objects", {}), shared.get("aliases", {})
    if name not in objects:
        flag = "--ema: the run tracked no `ema` object" if name == "ema" else "the run tracked no `model` object"
        raise CkptrunError(f"{flag} in {snapshot_dir.name} (tracked: {', '.join(objects) or 'nothing'})",
                           "drop --ema to export the model's weights" if name == "ema" else "track the model as run.track(model=...)")
    tree = objects[name]
    metadata = load_metadata(snapshot_dir / DCP_DIR)
    keys = tensor_keys(tree)  # a tied weight is stored once, under the key its alias names
    tensors = _load(snapshot_dir, metadata, sorted({aliases.get(key, key) for key in keys}))
    tensors.update({key: tensors[aliases[key]] for key in keys if key in aliases})
    return plain_state_dict(join(tree, tensors), averaged=name == "ema")


def plain_state_dict(state: dict[str, Any], averaged: bool) -> dict[str, torch.Tensor]:
    """Tensors only, with wrapper prefixes removed (an AveragedModel's ``module.``; torch.compile's)."""
    import torch

    from ckptrun.runtime.checkpoint.wrappers import COMPILE_PREFIX  # snapshots of older ckptrun kept torch.compile's prefix

    out = {}
    for key, value in state.items():
        if averaged:
            if not key.startswith("module."):
                continue  # n_averaged: the EMA's own counter, not a weight
            key = key.removeprefix("module.")
        key = key.replace(COMPILE_PREFIX, "")
        if isinstance(value, torch.Tensor):
            out[key] = value
    return out


def write_state_dict(state: dict[str, torch.Tensor], output: Path, kind: str, metadata: dict[str, str]) -> int:
    """Write to a temp file beside ``output`` and rename it into place; returns the file's size."""
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    try:
        if kind == "safetensors":
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in hf_weights.untied(state).items()}, str(tmp), metadata=metadata)
        else:
            import torch

            torch.save(state, tmp)
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    return output.stat().st_size
