"""Every ``DDPPIPE_*`` environment variable: the one place that names them.

A slot's facts reach its processes through one file, the slot record
(:mod:`ddppipe.core.slot`), that :data:`SLOT` points at (and :data:`SLOT_LAUNCHER` names whose
it must be: a node that reads another, or none, does not see the run's state folder). The
others cross into a process that no record reaches first:

- :data:`WARM_SOCKET`, :data:`WARM_SERVER`: the warm server (ddppipe.launching.warm) of a
  Snakemake call or a packed allocation's node, for every command started there;
- :data:`WARM_CHILD`: set in a command the warm server forked (it runs, no delegating);
- :data:`UNDER_AGENT`, :data:`AGENT_MARKS`: set by ``ddppipe agent`` for the workers torchrun
  starts (the second: its start-up's clock readings);
- :data:`HANG_TIMEOUT`, :data:`RUN_NODES`: ``launch.hang_timeout_s`` and ``launch.nnodes``, set
  by the launcher for the nodes' agents, which judge their ranks' progress by the allowances
  they give (ddppipe.training.measuring.node_summary);
- :data:`PACKED_SLOT`, :data:`ALLOCATION_END`, :data:`PLACEMENT`: set by a packed
  allocation's node worker (ddppipe.packing.worker) for a trial's launcher.
"""

from __future__ import annotations

SLOT = "DDPPIPE_SLOT"  # the slot record's file (set by the launcher for every process)
SLOT_LAUNCHER = "DDPPIPE_SLOT_LAUNCHER"  # whose record it must be: a node's check that it sees it
WARM_SOCKET = "DDPPIPE_WARM_SOCKET"  # the warm server's Unix socket
WARM_SERVER = "DDPPIPE_WARM_SERVER"  # the server's pid: while it starts, launchers wait for it
WARM_CHILD = "DDPPIPE_WARM_CHILD"  # a command the server forked: it runs, no delegating
UNDER_AGENT = "DDPPIPE_UNDER_AGENT"  # workers that stop on a signal exit 0 (launching.agent)
PACKED_SLOT = "DDPPIPE_PACKED_SLOT"  # a packed trial's "<allocation> <node>/<k>"
ALLOCATION_END = "DDPPIPE_ALLOCATION_END"  # a packed trial's "<warning> <end>", Unix times
AGENT_MARKS = "DDPPIPE_AGENT_MARKS"  # a node's agent's start-up marks, JSON (core.process_times)
PLACEMENT = "DDPPIPE_PLACEMENT"  # a packed multi-node trial's nodes (ddppipe.slurm.placement)
HANG_TIMEOUT = "DDPPIPE_HANG_TIMEOUT_S"  # launch.hang_timeout_s, for the nodes' agents
RUN_NODES = "DDPPIPE_RUN_NODES"  # launch.nnodes, for the nodes' agents (start-up's allowance)
