"""What a lost node adds to the recovery estimate (``rto_nodes.node_loss``), on a real run's snapshot and records:
the node timeout, then a rejoin bounded by --node-join-timeout, or a hot spare's promotion and its first attempt
through the standby it kept warm (or, with --no-standby, a fresh agent) (issue 26 item 1). The fresh agent's no-op relaunch is passed in as a figure here; the
estimate's own run of it is covered end to end by bench/rto_accuracy.py's node-loss scenario."""

from __future__ import annotations

import pytest
from workers import run_job

from ckptrun.cli.recovery_budget import rto_components as components
from ckptrun.cli.recovery_budget import rto_nodes
from ckptrun.cli.recovery_budget.estimate import find_target
from ckptrun.cli.supervision.spares import POLL_S
from ckptrun.cli.supervision.spec import LaunchSpec


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> components.Target:
    run_dir = tmp_path_factory.mktemp("nodes") / "run"
    result = run_job(run_dir, args=("--steps", "6", "--num-workers", "0", "--hidden", "64"), save_every_steps=3)
    assert result.returncode == 0, result.stderr
    found = find_target(run_dir)
    found.spec = LaunchSpec(nnodes="2", heartbeat_timeout=60.0, node_join_timeout=120.0)
    return found


def with_events(target: components.Target, *extra: dict) -> components.Target:
    return components.Target(**{**target.__dict__, "events": [*target.events, *extra]})


def test_one_node_adds_nothing_and_a_rejoin_is_bounded_by_the_join_timeout(target: components.Target) -> None:
    alone = components.Target(**{**target.__dict__, "spec": LaunchSpec()})
    assert rto_nodes.node_loss(alone) is None
    lost = rto_nodes.node_loss(target, lambda: pytest.fail("no spare: nothing to time"))
    assert lost["detect_s"] == 30.0, "the node timeout: the heartbeat timeout, capped at 30 s"
    assert (lost["join"]["value_s"], lost["join"]["source"], lost["restart"]) == (120.0, "configured", None)


def test_a_spare_is_its_promotion_and_then_a_warm_restart_through_the_standby_it_kept(target: components.Target) -> None:
    spared = with_events(target, {"event": "spare_joined", "spare": 1})
    lost = rto_nodes.node_loss(spared, lambda: pytest.fail("the spare's standby: the restart's own estimate"))
    assert lost["join"]["value_s"] == POLL_S and lost["restart"] is None


def test_without_a_standby_a_spare_is_its_promotion_and_a_first_attempt_through_a_fresh_agent(
        target: components.Target) -> None:
    spared = with_events(target, {"event": "spare_joined", "spare": 1})
    spared.spec = spared.spec.model_copy(update={"standby": False})
    lost = rto_nodes.node_loss(spared, lambda: 1.5)
    assert lost["join"]["value_s"] == POLL_S and "modelled" in lost["join"]["detail"]
    step, _ = components.setup_and_first_step(spared)
    # + the restore of a 6-step snapshot, measured again inside (well under a second)
    assert 1.5 + step < lost["restart"]["value_s"] < 1.5 + step + 1.0, lost["restart"]
    assert "fresh torchrun agent" in lost["restart"]["detail"] and lost["restart"]["source"] == "estimated"


def test_past_promotions_and_the_restarts_after_them_replace_the_model(target: components.Target) -> None:
    past = with_events(target, {"event": "spare_joined", "spare": 1},
                       {"event": "spare_promoted", "spare": 1, "node": 1, "joined_s": 0.3},
                       {"event": "restart", "node_join_s": 0.1, "lost_nodes": [], "relaunch_to_first_step_s": 0.6},
                       {"event": "restart", "node_join_s": 25.0, "lost_nodes": [1], "relaunch_to_first_step_s": 2.4})
    lost = rto_nodes.node_loss(past, lambda: pytest.fail("history: nothing to time"))
    assert (lost["join"]["value_s"], lost["join"]["source"]) == (0.3, "history")
    assert (lost["restart"]["value_s"], lost["restart"]["source"]) == (2.4, "history"), \
        "only the restart that replaced a lost node counts"
