"""What one save of a DDP run's checkpoint costs at a given size, without running it: the
files written (the job's, the busiest node's), the ranks that write the model's and
optimizer's state, and the host memory that holds the state's copy on each node
(:class:`ddppipe.training.checkpoints.sharded_checkpoint.Store` with ``replicated``: rank 0
alone copies and writes the tensors, every rank writes its own RNG streams). For a scale
model (``bench/``) and the docs' figures.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddppipe.training.checkpoints import sharded_checkpoint

# What rank 0 writes besides its RNG streams: DCP's tensor file and metadata, the non-tensor
# state and the commit marker.
RANK0_FILES = ("__0_0.distcp", ".metadata", sharded_checkpoint.STATE, sharded_checkpoint.COMMITTED)


@dataclass(frozen=True)
class SavePlan:
    """One save's files and host memory."""

    files: int  # written by the whole job
    busiest_node_files: int  # by node 0 (rank 0's node)
    writers: int  # ranks that write the model's and optimizer's state
    pinned_bytes_node_0: int  # host memory holding the state's copy on node 0
    pinned_bytes_other_nodes: int  # on each other node


def ddp(nodes: int, ranks_per_node: int, state_bytes: int) -> SavePlan:
    """A DDP save at ``nodes`` x ``ranks_per_node`` of a model and optimizer of
    ``state_bytes``."""
    if nodes < 1 or ranks_per_node < 1 or state_bytes < 0:
        raise ValueError(f"no such run: {nodes} nodes x {ranks_per_node} ranks, "
                         f"{state_bytes} bytes of state")  # fmt: skip
    streams = nodes * ranks_per_node  # one file a rank
    return SavePlan(
        files=streams + len(RANK0_FILES),
        busiest_node_files=ranks_per_node + len(RANK0_FILES),
        writers=1,
        pinned_bytes_node_0=state_bytes,
        pinned_bytes_other_nodes=0,
    )
