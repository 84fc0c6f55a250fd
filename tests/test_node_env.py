"""A node's place in a multi-node job: flags over torchrun's PET_* over Slurm's environment (tables, no processes)."""

from __future__ import annotations

import pytest

from ckptrun.cli.errors import CkptrunError
from ckptrun.cli.supervision.node_env import expand_hostlist, node_settings, split_endpoint

SLURM = {"SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "node[01-04],gpu7", "SLURM_JOB_ID": "81234"}
PET = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_RDZV_ENDPOINT": "trainer-master-0:23456", "PET_RDZV_BACKEND": "c10d",
       "PET_RDZV_ID": "pytorchjob-7"}
NONE = {"nnodes": None, "node_rank": None, "rdzv_endpoint": None, "rdzv_backend": None, "master_addr": None,
        "master_port": None, "name": None, "coord_port": None}


@pytest.mark.parametrize("hostlist, hosts", [
    ("node01", ["node01"]),
    ("node[01-04],gpu7", ["node01", "node02", "node03", "node04", "gpu7"]),
    ("gpu[9-11]", ["gpu9", "gpu10", "gpu11"]),
    ("a[1,3-4]b", ["a1b", "a3b", "a4b"]),
    ("rack[1-2]-n[07-08]", ["rack1-n07", "rack1-n08", "rack2-n07", "rack2-n08"]),
    ("x1,x2", ["x1", "x2"]),
])
def test_slurm_hostlists_expand_without_scontrol(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist", ["node[01-04", "node[a-b]"])
def test_a_bad_hostlist_names_the_fix(hostlist: str) -> None:
    with pytest.raises(CkptrunError, match="SLURM_JOB_NODELIST") as error:
        expand_hostlist(hostlist)
    assert "--rdzv-endpoint" in (error.value.hint or "")


@pytest.mark.parametrize("endpoint, expected", [
    ("node01:29500", ("node01", 29500)), ("node01", ("node01", 29500)), ("[::1]:1234", ("::1", 1234)),
    ("10.0.0.1:7", ("10.0.0.1", 7)),
])
def test_endpoints_split(endpoint: str, expected: tuple[str, int]) -> None:
    assert split_endpoint(endpoint) == expected


def test_slurm_environment_alone() -> None:
    settings = node_settings(NONE, SLURM)
    assert (settings.nnodes, settings.node_rank, settings.rdzv_endpoint, settings.job_id) == \
        ("4", 2, "node01:29500", "slurm-81234")
    assert settings.multi_node and not settings.leader
    assert settings.store_port == 29501 and settings.sources["node_rank"] == "SLURM_*"


def test_the_slurm_environment_gives_the_same_launch_as_explicit_flags() -> None:
    flags = {**NONE, "nnodes": "4", "node_rank": 2, "rdzv_endpoint": "node01:29500", "name": "slurm-81234"}
    from_flags, from_slurm = node_settings(flags, {}), node_settings(NONE, SLURM)
    assert (from_flags.nnodes, from_flags.node_rank, from_flags.rdzv_endpoint, from_flags.job_id, from_flags.store_port) == \
        (from_slurm.nnodes, from_slurm.node_rank, from_slurm.rdzv_endpoint, from_slurm.job_id, from_slurm.store_port)


def test_kubeflow_pet_variables_beat_slurm() -> None:
    settings = node_settings(NONE, {**SLURM, **PET})
    assert (settings.nnodes, settings.node_rank, settings.rdzv_endpoint, settings.job_id) == \
        ("2", 1, "trainer-master-0:23456", "pytorchjob-7")
    assert settings.sources["rdzv_endpoint"] == "PET_*"


def test_pet_master_addr_and_port_make_the_endpoint() -> None:
    environ = {"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456"}
    settings = node_settings({**NONE, "name": "job"}, environ)
    assert settings.rdzv_endpoint == "job-master-0:23456" and settings.leader and settings.store_port == 23457


def test_flags_beat_everything() -> None:
    flags = {**NONE, "nnodes": "1:2", "node_rank": 0, "rdzv_endpoint": "127.0.0.1:4000", "name": "mine", "coord_port": 4100}
    settings = node_settings(flags, {**SLURM, **PET})
    assert (settings.nnodes, settings.min_nodes, settings.max_nodes, settings.node_rank) == ("1:2", 1, 2, 0)
    assert (settings.rdzv_endpoint, settings.job_id, settings.store_port) == ("127.0.0.1:4000", "mine", 4100)
    assert {settings.sources[key] for key in ("nnodes", "node_rank", "rdzv_endpoint", "job_id")} == {"flag"}


def test_one_node_needs_nothing() -> None:
    settings = node_settings(NONE, {})
    assert not settings.multi_node and settings.leader and settings.rdzv_endpoint is None


@pytest.mark.parametrize("flags, environ, words", [
    ({"nnodes": "2", "name": "x"}, {}, "--rdzv-endpoint"),
    ({"nnodes": "2", "node_rank": 2, "rdzv_endpoint": "h:1", "name": "x"}, {}, "--node-rank 2"),
    ({"nnodes": "2", "rdzv_endpoint": "h:1"}, {}, "--name"),
    ({"nnodes": "3:2"}, {}, "MIN:MAX"),
    ({"nnodes": "two"}, {}, "--nnodes two"),
    ({"nnodes": "2", "rdzv_endpoint": "h:1", "name": "x", "rdzv_backend": "etcd"}, {}, "c10d"),
    ({"nnodes": "2", "rdzv_endpoint": "h:100", "name": "x", "coord_port": 100}, {}, "--coord-port"),
    ({}, {"SLURM_NNODES": "2", "SLURM_NODEID": "x1", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "5"}, "SLURM_*"),
])
def test_what_cannot_form_a_job_is_one_line(flags: dict, environ: dict, words: str) -> None:
    with pytest.raises(CkptrunError) as error:
        node_settings({**NONE, **flags}, environ)
    assert words in error.value.message + (error.value.hint or "")
    assert error.value.exit_code == 2


def test_the_slurm_template_is_a_valid_script_with_the_requeue_contract() -> None:
    import subprocess
    from importlib.resources import files

    text = files("ckptrun.templates").joinpath("slurm.sbatch").read_text()
    for line in ("#SBATCH --signal=USR1@90", "#SBATCH --requeue", "--stop-signal SIGUSR1", 'scontrol requeue "$SLURM_JOB_ID"',
                 '--nnodes "$SLURM_NNODES"', "EXIT_REQUEUE=5", "srun --ntasks-per-node=1"):
        assert line in text, line
    assert subprocess.run(["bash", "-n", "-c", text]).returncode == 0


@pytest.mark.parametrize("code, requeued", [(0, False), (1, False), (3, True), (5, True)])
def test_init_writes_an_sbatch_that_requeues_on_a_resumable_exit(tmp_path, code: int, requeued: bool) -> None:
    """`ckptrun init --template slurm`, then the script run with a fake srun (exits ``code``) and scontrol."""
    import os
    import subprocess
    import sys

    made = subprocess.run([sys.executable, "-m", "ckptrun.cli.main", "init", str(tmp_path / "job"), "--template", "slurm"],
                          capture_output=True, text=True)
    assert made.returncode == 0 and made.stdout.splitlines()[-1] == "sbatch slurm.sbatch", made.stderr
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/bash\necho "$@" > "{tmp_path}/srun.args"\nexit {code}\n')
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" > "{tmp_path}/scontrol.args"\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_NNODES": "2"}
    done = subprocess.run(["bash", "slurm.sbatch"], cwd=tmp_path / "job", env=env, capture_output=True, text=True)
    assert done.returncode == code, done.stderr
    args = (tmp_path / "srun.args").read_text()
    assert "launch --config ckptrun.toml --run-dir runs/slurm-77 --name slurm-77" in args and "--nnodes 2" in args
    assert (tmp_path / "scontrol.args").exists() == requeued
    if requeued:
        assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "77"]


def test_stop_on_any_node_finds_the_launchers_of_a_many_node_run(tmp_path) -> None:
    """`ckptrun stop` with per-node holder files (nodes/node-K/supervisor.json): the live ones on this host."""
    import json
    import os
    import socket
    import subprocess
    import sys

    import psutil

    run = tmp_path / "runs" / "job"
    (run / "nodes" / "node-0").mkdir(parents=True)
    (run / "nodes" / "node-1").mkdir(parents=True)
    (run / "run.json").write_text("{}")
    me = psutil.Process()
    for node in (0, 1):
        holder = {"pid": me.pid, "start_time": me.create_time(), "host": socket.gethostname(), "argv": []}
        (run / "nodes" / f"node-{node}" / "supervisor.json").write_text(json.dumps(holder))
    done = subprocess.run([sys.executable, "-m", "ckptrun.cli.main", "stop", str(run), "--no-wait"],
                          capture_output=True, text=True, env=os.environ)
    assert done.returncode == 0, done.stderr
    assert (run / "stop").exists() and f"{me.pid}, {me.pid}" in done.stderr
    gone = tmp_path / "runs" / "gone"
    (gone / "nodes" / "node-0").mkdir(parents=True)
    (gone / "run.json").write_text("{}")
    (gone / "nodes" / "node-0" / "supervisor.json").write_text(json.dumps({"pid": 1, "start_time": 0.0}))
    refused = subprocess.run([sys.executable, "-m", "ckptrun.cli.main", "stop", str(gone)], capture_output=True, text=True)
    assert refused.returncode == 2 and "no supervisor is running" in refused.stderr


def test_resume_takes_the_runs_job_and_this_nodes_rank_from_the_environment() -> None:
    """After a Slurm requeue the job may land on other hosts: the environment's endpoint wins over run.json's."""
    from ckptrun.cli.supervision.node_env import resume_settings
    from ckptrun.cli.supervision.spec import build_spec

    spec = build_spec({"nnodes": "2", "rdzv_endpoint": "old-host:29500", "name": "slurm-9"})
    settings = resume_settings(spec, None, {"SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_NNODES": "2"})
    assert (settings.node_rank, settings.rdzv_endpoint, settings.job_id, settings.max_nodes) == (1, "gpu03:29500", "slurm-9", 2)
    assert resume_settings(spec, 0, {}).rdzv_endpoint == "old-host:29500"


def test_one_node_launch_refuses_many_nodes_where_only_one_launcher_runs(tmp_path) -> None:
    """`preflight` (and any one-launcher path) says how to run a many-node job instead of hanging in torchrun."""
    from ckptrun.cli.supervision.runner import start_run
    from ckptrun.cli.supervision.spec import build_spec

    with pytest.raises(CkptrunError) as error:
        start_run(build_spec({"nnodes": "2", "run_dir": tmp_path / "r"}), argv=[], estimator=None)  # type: ignore[arg-type]
    assert "--node-rank" in (error.value.hint or "") and not (tmp_path / "r").exists()


def test_a_local_cache_on_many_nodes_is_each_nodes_own_and_snapshots_stage_in_the_shared_run_dir(tmp_path) -> None:
    """Issue 25 item 4 (it was refused): with --nnodes 2, --local-cache is this node's cache of its ranks' files
    (contract C1's node_cache_dir) and the snapshot stages in RUN_DIR/staging, which every node shares; on one
    node it stays the run's local snapshot dir."""
    from ckptrun.cli.supervision.runner import ckpt_dir_of
    from ckptrun.cli.supervision.spec import build_spec

    many = build_spec({"ckpt_dir": "memory://bucket/run", "cache_dir": tmp_path / "cache", "nnodes": "2"})
    assert (many.node_cache_dir, many.local_cache_dir) == (tmp_path / "cache", None)
    assert ckpt_dir_of(many, tmp_path / "run") == tmp_path / "run" / "staging"
    policy = many.worker_policy()
    assert (policy["node_cache_dir"], policy["local_cache"]) == (tmp_path / "cache", False)
    one = build_spec({"ckpt_dir": "memory://bucket/run", "cache_dir": tmp_path / "cache"})
    assert (one.node_cache_dir, one.local_cache_dir, ckpt_dir_of(one, tmp_path / "run")) == \
        (None, tmp_path / "cache", tmp_path / "cache")
    assert (one.worker_policy()["node_cache_dir"], one.worker_policy()["local_cache"]) == (None, True)


def test_each_node_keeps_its_own_cache_and_group_and_a_resume_finds_them_recorded(tmp_path) -> None:
    """Issue 25 items 2 and 4: a node's --local-cache and --node-group are its own (the leader's run.json holds
    the leader's); the group defaults to the leaf switch of Slurm's topology address; a resume, which takes
    neither flag, reads what the node's launch recorded."""
    from ckptrun.cli.supervision.many_nodes import _own_choices, topology_group
    from ckptrun.cli.supervision.node_world import NodePaths
    from ckptrun.cli.supervision.spec import build_spec

    assert topology_group({"SLURM_TOPOLOGY_ADDR": "s0.s3.node17"}) == "s0.s3"
    assert topology_group({"SLURM_TOPOLOGY_ADDR": "node17"}) is None and topology_group({}) is None
    paths = NodePaths(tmp_path / "run", node=1)
    paths.node_dir.mkdir(parents=True)
    none = {"cache_dir": None, "node_group": None}
    assert _own_choices(paths, None, none) == none, "a resume of a node that recorded nothing"
    own = build_spec({"ckpt_dir": "memory://bucket/run", "cache_dir": tmp_path / "disk1", "nnodes": "2",
                      "node_group": "rack-b"})
    launched = _own_choices(paths, own, none)
    assert launched == {"cache_dir": str((tmp_path / "disk1").resolve()), "node_group": "rack-b"}
    assert _own_choices(paths, None, none) == launched
