"""Issue 27 item 4: weights in and out in the Hugging Face layout.

Out: ``ckptrun export --format hf`` of a verified snapshot of a tiny GPT-2 (tied embedding and head) loads
with transformers' own ``from_pretrained`` and equals the snapshot's weights, one file or sharded with an
index. In: ``ckptrun launch --init-weights`` starts a real 2-rank DDP run from exported weights (every
rank holds them exactly), a restart restores its snapshot rather than the weights, and weights that do not
fit, are missing or are not safetensors are refused with exit 2 before or as the ranks start.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from ckptrun.cli.commands.export import read_weights
from ckptrun.runtime.checkpoint import hf_weights
from ckptrun.runtime.env import RunEnv
from ckptrun.runtime.records import read_events
from ckptrun.runtime.step.precision import Policy, resolve
from ckptrun.runtime.step.session import Run
from ckptrun.runtime.storage import store
from launch_helpers import COMMON, FIXTURES, ckptrun
from workers import run_job

STATE_JOB = FIXTURES / "state_job.py"
TINY = dict(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)


@pytest.fixture(scope="module")
def gpt2_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of the runtime, in this process, training a tiny GPT-2 for 6 steps: its final snapshot."""
    run_dir = tmp_path_factory.mktemp("gpt2") / "run"
    env = RunEnv(run_id="gpt2", run_dir=run_dir, precision="fp32", async_save=False, save_every_steps=3)
    run = Run(env, {}, Policy(resolve("fp32")))
    run.lineage = store.ensure_lineage(run.ckpt_dir, env.run_id).current  # as ckr.init does
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**TINY))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run.track(model=model, optimizer=optimizer)
    run.restore()
    tokens = torch.randint(0, 64, (6, 4, 16), generator=torch.Generator().manual_seed(1))
    for batch in run.batches(list(tokens), steps=6):
        run.train_step([batch], forward=lambda ids: model(input_ids=ids, labels=ids).loss)
    run.finish()
    return run.ckpt_dir / store.snapshot_name(6)


def _same(loaded: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(want)
    differing = [k for k in want if not torch.equal(loaded[k], want[k])]
    assert not differing, differing


def test_export_hf_loads_with_from_pretrained_equal_to_the_snapshot(gpt2_snapshot: Path, tmp_path: Path) -> None:
    """One file: model.safetensors and the model's own config.json (kept in the snapshot); from_pretrained
    with no other argument gives the snapshot's weights, the tied head equal to the embedding."""
    out = tmp_path / "hf"
    result = ckptrun("export", str(gpt2_snapshot), "--format", "hf", "-o", str(out), "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads(result.stdout)["format"] == "hf"
    want = read_weights(gpt2_snapshot, "model")
    model = GPT2LMHeadModel.from_pretrained(out)
    _same(model.state_dict(), want)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr(), "from_pretrained ties them again"
    assert json.loads((out / "config.json").read_text())["n_layer"] == TINY["n_layer"]


def test_export_hf_shards_above_the_size_with_an_index_and_loads(gpt2_snapshot: Path, tmp_path: Path) -> None:
    """--max-shard-size 20KB: several model-0000K-of-0000N files and model.safetensors.index.json naming each
    tensor's file; from_pretrained reads them all and equals the snapshot; --config supplies config.json."""
    config = tmp_path / "given" / "config.json"
    config.parent.mkdir()
    GPT2Config(**TINY).to_json_file(config)
    out = tmp_path / "sharded"
    result = ckptrun("export", str(gpt2_snapshot), "--format", "hf", "--max-shard-size", "20KB", "--config",
                     str(config.parent), "-o", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    shards = sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and not (out / "model.safetensors").exists(), sorted(p.name for p in out.iterdir())
    index = json.loads((out / hf_weights.INDEX).read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    want = read_weights(gpt2_snapshot, "model")
    assert set(index["weight_map"]) == set(want)
    _same(GPT2LMHeadModel.from_pretrained(out).state_dict(), want)
    assert hf_weights.weight_files(out) == [out / name for name in shards]


def test_export_hf_refuses_bad_input_in_one_line(gpt2_snapshot: Path, tmp_path: Path) -> None:
    """An unknown --format, a file as DIR, a missing --config, a bad size: exit 2, nothing written."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [(("--format", "onnx", "-o", str(tmp_path / "a")), "unknown format"),
             (("--format", "hf", "-o", str(afile)), "a file; --format hf writes a directory"),
             (("--format", "hf", "--config", str(tmp_path / "nope.json"), "-o", str(tmp_path / "b")), "no such file"),
             (("--format", "hf", "--max-shard-size", "lots", "-o", str(tmp_path / "c")), "--max-shard-size lots")]
    for args, words in cases:
        result = ckptrun("export", str(gpt2_snapshot), *args, cwd=tmp_path)
        assert result.returncode == 2 and words in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) <= 2, result.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# --- in: --init-weights ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported_state_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """2-rank DDP state job trained 10 steps (plain torchrun), its final weights exported as one safetensors file:
    (the file, the run dir holding final-R.json)."""
    work = tmp_path_factory.mktemp("trained")
    run_dir = work / "run"
    assert run_job(run_dir, nproc=2, script=STATE_JOB, args=("--steps", "10"), save_every_steps=5,
                   timeout=200).returncode == 0
    weights = work / "weights.safetensors"
    result = ckptrun("export", str(run_dir), "-o", str(weights), cwd=work)
    assert result.returncode == 0, result.stderr
    return weights, run_dir


@pytest.mark.timeout(300)
def test_a_launch_starts_from_init_weights_on_every_rank_and_a_restart_restores_its_snapshot(
        exported_state_job: tuple[Path, Path], tmp_path: Path) -> None:
    """--steps 0: both ranks end holding exactly the exported weights (the trained run's final parameters).
    Then 10 steps from them with rank 1 killed at step 7 (sync saves: snapshot 5 is published before step 6):
    attempt 1 starts from the weights, attempt 2 restores snapshot 5 (not the weights: one init_weights event,
    of attempt 1)."""
    weights, trained = exported_state_job
    run_dir = tmp_path / "zero"
    result = ckptrun("launch", *COMMON, "--run-dir", str(run_dir), "--init-weights", str(weights), str(STATE_JOB),
                     "--steps", "0", cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert (run_dir / f"final-{rank}.json").read_text() == (trained / f"final-{rank}.json").read_text()
    [started] = read_events(run_dir, "init_weights")
    assert started["sha256"] == hf_weights.digest(weights) and started["tensors"] == 4
    assert json.loads((run_dir / "run.json").read_text())["spec"]["init_weights_sha256"] == started["sha256"]

    resumed = tmp_path / "killed"
    result = ckptrun("launch", *COMMON, "--sync-save", "--run-dir", str(resumed), "--init-weights", str(weights),
                     "--inject-fault", "kill:rank=1:step=7", str(STATE_JOB), "--steps", "10", cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [e["attempt"] for e in read_events(resumed, "init_weights")] == [1]
    assert [(e["attempt"], Path(e["snapshot"]).name) for e in read_events(resumed, "restored")] == \
        [(2, store.snapshot_name(5))]


@pytest.mark.timeout(240)
def test_init_weights_that_are_missing_unreadable_or_do_not_fit_are_refused_with_exit_2(
        gpt2_snapshot: Path, tmp_path: Path) -> None:
    """A missing path and a file that is not safetensors are refused by the launch (nothing starts); weights of
    another model (the GPT-2's) are refused by the ranks, naming what does not fit, and never retried."""
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    for path, words in ((tmp_path / "nowhere.safetensors", "no such file or directory"),
                        (garbage, "not a readable safetensors file")):
        result = ckptrun("launch", "--run-dir", str(tmp_path / "r"), "--init-weights", str(path), str(STATE_JOB),
                         cwd=tmp_path)
        assert result.returncode == 2 and words in result.stderr, result.stderr
        assert not (tmp_path / "r").exists(), "refused before anything was created"
    other = tmp_path / "gpt2.safetensors"
    assert ckptrun("export", str(gpt2_snapshot), "-o", str(other), cwd=tmp_path).returncode == 0
    run_dir = tmp_path / "unfit"
    result = ckptrun("launch", "--run-dir", str(run_dir), "--heartbeat-timeout", "5", "--startup-timeout", "60",
                     "--init-weights", str(other), str(STATE_JOB), "--steps", "3", cwd=tmp_path, timeout=200)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "does not fit the model" in result.stderr and "missing: 0.bias, 0.weight, 2.bias, 2.weight" in result.stderr, result.stderr[-2000:]
    assert not read_events(run_dir, "restart"), "a refusal is not retried"


@pytest.mark.timeout(300)
def test_fsdp2_ranks_start_from_init_weights_each_holding_its_shard_of_them(tmp_path: Path) -> None:
    """FSDP2 on 2 ranks: a run trained 6 steps is exported (gathered, one file); a launch from that file shards
    it, and what the ranks hold, gathered again, equals the file bitwise."""
    from safetensors.torch import load_file

    trained = tmp_path / "trained"
    assert run_job(trained, nproc=2, script=FIXTURES / "fsdp_job.py", args=("--steps", "6"), save_every_steps=3,
                   timeout=200).returncode == 0
    weights = tmp_path / "fsdp.safetensors"
    assert ckptrun("export", str(trained), "-o", str(weights), cwd=tmp_path).returncode == 0
    dumped = tmp_path / "held.safetensors"
    result = ckptrun("launch", *COMMON, "--run-dir", str(tmp_path / "run"), "--init-weights", str(weights),
                     str(FIXTURES / "fsdp_job.py"), "--steps", "0", "--dump-after-restore", str(dumped),
                     cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    held, want = load_file(str(dumped)), load_file(str(weights))
    assert sorted(held) == sorted(want) and all(torch.equal(held[k], want[k]) for k in want)
    torch.manual_seed(0)  # the script's own initial weights (fsdp_job.py): what it would hold without the file
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)).state_dict()
    assert sorted(fresh) == sorted(held) and not any(torch.equal(held[k], fresh[k]) for k in fresh)


def test_a_snapshots_dcp_dir_loads_with_torchs_own_tools(gpt2_snapshot: Path, tmp_path: Path) -> None:
    """Interoperability without ckptrun: each data file of ``dcp/`` is a safetensors file (``safe_open`` reads it
    with the model's own names), and ``dcp.load`` through torch's own ``HuggingFaceStorageReader`` reads the
    whole directory to the same tensors the runtime's safe reader returns. ``dcp_to_torch_save`` reads only
    a pickled ``.metadata``, which no snapshot holds: ``export --format dcp`` writes torch's own DCP directory
    of every tensor (model and optimizer), and ``dcp_to_torch_save`` and ``dcp.load``'s default reader take it."""
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from workers import shared_tensors

    want = shared_tensors(gpt2_snapshot)
    assert any(key.endswith("wte.weight") for key in want), sorted(want)[:5]
    assert any(".exp_avg_sq" in key or "exp_avg_sq" in key for key in want), sorted(want)[-5:]  # the optimizer's too
    [data_file] = sorted((gpt2_snapshot / "dcp").glob("*.safetensors"))
    with safe_open(str(data_file), framework="pt") as opened:
        assert set(want) <= set(opened.keys()) and all(torch.equal(opened.get_tensor(k), want[k]) for k in want)
    loaded = {key: torch.empty_like(value) for key, value in want.items()}
    dcp.load(loaded, storage_reader=dcp.HuggingFaceStorageReader(str(gpt2_snapshot / "dcp")), no_dist=True)
    assert all(torch.equal(loaded[k], want[k]) for k in want)

    out = tmp_path / "dcp_all"
    result = ckptrun("export", str(gpt2_snapshot), "--format", "dcp", "-o", str(out), "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["tensors"] == len(want) and (out / ".metadata").is_file()
    dcp_to_torch_save(out, tmp_path / "all.pt")
    _same(torch.load(tmp_path / "all.pt", weights_only=True), want)
    again = {key: torch.zeros_like(value) for key, value in want.items()}
    dcp.load(again, checkpoint_id=str(out), no_dist=True)
    _same(again, want)
    taken = ckptrun("export", str(gpt2_snapshot), "--format", "dcp", "-o", str(out), cwd=tmp_path)
    assert taken.returncode == 2 and "not an empty directory" in taken.stderr, taken.stderr
