"""Start-up's limits grow with the nodes (:mod:`ddppipe.parallel.startup_limits`): the hang
watchdog's start-up allowance (and the process group's timeout above it), torchrun's join
timeout and keep-alive interval, ``ddppipe preflight``'s limits."""

import pytest

from ddppipe.parallel import startup_limits
from ddppipe.settings import run_spec
from ddppipe.slurm import request as slurm_request
from ddppipe.training.measuring import allowances
from tests.tiny import default_config

SIZES = [  # nodes: start-up, join, keep-alive, preflight step, preflight join, collectives
    (1, 600, 120, 5, 90, 30, 1200),
    (64, 632, 136, 5, 122, 38, 1200),
    (512, 856, 248, 16, 346, 94, 1200),
    (2048, 1624, 632, 64, 1114, 286, 1924),
]


@pytest.mark.parametrize(
    ("nodes", "start_up", "join", "keep_alive", "step", "preflight_join", "collectives"), SIZES
)
def test_the_start_up_limits_at_each_size(
    nodes: int, start_up: int, join: int, keep_alive: int, step: int, preflight_join: int,
    collectives: int,
) -> None:  # fmt: skip
    assert startup_limits.start_up_s(nodes) == start_up
    assert allowances.allowance("auto", "start-up", None, nodes=nodes).seconds == start_up
    assert allowances.allowance(300, "data", None, nodes=nodes).seconds == 900  # (not grown)
    # a number in hang_timeout_s: the collectives wait past every allowance, and the naming
    assert allowances.collective_timeout_s(300, nodes) == collectives
    assert startup_limits.join_timeout_s(nodes) == join
    assert startup_limits.keep_alive_s(nodes) == keep_alive
    assert startup_limits.preflight_step_s(nodes) == step
    assert startup_limits.preflight_join_s(nodes) == preflight_join
    cfg = default_config()
    cfg["launch"]["nnodes"] = nodes
    cfg["train"]["batch_size"] = 2 * 2048  # (divisible by every world here)
    request = slurm_request.Request.from_spec(run_spec.resolve(cfg, gpus=False))
    conf = f"--rdzv-conf=join_timeout={join},keep_alive_interval={keep_alive}"
    assert conf in request.torchrun_args("1234")
    assert f"--rdzv-conf=join_timeout=30,keep_alive_interval={keep_alive}" in (
        request.torchrun_args("1234", join_timeout_s=30)
    )


def test_a_run_without_nodes_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one node, not 0"):
        startup_limits.start_up_s(0)
