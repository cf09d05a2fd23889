"""A slot's outcome: its kind and variable part, and the labels of earlier records read back."""

import pytest

from ddppipe.runstate import outcomes
from ddppipe.runstate.outcomes import Kind, Outcome, OutcomeError

LABELS = [  # every label a record of this version or an earlier one may hold
    ("running", Kind.RUNNING, ""),
    ("completed", Kind.COMPLETED, ""),
    ("time limit", Kind.TIME_LIMIT, ""),
    ("stopped on SIGTERM", Kind.STOPPED, "SIGTERM"),
    ("stopped on a signal", Kind.STOPPED, "a signal"),
    ("stopped on SIGUSR1 (cause unknown: scontrol show job failed)", Kind.STOPPED,
     "SIGUSR1 (cause unknown: scontrol show job failed)"),
    ("preempted", Kind.PREEMPTED, ""),
    ("node failure", Kind.NODE_FAILURE, ""),
    ("requeued by SLURM", Kind.REQUEUED_BY_SLURM, ""),
    ("ended by SLURM", Kind.ENDED_BY_SLURM, ""),
    ("hung", Kind.HUNG, ""),
    ("crashed (exit 1)", Kind.CRASHED, "1"),
    ("crashed (exit 137)", Kind.CRASHED, "137"),
    ("out of memory", Kind.OUT_OF_MEMORY, ""),
    ("killed by SIGKILL", Kind.KILLED, "SIGKILL"),
    ("non-finite loss at step 8 (epoch 1)", Kind.NOT_FINITE, "at step 8 (epoch 1)"),
    ("bad node cn08, cn09", Kind.BAD_NODE, "cn08, cn09"),
    ("failed its checks (no node named)", Kind.FAILED_CHECKS, "no node named"),
    ("rendezvous timeout", Kind.RENDEZVOUS_TIMEOUT, ""),
    ("rendezvous failed (RendezvousClosedError)", Kind.RENDEZVOUS_FAILED,
     "RendezvousClosedError"),
    ("lost (the launcher was killed: node failure, out of memory or SIGKILL)", Kind.LOST,
     "the launcher was killed: node failure, out of memory or SIGKILL"),
]  # fmt: skip


@pytest.mark.parametrize(("label", "kind", "part"), LABELS)
def test_a_label_reads_back_as_its_kind_and_part(label, kind, part):
    found = outcomes.parse(label)
    assert (found.kind, found.part) == (kind, part)
    assert found.label == label
    assert found == label and found == Outcome(kind, part)


def test_every_kind_has_a_label_in_the_table():
    assert {kind for _, kind, _ in LABELS} == set(Kind)


@pytest.mark.parametrize("label", ["failed", "crashed", "crashed (exit )", "Completed", ""])
def test_a_label_of_no_kind_is_refused_by_name(label):
    with pytest.raises(OutcomeError, match="unknown slot outcome"):
        outcomes.parse(label)


def test_a_variable_part_is_required_where_the_label_has_one_and_refused_elsewhere():
    with pytest.raises(OutcomeError, match="CRASHED: a variable part needs"):
        Outcome(Kind.CRASHED)
    with pytest.raises(OutcomeError, match="HUNG: a variable part has none"):
        Outcome(Kind.HUNG, "rank 1")


def test_a_record_without_an_outcome_is_running():
    assert outcomes.kind_of({}) is Kind.RUNNING
    assert outcomes.kind_of({"outcome": "crashed (exit 2)"}) is Kind.CRASHED
