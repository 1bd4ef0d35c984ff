"""Rank-side runtime: what an application rank links against.

For now only :mod:`raps_slurm.runtime.agent_client` (register with the node's agent,
heartbeat, stop when the agent's fencing view runs out). The full runtime API
(checkpoints, message logging, recovery) comes with the messaging issue.
"""
