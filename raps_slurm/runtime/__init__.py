"""Rank-side runtime: what an application rank links against.

:mod:`raps_slurm.runtime.agent_client` registers with the node's agent, heartbeats and
stops the rank when the agent's fencing view runs out; :mod:`raps_slurm.runtime.checkpoint`
saves and restores the rank's state through the agent. The full runtime API
(``runtime.init()``, message logging, recovery) comes with the messaging issue.
"""
