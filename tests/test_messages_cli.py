"""Every message true, every refusal one line (issue 28): what a new user still met, one test per item.

Refusals are asserted line for line on stderr (``error:`` then ``hint:``, no click ``Usage:`` block), with
their exit code and nothing created.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch_helpers import ckptrun


# --- item 1: every parse error goes through the one error renderer -----------------------------------


@pytest.mark.parametrize("argv, lines", [
    (["lauch"], ["error: No such command 'lauch'.", "hint: did you mean 'launch'? see `ckptrun --help`"]),
    (["launch", "--save-every-steps", "ten", "train.py"],
     ["error: Invalid value for '--save-every-steps': Input should be a valid integer, unable to parse string as an integer",
      "hint: see `ckptrun launch --help`"]),
    (["status", "--rto-budget"], ["error: Option '--rto-budget' requires an argument.", "hint: see `ckptrun status --help`"]),
    (["verify", "a", "b"], ["error: Got unexpected extra argument(s) (b)", "hint: see `ckptrun verify --help`"]),
])
def test_a_parse_error_is_one_error_line_and_one_hint(tmp_path: Path, argv: list[str], lines: list[str]) -> None:
    (tmp_path / "train.py").write_text("open('ran', 'w').close()\n")
    result = ckptrun(*argv, cwd=tmp_path, timeout=60)
    assert (result.returncode, result.stderr.splitlines()) == (2, lines)
    assert result.stdout == "" and not (tmp_path / "runs").exists() and not (tmp_path / "ran").exists()


# --- item 2: a TOML key typo gets the nearest option name, never a dump of every field ---------------


@pytest.mark.parametrize("line, lines", [
    ("nproc_per_nod = 2", ["error: run.toml: unknown key 'nproc_per_nod'", "hint: did you mean nproc-per-node? "
                           "the keys are launch's long options, `-` or `_` alike (see `ckptrun launch --help`)"]),
    ('store-url = "s3://b/x"', ["error: run.toml: unknown key 'store-url'", "hint: did you mean ckpt-dir? "
                                "the keys are launch's long options, `-` or `_` alike (see `ckptrun launch --help`)"]),
])
def test_a_config_key_typo_suggests_the_option(tmp_path: Path, line: str, lines: list[str]) -> None:
    (tmp_path / "run.toml").write_text(line + "\n")
    (tmp_path / "train.py").write_text("open('ran', 'w').close()\n")
    result = ckptrun("launch", "--config", "run.toml", "train.py", cwd=tmp_path, timeout=60)
    assert (result.returncode, result.stderr.splitlines()) == (2, lines)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ran").exists()


def test_config_keys_take_either_spelling_and_help_lists_no_internal_field(tmp_path: Path) -> None:
    from ckptrun.cli.supervision.spec import build_spec, config_keys

    (tmp_path / "run.toml").write_text("nproc_per_node = 2\nheartbeat-timeout = 9\n")
    spec = build_spec({}, tmp_path / "run.toml")
    assert (spec.nproc_per_node, spec.heartbeat_timeout) == ("2", 9.0)
    shown = ckptrun("launch", "--help", cwd=tmp_path, timeout=60).stdout
    internal = ("--store-url", "--store-secrets", "--script-args", "--store-options")
    assert "--nproc-per-node" in shown and not [name for name in internal if name in shown]
    assert {"nproc-per-node", "ckpt-dir", "storage-option"} <= set(config_keys())
    assert not {"store-url", "store-secrets"} & set(config_keys())


# --- item 4: which run: the newest by its own start, said, and named either way ----------------------


def _finished_run(cwd: Path, name: str, created: float) -> Path:
    """A completed run as the supervisor leaves it: run.json, its events and three step records."""
    from ckptrun.cli.supervision.spec import LaunchSpec, RunRecord, write_run_record
    from ckptrun.runtime.records import log_event, log_metrics

    run_dir = cwd / "runs" / name
    run_dir.mkdir(parents=True)
    write_run_record(run_dir, RunRecord(run_id=name, created=created, spec=LaunchSpec(run_dir=run_dir)))
    for event in ("launch", "attempt_start", "run_completed"):
        log_event(run_dir, event, attempt=1, step=3)
    for step in (1, 2, 3):
        log_metrics(run_dir, {"step": step, "attempt": 1, "time": created + step, "loss": 1.0 / step})
    return run_dir


@pytest.mark.timeout(300)
def test_a_bare_resume_picks_the_newest_run_by_start_even_after_reading_an_older_one(tmp_path: Path) -> None:
    old = _finished_run(tmp_path, "old", created=1_000.0)
    _finished_run(tmp_path, "new", created=2_000.0)
    assert ckptrun("report", "runs/old", cwd=tmp_path, timeout=120).returncode == 0  # writes into runs/old
    assert (old / "report.png").exists()
    picked = ckptrun("resume", "--latest", "--json", cwd=tmp_path, timeout=60)
    assert picked.returncode == 0, picked.stderr
    assert picked.stderr.splitlines()[0] == (f"ckptrun: run {Path('runs/new')} (the newest under runs/ by start time; "
                                             "pass --run-dir RUN_DIR for another)")
    assert json.loads(picked.stdout)["run_dir"] == str(Path("runs/new"))
    for argv in (["status", "runs/old", "--json"], ["status", "--run-dir", "runs/old", "--json"]):
        shown = ckptrun(*argv, cwd=tmp_path, timeout=60)
        assert (shown.returncode, json.loads(shown.stdout)["run_dir"], shown.stderr) == (0, "runs/old", ""), argv
    positional = ckptrun("resume", "runs/old", "--json", cwd=tmp_path, timeout=60)
    assert json.loads(positional.stdout)["run_dir"] == "runs/old" and "the newest under" not in positional.stderr
    both = ckptrun("stop", "runs/old", "--run-dir", "runs/new", cwd=tmp_path, timeout=60)
    assert (both.returncode, both.stderr.splitlines()) == (2, [
        "error: two runs: runs/old and --run-dir runs/new", "hint: pass one of them"])


# --- item 6: a user's traceback starts at the user's script ------------------------------------------

RAISES = 'def train():\n    raise ValueError("bad batch at step 0")\n\n\ntrain()\n'
USER_TRACEBACK = ["Traceback (most recent call last):", '  File "train.py", line 5, in <module>', "    train()",
                  '  File "train.py", line 2, in train', '    raise ValueError("bad batch at step 0")',
                  "ValueError: bad batch at step 0"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("entry", [["ckptrun.runtime.worker.bootstrap"], ["ckptrun.runtime.worker.warm_start", "pids"]],
                         ids=["cold", "warm"])
def test_a_script_traceback_starts_at_the_script_and_debug_keeps_ours(tmp_path: Path, entry: list[str]) -> None:
    """What a rank prints (torchrun runs exactly these entries); the error file torchrun reads says the same."""
    import os
    import subprocess
    import sys

    (tmp_path / "train.py").write_text(RAISES)
    (tmp_path / "pids").mkdir()
    env = {**os.environ, "RANK": "0", "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json")}
    env.pop("CKPTRUN_DEBUG", None)
    plain = subprocess.run([sys.executable, "-m", *entry, "train.py"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=60)
    lines = plain.stderr.splitlines()  # a warm start outside torchrun's agent first says it has no agent
    assert (plain.returncode, lines[lines.index(USER_TRACEBACK[0]):]) == (1, USER_TRACEBACK)
    recorded = json.loads((tmp_path / "error.json").read_text())["message"]["extraInfo"]["py_callstack"]
    assert recorded.splitlines() == USER_TRACEBACK
    debug = subprocess.run([sys.executable, "-m", *entry, "train.py"], cwd=tmp_path, env={**env, "CKPTRUN_DEBUG": "1"},
                           capture_output=True, text=True, timeout=60)
    assert debug.returncode == 1 and "bootstrap.py" in debug.stderr and debug.stderr.endswith(USER_TRACEBACK[-1] + "\n")


def test_the_launchers_debug_flag_reaches_the_workers(tmp_path: Path) -> None:
    import io

    from ckptrun.cli import errors
    from ckptrun.cli.progress import Progress
    from ckptrun.cli.supervision.rundir import RunPaths
    from ckptrun.cli.supervision.spec import LaunchSpec
    from ckptrun.cli.supervision.world import LocalWorld

    world = LocalWorld(LaunchSpec(), "r", RunPaths(tmp_path), tmp_path / "checkpoints", [], Progress(stream=io.StringIO()))
    assert world.run_env(1, None).to_env().get("CKPTRUN_DEBUG", "0") == "0"
    errors.set_debug(True)
    try:
        assert world.run_env(1, None).to_env()["CKPTRUN_DEBUG"] == "1"
    finally:
        errors.set_debug(False)


# --- item 3: object-store commands as the README shows them ------------------------------------------


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory):
    from s3_server import start_server

    server = start_server(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.stop()


def _no_endpoint_env(server) -> dict[str, str]:
    """Credentials in the environment as usual, but no endpoint: it must come from --storage-option or run.json."""
    import os

    env = {**os.environ, **server.env}
    for key in ("AWS_ENDPOINT_URL", "FSSPEC_S3_ENDPOINT_URL"):
        env.pop(key)
    return env


def _publish_to_store(url: str, endpoint: str, scratch: Path, step: int = 5) -> None:
    """A snapshot committed through the store's own write path (files, then the manifest)."""
    from snapshot_factory import RUN_ID, make_snapshot

    from ckptrun.runtime.manifest import read_manifest
    from ckptrun.runtime.storage.ckpt_url import parse
    from ckptrun.runtime.storage.remote_store import FsspecStore

    local = make_snapshot(scratch, step)
    store = FsspecStore(parse(url), {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}, RUN_ID)
    handle = store.open_new(step)
    manifest = read_manifest(local)
    for entry in manifest.files:
        with store.open_write(handle, entry.path) as stream:
            stream.write((local / entry.path).read_bytes())
    store.publish(handle, manifest)


@pytest.mark.timeout(400)
def test_verify_takes_storage_options_and_a_store_runs_dir_resolves_to_its_store(tmp_path: Path, moto) -> None:
    import subprocess
    import sys

    from snapshot_factory import RUN_ID

    from ckptrun.cli.supervision.spec import LaunchSpec, RunRecord, write_run_record

    url = f"s3://{moto.new_bucket()}/ckpt"
    _publish_to_store(url, moto.endpoint, tmp_path / "local")
    env = _no_endpoint_env(moto)

    def cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ckptrun.cli.main", *argv], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)

    by_url = cli("verify", url, "--storage-option", f"endpoint_url={moto.endpoint}", "--json")
    assert by_url.returncode == 0, by_url.stderr
    assert [s["step"] for s in json.loads(by_url.stdout)["snapshots"]] == [5]
    run_dir = tmp_path / "runs" / "s3"
    run_dir.mkdir(parents=True)  # as launch --ckpt-dir URL --storage-option endpoint_url=… leaves it
    write_run_record(run_dir, RunRecord(run_id=RUN_ID, spec=LaunchSpec(
        run_dir=run_dir, ckpt_dir=url, store_options=[f"endpoint_url={moto.endpoint}"])))
    by_run = cli("verify", "runs/s3", "--json")
    assert by_run.returncode == 0, by_run.stderr
    assert json.loads(by_run.stdout)["path"] == url and f"verifying {url}" in by_run.stderr
    assert cli("estimate-rto", url, "--storage-option", f"endpoint_url={moto.endpoint}", "--json").returncode == 0
    local = cli("verify", "local", "--storage-option", "endpoint_url=http://x")
    assert (local.returncode, local.stderr.splitlines()) == (2, [
        "error: --storage-option applies to an object store; local holds local snapshots",
        "hint: drop --storage-option, or pass the store's URL (s3://…)"])


# --- item 7: small state without a class -------------------------------------------------------------

PLAIN_STATE = """import json, sys
import torch
import ckptrun.runtime as ckr

run = ckr.init()
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
best_val = ckr.Value(float("inf"))
counters = {"seen": 0, "worst": None, "history": []}
run.track(model=model, optimizer=optimizer, best_val=best_val, counters=counters)
start = run.restore()
if sys.argv[1] == "train":
    for step in range(3):
        loss = run.train_step([torch.ones(4, 2) * (step + 1)], forward=lambda batch: model(batch).pow(2).mean())
        best_val.value = min(best_val.value, loss)
        counters["seen"] += 1
        counters["history"].append(round(loss, 6))
    run.finish()
print(json.dumps({"start": start, "best": best_val.value, "counters": counters}))
"""


@pytest.mark.timeout(400)
def test_a_plain_value_and_a_dict_are_tracked_and_restored(tmp_path: Path) -> None:
    from workers import run_job

    from ckptrun.runtime.checkpoint.plain_state import Value, trackable

    script = tmp_path / "plain_state.py"
    script.write_text(PLAIN_STATE)
    trained = run_job(tmp_path / "run", script=script, args=("train",), precision="fp32")
    assert trained.returncode == 0, trained.stderr[-3000:]
    before = json.loads(trained.stdout.splitlines()[-1])
    restored = run_job(tmp_path / "run", script=script, args=("show",), precision="fp32", attempt=2)
    assert restored.returncode == 0, restored.stderr[-3000:]
    after = json.loads(restored.stdout.splitlines()[-1])
    assert (before["start"], after["start"]) == (0, 3)
    assert after["best"] == before["best"] < float("inf") and after["counters"] == before["counters"]
    assert after["counters"]["seen"] == 3 and len(after["counters"]["history"]) == 3
    with pytest.raises(TypeError, match=r"track\(bad=\.\.\.\): Object of type object is not JSON serializable"):
        trackable("bad", {"x": object()}).state_dict()
    assert Value(float("inf")).state_dict() == {"value": float("inf")}


@pytest.mark.parametrize("value", [{"pair": (1, 2)}, {1: "one"}, [{"nested": (0.5,)}]])
def test_a_plain_value_that_json_would_change_is_refused_at_save(value: object) -> None:
    """A tuple read back as a list, an int key as a string: refused when saved, not changed by a restore."""
    from ckptrun.runtime.checkpoint.plain_state import Value, jsonable

    with pytest.raises(TypeError, match="does not survive JSON unchanged"):
        Value(value).state_dict()
    kept = {"nan": float("nan"), "inf": float("inf"), "list": [1, 2.5, None, True], "dict": {"k": "v"}}
    assert json.dumps(jsonable(kept, "ok")) == json.dumps(kept)


# --- item 5: leftovers and stale words ---------------------------------------------------------------


@pytest.mark.timeout(400)
def test_estimate_rto_leaves_nothing_in_the_current_directory(tmp_path: Path) -> None:
    from snapshot_factory import make_snapshot

    make_snapshot(tmp_path / "ck", 5)
    result = ckptrun("estimate-rto", "ck", "--json", cwd=tmp_path, timeout=240)  # times a real no-op relaunch
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["components"]["teardown"]["source"] == "measured"  # the no-op launch ran
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_stop_of_a_completed_run_does_not_offer_to_continue_it(tmp_path: Path) -> None:
    _finished_run(tmp_path, "done", created=1_000.0)
    result = ckptrun("stop", "runs/done", cwd=tmp_path, timeout=60)
    assert (result.returncode, result.stderr.splitlines()) == (2, [
        "error: no supervisor is running runs/done on this host",
        "hint: nothing to stop: the run completed (`ckptrun status runs/done` shows it)"])


def test_export_refuses_a_file_as_its_directory_before_reading_anything(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("")
    result = ckptrun("export", "nowhere", "-o", "taken/model.pt", cwd=tmp_path, timeout=60)
    assert (result.returncode, result.stderr.splitlines()) == (2, [
        "error: -o taken/model.pt: taken is a file, not a directory", "hint: pass a path inside a directory"])


def test_export_creates_a_missing_directory_as_report_and_init_do(tmp_path: Path) -> None:
    """One rule for -o: a missing parent (two levels here) is created, and the file is a plain state_dict."""
    import torch

    _accumulating_run(tmp_path / "run", steps=2, by_hand=0)  # in process: a snapshot of a Linear(3, 1) at step 2
    result = ckptrun("export", "run/checkpoints", "-o", "new/nested/model.pt", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    state = torch.load(tmp_path / "new" / "nested" / "model.pt", weights_only=True)
    assert sorted(state) == ["bias", "weight"] and state["weight"].shape == (1, 3)
    assert sorted(p.name for p in (tmp_path / "new" / "nested").iterdir()) == ["model.pt"]  # no temp file left


# --- item 8: one writer per shared record file on many nodes -----------------------------------------

WRITE_EVENT = """import sys
from pathlib import Path
from ckptrun.runtime.records import log_event
log_event(Path(sys.argv[1]), sys.argv[2], step=int(sys.argv[3]))
"""


def test_only_the_leaders_node_appends_to_the_shared_events_file(tmp_path: Path) -> None:
    """A rank on node 1 (C1's CKPTRUN_NODE, as its launcher sets it) and node 1's launcher write node-local
    files; node 0 and a one-node run write events.jsonl; every reader sees the merge in time order."""
    import os
    import subprocess
    import sys

    from ckptrun.runtime.env import variable
    from ckptrun.runtime.records import NODE_VARIABLE, log_event, read_events, read_jsonl

    assert NODE_VARIABLE == variable("node")
    run_dir = tmp_path / "run"
    (tmp_path / "write.py").write_text(WRITE_EVENT)
    base = {k: v for k, v in os.environ.items() if k != NODE_VARIABLE}
    for node, name, step in ((None, "single", 1), ("0", "leader_rank", 2), ("1", "node1_rank", 3)):
        env = base if node is None else {**base, NODE_VARIABLE: node}
        subprocess.run([sys.executable, str(tmp_path / "write.py"), str(run_dir), name, str(step)], env=env,
                       check=True, timeout=60)
    log_event(run_dir, "node1_launcher", writer_node=1, step=4)
    shared = [r["event"] for r in read_jsonl(run_dir / "events.jsonl")]
    local = [r["event"] for r in read_jsonl(run_dir / "nodes" / "node-1" / "events.jsonl")]
    assert (shared, local) == (["single", "leader_rank"], ["node1_rank", "node1_launcher"])
    assert [r["step"] for r in read_events(run_dir)] == [1, 2, 3, 4]
    assert [r["step"] for r in read_events(run_dir, "node1_rank")] == [3]


def test_a_fatal_record_of_a_rank_on_another_node_lands_in_its_nodes_file(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """fatal.json has one writer node too: node 0's ranks write the shared file, a rank of node 1 (C1's
    CKPTRUN_NODE, read at each write) writes nodes/node-1/fatal.json, and the supervisor's reader sees both,
    newest last."""
    from ckptrun.cli.progress import Progress
    from ckptrun.cli.supervision.rundir import RunPaths
    from ckptrun.cli.supervision.spec import LaunchSpec
    from ckptrun.cli.supervision.world import LocalWorld
    from ckptrun.runtime.records import NODE_VARIABLE, read_fatal, read_jsonl, write_fatal

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    world = LocalWorld(LaunchSpec(), "r", RunPaths(run_dir), run_dir / "checkpoints", [], Progress())
    for node, rank, reason in (("0", 0, "leader refused"), ("1", 3, "node 1 refused")):
        monkeypatch.setenv(NODE_VARIABLE, node)  # as C1 gives a rank of that node
        write_fatal(run_dir, rank, reason, 4)
    shared = [r["reason"] for r in read_jsonl(run_dir / "fatal.json")]
    local = [r["reason"] for r in read_jsonl(run_dir / "nodes" / "node-1" / "fatal.json")]
    assert (shared, local) == (["leader refused"], ["node 1 refused"])
    assert [(r["rank"], r["exit_code"]) for r in read_fatal(run_dir)] == [(0, 4), (3, 4)]
    assert [r["reason"] for r in world.fatal_records()] == ["leader refused", "node 1 refused"]


def test_the_supervisor_sees_the_events_of_a_rank_0_on_another_node(tmp_path: Path) -> None:
    """Global rank 0 may run on node 1 (torch's rendezvous assigns ranks): its ``snapshot_saved`` lands in
    node 1's file, and every node's supervisor must still see it (the no-progress rule counts on it)."""
    from ckptrun.cli.progress import Progress
    from ckptrun.cli.supervision.rundir import RunPaths
    from ckptrun.cli.supervision.spec import LaunchSpec
    from ckptrun.cli.supervision.world import LocalWorld
    from ckptrun.runtime.records import log_event

    log_event(tmp_path, "snapshot_saved", writer_node=1, step=5)  # before this world: not new
    world = LocalWorld(LaunchSpec(), "r", RunPaths(tmp_path), tmp_path / "checkpoints", [], Progress())
    log_event(tmp_path, "snapshot_saved", writer_node=1, step=10)
    log_event(tmp_path, "snapshot_saved", writer_node=2, step=15)  # a file that did not exist yet
    log_event(tmp_path, "stopped", step=15)
    assert [e["step"] for e in world.attempt_events("snapshot_saved")] == [10, 15]
    assert [e["step"] for e in world.attempt_events("stopped")] == [15]
    assert world.snapshot_step == 15


def test_the_status_line_names_the_snapshot_the_ranks_restored_not_the_one_on_disk(tmp_path: Path) -> None:
    """A memory-tier restore (step 90) is newer than the durable snapshot the supervisor picked (step 50)."""
    import io

    from ckptrun.cli.progress import Progress
    from ckptrun.cli.supervision.rundir import RunPaths
    from ckptrun.cli.supervision.spec import LaunchSpec
    from ckptrun.cli.supervision.world import LocalWorld
    from ckptrun.runtime.records import log_event

    out = io.StringIO()
    world = LocalWorld(LaunchSpec(), "r", RunPaths(tmp_path), tmp_path / "checkpoints", [], Progress(stream=out),
                       restored_step=50)
    world.attempt = 2
    log_event(tmp_path, "restored", attempt=1, step=10, tier="disk")  # an earlier attempt's: not this one's
    log_event(tmp_path, "restored", attempt=2, step=90, tier="memory")
    world.attempt_events("restored")
    world.show_progress(2, 1, None, {})
    assert "snapshot 90 |" in out.getvalue(), out.getvalue()


def test_a_plain_scripts_start_up_does_not_show_the_runtimes_cadence(tmp_path: Path) -> None:
    from ckptrun.cli.supervision.runner import snapshot_line
    from ckptrun.cli.supervision.spec import LaunchSpec

    (tmp_path / "plain.py").write_text("import torch\nprint('training')\n")
    (tmp_path / "adopted.py").write_text("def main():\n    import ckptrun.runtime as ckr\n    ckr.init()\n")
    assert snapshot_line(LaunchSpec(script=tmp_path / "plain.py")) == (  # a module it imports may use the runtime
        "snapshots: none by ckptrun, unless a module the script imports uses ckptrun.runtime (the script itself does "
        "not import it; a restart relaunches the script, which resumes only if it loads its own checkpoint: its "
        "step count then says whether it did)")
    for script in (tmp_path / "adopted.py", None):  # None: the embedded default job
        assert snapshot_line(LaunchSpec(script=script, save_every_steps=5)) == "snapshots: every 5 steps"


# --- item 5: the global batch is what an optimizer step consumed -------------------------------------


def _accumulating_run(run_dir: Path, steps: int, by_hand: int) -> tuple[int, int, list[dict]]:
    """One in-process run of a tiny model over a tracked ckr.DataLoader (4 samples per batch), restoring its
    run dir's snapshot: ``by_hand`` 0 steps through ``run.batches`` (one batch per step), else the script's own
    loop takes ``by_hand`` batches and calls backward on each before one optimizer step. Returns the global
    step it restored, the global batch its final snapshot's cursor recorded, and its ``global_batch_changed`` events."""
    import torch

    import ckptrun.runtime as ckr
    from ckptrun.runtime.env import RunEnv
    from ckptrun.runtime.records import read_events
    from ckptrun.runtime.step.precision import Policy, resolve
    from ckptrun.runtime.step.session import Run
    from ckptrun.runtime.storage import store

    env = RunEnv(run_id="accumulation", run_dir=run_dir, precision="fp32", async_save=False, save_every_steps=2)
    run = Run(env, {}, Policy(resolve("fp32")))
    run.lineage = store.ensure_lineage(run.ckpt_dir, env.run_id).current  # as ckr.init does on rank 0
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 3), torch.randn(64, 1))
    loader = ckr.DataLoader(data, batch_size=4, shuffle=False)
    run.track(model=model, optimizer=optimizer, loader=loader)
    start = run.restore()

    def backward(batch: list) -> float:
        loss = torch.nn.functional.mse_loss(model(batch[0]), batch[1])
        loss.backward()
        return float(loss.detach())

    if not by_hand:
        for batch in run.batches(loader, steps=steps):
            backward(batch)
            optimizer.step()
            optimizer.zero_grad()
            run.end_step(0.0)
    else:
        batches = iter(loader)
        while run.step < steps:
            for _ in range(by_hand):  # the script's own accumulation: k batches, k backwards, one step
                backward(next(batches))
            optimizer.step()
            optimizer.zero_grad()
            run.end_step(0.0)
    run.finish()
    return start, loader.state_dict()["global_batch"], read_events(run_dir, "global_batch_changed")


def test_the_global_batch_is_what_a_step_consumed_however_the_script_accumulates(tmp_path: Path, capfd) -> None:
    assert _accumulating_run(tmp_path / "plain", steps=2, by_hand=0) == (0, 4, [])
    by_hand = _accumulating_run(tmp_path / "by-hand", steps=2, by_hand=2)
    assert by_hand == (0, 8, []), "two micro-batches per optimizer step: the recorded global batch doubles"
    resumed = _accumulating_run(tmp_path / "by-hand", steps=4, by_hand=2)
    assert resumed == (2, 8, []), "a resume that consumes what the snapshot recorded is no change"
    assert "global batch changed" not in capfd.readouterr().err
    start, halved, changed = _accumulating_run(tmp_path / "by-hand", steps=6, by_hand=1)
    assert (start, halved) == (4, 4)
    assert [(e["old_global_batch"], e["new_global_batch"], e["step"]) for e in changed] == [(8, 4, 4)]
    assert "the global batch changed from 8 to 4 samples per optimizer step at step 4" in capfd.readouterr().err
