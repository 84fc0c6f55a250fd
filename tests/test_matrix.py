"""The scenario matrix (issue 38): its cover is checked here, and a few of its cells run, chosen from the commit.

`make matrix` runs the whole cover (bench/matrix.py, about an hour on 2 cores); the suite runs a sample within
a small budget, different on each commit (``MATRIX_SEED`` picks another), so successive landings walk it.
How to add an axis value: tests/matrix.py's docstring.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import matrix
from matrix import AXES, HARDEST, Cell
from matrix_cells import Harness, expect, run_cell

SAMPLE_BUDGET_S = 60  # estimated seconds of cells per suite run (matrix.cost), besides their reference runs


def test_the_cover_holds_every_pair_of_axis_values_that_some_cell_can_and_the_hardest_triples():
    cells = matrix.cover()
    assert set(HARDEST) <= set(cells) and len(set(cells)) == len(cells)
    covered = set().union(*(matrix.pairs_of(cell) for cell in cells))
    assert matrix.coverable_pairs() <= covered
    assert all(matrix.not_applicable(cell) is None for cell in cells)
    for axis, values in AXES.items():  # every value of every axis is in some cell that runs
        assert {getattr(cell, axis) for cell in cells} == set(values), axis


def test_every_pair_no_cell_can_hold_says_why():
    reasons = matrix.uncoverable_pairs()
    assert reasons and all(reason for reason in reasons.values())
    pair = (("topology", "1x1"), ("fault", "lose-node"))
    assert reasons[pair] == "lose-node needs more than one node"
    assert (("tier", "memory"), ("state", "ddp")) not in reasons


@pytest.mark.parametrize("text, problem", [("2x2/fsdp2/memory/kill", None), ("2x2/fsdp2/memory", "topology/state/tier/fault"),
                                           ("3x3/ddp/local/kill", "topology: 1x1")])
def test_a_cell_is_named_topology_state_tier_fault(text, problem):
    if problem is None:
        assert Cell.parse(text) == Cell("2x2", "fsdp2", "memory", "kill") and Cell.parse(text).name == text
        return
    with pytest.raises(ValueError, match=problem):
        Cell.parse(text)


def test_the_sample_follows_the_seed_and_stays_within_its_budget():
    cells = matrix.cover()
    one, same, other = (matrix.sample(cells, seed, 120) for seed in ("a1b2c3", "a1b2c3", "d4e5f6"))
    assert one == same and one != other
    assert sum(matrix.cost(cell) for cell in one) <= 120 and one


def test_what_each_fault_ends_with_is_the_readmes_exit_code():
    assert expect(Cell("1x2", "ddp", "local", "recurring-blowup")).first == (4,)
    assert expect(Cell("2x2", "ddp", "local", "leader-loss")).first == (-9, 5)
    assert expect(Cell("2x1", "ddp", "s3", "stop-resume")) .final == (0, 0)
    assert expect(Cell("1x1", "ddp", "local", "disk-full")).first == (1,)
    assert not expect(Cell("1x2", "ddp", "local", "one-off-blowup")).exact  # the rollback lowers the rate
    assert expect(Cell("2x2", "fsdp2", "memory-replica", "lose-node")).exact


def _seed() -> str:
    if os.environ.get("MATRIX_SEED"):
        return os.environ["MATRIX_SEED"]
    found = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True)
    return found.stdout.strip() or "no-commit"


SAMPLE = matrix.sample(matrix.cover(), _seed(), SAMPLE_BUDGET_S)


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory):
    made = Harness(tmp_path_factory.mktemp("matrix"), start_s3=lambda: _start_s3(made.root))
    yield made
    if made.s3 is not None:
        made.s3.stop()


def _start_s3(root: Path):  # type: ignore[no-untyped-def]
    from s3_server import start_server

    return start_server(root / "moto.log")


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cell", SAMPLE, ids=[cell.name for cell in SAMPLE])
def test_a_sample_of_the_matrix_chosen_from_the_commit(cell: Cell, harness: Harness) -> None:
    verdict = run_cell(cell, harness)
    assert verdict.verdict == "PASS", f"{cell.name}: {verdict.reason}"
