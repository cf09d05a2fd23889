"""What the partition's nodes have (``sinfo``): their memory, read once a process, so that a
job's ``--mem`` fits them (:func:`ddppipe.slurm.memory_request.node_request_mb`)."""

from __future__ import annotations

import functools
import logging
import subprocess

from ddppipe.slurm.runner import run

log = logging.getLogger(__name__)

# One line a node and partition: name, partition (the default one marked "*"), memory in MB
# (RealMemory; "+" where sinfo groups nodes of more).
NODE_FORMAT = "%N %P %m"


def parse_node_memory(text: str, partition: str | None) -> dict[str, int]:
    """Each node's memory (MB) in ``sinfo --Node --noheader --format=NODE_FORMAT`` output,
    of ``partition`` (None: the default partition, the one sinfo marks with "*")."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 3 or not fields[2].rstrip("+").isdigit():
            continue
        node, part, memory = fields
        if (part.rstrip("*") == partition) if partition else part.endswith("*"):
            found[node] = int(memory.rstrip("+"))
    return found


@functools.cache
def node_memory(partition: str | None) -> dict[str, int]:
    """Each node's memory (MB) in ``partition`` (None: the default one), asked once a
    process; empty when sinfo cannot say (no SLURM here: nothing is checked then)."""
    argv = ["sinfo", "--Node", "--noheader", f"--format={NODE_FORMAT}"]
    try:
        done = run([*argv, *([f"--partition={partition}"] if partition else [])], check=True)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("sinfo failed (%s): memory requests are not checked against the nodes", e)
        return {}
    return parse_node_memory(done.stdout, partition)


def memory_mb(nodes: dict[str, int], count: int) -> int | None:
    """The memory (MB) that ``count`` of ``nodes`` have at least (a job of ``count`` nodes
    fits them up to it); None when none is known."""
    largest_first = sorted(nodes.values(), reverse=True)
    return largest_first[min(count, len(largest_first)) - 1] if largest_first else None
