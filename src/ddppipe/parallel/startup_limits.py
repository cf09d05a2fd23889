"""How long a run's start-up may take at its size, and how often torchrun's rendezvous keeps
itself alive: limits that grow with the nodes.

What a slot's start does grows with its nodes: srun starts an agent on each, each imports
torch from a shared file system, the rendezvous waits for the last agent, the process group's
store on node 0 serves every rank, the gloo groups connect every rank. A fixed limit right for
a few nodes fails a large run that is only slow to start (``ddppipe preflight``'s first, near
100 nodes). So each limit is its bound at one node plus a share per node (one more second for
every so many nodes), the same at 1 node as before.

torchrun's rendezvous keep-alive rewrites the rendezvous' whole state (a record per node) in
the store every interval, from every node's agent: its store traffic grows as the nodes
squared. The interval grows with the nodes (a second for every 32, never under torch's 5 s),
keeping that traffic linear in them; torch declares a node dead after 3 intervals without its
keep-alive.
"""

from __future__ import annotations

# (seconds at one node, nodes per extra second)
START_UP = (600, 2)  # the hang watchdog's start-up allowance
JOIN = (120, 4)  # torchrun's rendezvous join timeout
PREFLIGHT_STEP = (90, 2)  # each of ``ddppipe preflight``'s srun steps
PREFLIGHT_JOIN = (30, 8)  # the preflight all-reduce's rendezvous and process group
KEEP_ALIVE = (5, 32)  # torch's keep-alive interval (its default), or a second every 32 nodes


def _grown(limit: tuple[int, int], nodes: int) -> int:
    if nodes < 1:
        raise ValueError(f"a run has at least one node, not {nodes}")
    base, nodes_a_second = limit
    return base + nodes // nodes_a_second


def start_up_s(nodes: int) -> int:
    """The start-up phase's allowance (the hang watchdog's) of a run on ``nodes`` nodes."""
    return _grown(START_UP, nodes)


def join_timeout_s(nodes: int) -> int:
    """torchrun's rendezvous join timeout for ``nodes`` nodes."""
    return _grown(JOIN, nodes)


def preflight_step_s(nodes: int) -> int:
    """How long each of ``ddppipe preflight``'s srun steps may take on ``nodes`` nodes."""
    return _grown(PREFLIGHT_STEP, nodes)


def preflight_join_s(nodes: int) -> int:
    """The preflight all-reduce's join timeout (rendezvous and process group), ``nodes``."""
    return _grown(PREFLIGHT_JOIN, nodes)


def keep_alive_s(nodes: int) -> int:
    """torchrun's rendezvous keep-alive interval for ``nodes`` nodes."""
    least, nodes_a_second = KEEP_ALIVE
    return max(least, _grown((0, nodes_a_second), nodes))
