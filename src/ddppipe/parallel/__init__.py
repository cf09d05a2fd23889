"""Distributed set-up on a node: launcher environments, devices, CPU binding, the process group."""
