"""Slurm prolog/epilog hooks: register RAPS jobs in etcd, prepare node-local dirs.

Run as ``python -m raps_slurm.hooks HOOK`` by the wrappers that
``scripts/install-hooks.sh`` writes. They never call a Slurm command (Slurm forbids
it in prolog/epilog), stay within ``hooks.time_budget_sec`` and never delete data.
"""
