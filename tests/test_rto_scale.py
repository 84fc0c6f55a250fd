"""Issue 26 item 3: `estimate-rto --nodes N` projects the measured budget to a size this machine is not.

The projection is arithmetic over measured figures (table-tested here against each part's documented model)
and one real command on a real run directory, whose projected parts are marked measured or modelled.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptrun.cli.recovery_budget import rto_scale
from ckptrun.cli.recovery_budget.rto_model import daly, goodput
from ckptrun.runtime.checkpoint.verified_read import HASH_THREADS
from workers import run_job

GB = 10**9


@pytest.mark.parametrize("text, count", [("1.1T", 1_100_000_000_000), ("500GB", 500 * GB), ("64GiB", 64 * 2**30),
                                          ("123456", 123456), ("2.5 mb", 2_500_000), ("1k", 1000)])
def test_sizes_read_as_people_write_them(text: str, count: int) -> None:
    assert rto_scale.parse_size(text) == count


@pytest.mark.parametrize("text", ["", "lots", "1.1X", "-3G", "G"])
def test_a_size_that_is_not_one_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        rto_scale.parse_size(text)


def _measured(stall_s: float = 0.02, persist_s: float = 0.1) -> dict:
    """A measured report as build_report writes it: 2 ranks, 1 GB, whole-file digests verified in 0.5 s."""
    return {
        "snapshot": {"bytes": GB, "world_size": 2},
        "components": {
            "detect": {"value_s": 0.25, "source": "history", "detail": "crash: median; hang: ..."},
            "teardown": {"value_s": 0.3, "source": "history", "detail": "median"},
            "verify": {"value_s": 0.5, "source": "measured", "detail": "whole", "rule": "whole-file-digests"},
            "backoff": {"value_s": 0.0, "source": "configured", "detail": "none"},
            "restart": {"value_s": 1.5, "source": "history", "detail": "median"},
            "lost_work": {"value_s": 0.1, "source": "history", "detail": "", "stall_s": stall_s, "persist_s": persist_s},
        },
    }


RESTORE = {"restore_s": 0.5, "read_bytes_per_s": 2 * GB, "hash_bytes_per_s_per_thread": 0.5 * GB}


@pytest.mark.parametrize("nodes", [8, 64, 1024])
def test_each_part_follows_its_model(nodes: int) -> None:
    """Node-local parts stay as measured; the leader's decisions grow with N and the process-group start-up
    with N·G store round trips; restore and verify are each node's share at the rates measured; the save
    scales with the bytes per rank; the MTBF is the node's ÷ N, and Daly and goodput follow from them."""
    state, gpus, trip, cpus = 100 * GB, 8, 50e-6, 16
    p = rto_scale.project(_measured(), RESTORE, nodes, gpus, state, 365 * 86400.0, trip, cpus=cpus)
    parts, per_node, ranks = p["components"], state / nodes, nodes * gpus
    assert {name: c["mark"] for name, c in parts.items()} == {
        "detect": "measured", "teardown": "modelled", "verify": "modelled", "backoff": "configured", "restart": "modelled"}
    assert parts["detect"]["value_s"] == 0.25
    assert parts["teardown"]["value_s"] == pytest.approx(0.3 + 3 * nodes * trip)  # three hops, each woken by its key
    assert parts["verify"]["value_s"] == pytest.approx(0.5 * per_node / GB)
    threads = min(cpus, gpus * HASH_THREADS)
    restore = max(per_node / (2 * GB), per_node / (0.5 * GB * threads))
    assert parts["restart"]["value_s"] == pytest.approx(1.5 - 0.5 + restore + 2 * ranks * trip + nodes * trip)
    assert p["rto_s"] == pytest.approx(sum(c["value_s"] for c in parts.values()))
    scale = (state / ranks) / (GB / 2)
    assert (p["save"]["stall_s"], p["save"]["persist_s"]) == (pytest.approx(0.02 * scale), pytest.approx(0.1 * scale))
    assert p["mtbf_s"] == pytest.approx(365 * 86400.0 / nodes)
    assert p["daly_interval_s"] == pytest.approx(daly(p["save"]["stall_s"], p["mtbf_s"]))
    assert p["goodput"] == pytest.approx(goodput(p["daly_interval_s"], p["save"]["stall_s"], p["save"]["persist_s"],
                                                 p["rto_s"], p["mtbf_s"]))
    assert (p["ranks"], p["bytes_per_node"], p["bytes_per_rank"]) == (ranks, per_node, state / ranks)


def test_more_nodes_for_the_same_state_restore_faster_but_decide_slower() -> None:
    small, large = (rto_scale.project(_measured(), RESTORE, n, 8, 1000 * GB, None, 50e-6, cpus=16) for n in (64, 1024))
    assert large["components"]["teardown"]["value_s"] > small["components"]["teardown"]["value_s"]
    assert large["components"]["verify"]["value_s"] < small["components"]["verify"]["value_s"]
    assert large["mtbf_s"] is None and large["goodput"] is None and large["daly_interval_s"] is None


def test_a_manifest_and_sizes_check_is_measured_as_it_is() -> None:
    measured = _measured()
    measured["components"]["verify"].update(rule="manifest-and-sizes", value_s=0.004)
    p = rto_scale.project(measured, RESTORE, 1024, 8, 1000 * GB, None, 50e-6, cpus=16)
    assert p["components"]["verify"] == {**p["components"]["verify"], "value_s": 0.004, "mark": "measured"}


# --- the command -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("scale") / "run"
    assert run_job(run_dir, args=("--steps", "12", "--num-workers", "0", "--hidden", "64"), save_every_steps=5).returncode == 0
    return run_dir


def _estimate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptrun.cli.main", "estimate-rto", *args], capture_output=True,
                          text=True, timeout=180)


@pytest.mark.timeout(240)
def test_estimate_rto_projects_a_real_run_to_1024_nodes(trained: Path) -> None:
    result = _estimate(str(trained), "--nodes", "1024", "--gpus-per-node", "8", "--state-bytes", "1.1T",
                       "--mtbf-per-node", "1000d", "--json")
    assert result.returncode == 0, result.stderr
    p = json.loads(result.stdout)["projection"]
    assert (p["nodes"], p["ranks"], p["state_bytes"]) == (1024, 8192, 1_100_000_000_000)
    assert set(p["components"]) == {"detect", "teardown", "verify", "backoff", "restart"}
    assert all(c["mark"] in ("measured", "modelled", "configured") and c["value_s"] is not None and c["how"]
               for c in p["components"].values())
    assert p["components"]["restart"]["mark"] == "modelled" and p["store_round_trip_s"] > 0
    assert p["rto_s"] == pytest.approx(sum(c["value_s"] for c in p["components"].values()))
    assert p["mtbf_s"] == pytest.approx(1000 * 86400 / 1024) and 0 < p["goodput"] < 1
    text = _estimate(str(trained), "--nodes", "64", "--state-bytes", "100GB")
    assert text.returncode == 0 and "projected to 64 nodes × 8 ranks" in text.stdout, text.stderr


@pytest.mark.parametrize("args, words", [(("--state-bytes", "1T"), "they need --nodes"),
                                         (("--nodes", "4", "--state-bytes", "lots"), "--state-bytes 'lots' is not a size"),
                                         (("--nodes", "4", "--mtbf-per-node", "soon"), "--mtbf-per-node")])
def test_bad_scale_flags_are_refused_in_one_line(trained: Path, args: tuple[str, ...], words: str) -> None:
    result = _estimate(str(trained), *args)
    assert result.returncode == 2 and words in result.stderr and "Traceback" not in result.stderr, result.stderr
