"""The etcd role table (``raps_slurm/store/roles.py``) against every key helper: a new key
must be classified here, and no agent or hook may write what the leader decides."""

from __future__ import annotations

import inspect

from raps_slurm.store import Keys
from raps_slurm.store.roles import (
    ADMIN,
    AGENT,
    COORDINATOR,
    HOOKS,
    etcdctl_commands,
    permits,
    roles,
)

ARGS = {"name": "n1", "node": "n1", "job_id": "12", "rank": 3, "gen": 7, "plan_id": "12-3-4",
        "phase": "running", "event_id": "1", "ident": "1-h-1"}

# Who besides the coordinator and the admin may write under each helper's key.
AGENT_W, HOOKS_W, BOTH = {AGENT}, {HOOKS}, {AGENT, HOOKS}
NOBODY: set[str] = set()
WRITERS: dict[str, set[str]] = {
    "leader": NOBODY,
    # agents register their node and its health; the leader's verdicts share the node
    # prefix: the residual docs/store.md (Roles) names
    "nodes_prefix": AGENT_W, "node": AGENT_W, "node_health": AGENT_W,
    "node_verdict": AGENT_W, "node_health_verdict": AGENT_W,
    "purged_prefix": HOOKS_W, "purged": HOOKS_W,
    "jobs_prefix": HOOKS_W, "job": HOOKS_W, "job_prefix": HOOKS_W, "job_map": HOOKS_W,
    "job_groups_prefix": HOOKS_W, "job_ranks_prefix": HOOKS_W, "job_rank": HOOKS_W,
    "job_group": HOOKS_W, "job_escalation": HOOKS_W, "job_secret": HOOKS_W,
    "reports_prefix": AGENT_W, "job_reports_root": BOTH, "job_reports_prefix": BOTH,
    "job_rank_verdict": BOTH, "job_peer": BOTH, "job_msgstats_prefix": BOTH,
    "job_msgstats": BOTH, "job_ckpts_prefix": BOTH, "ckpt_prefix": BOTH, "ckpt": BOTH,
    "plan_events_prefix": AGENT_W, "plan_event": AGENT_W, "job_plan_events_prefix": AGENT_W,
    "plans_prefix": NOBODY, "plan": NOBODY, "job_plans_prefix": NOBODY,
    "history_prefix": NOBODY, "history_event": NOBODY, "weights_prefix": NOBODY,
    "weight": NOBODY, "weight_pins_prefix": NOBODY, "weight_pin": NOBODY,
    "audit_prefix": NOBODY, "audit": NOBODY,
}
# What the agent reads (its hooks' counterpart reads only what it writes).
AGENT_READS = {"leader", "nodes_prefix", "jobs_prefix", "plans_prefix", "purged_prefix",
               "reports_prefix"}


def _every_key(keys: Keys) -> dict[str, str]:
    out = {}
    for name, method in inspect.getmembers(keys, inspect.ismethod):
        if name.startswith("_") or name == "split":
            continue
        params = inspect.signature(method).parameters
        out[name] = method(*(ARGS[p] for p in params))
    return out


def test_every_key_helper_has_its_writers() -> None:
    keys = Keys("/site/raps/")
    every = _every_key(keys)
    assert set(every) == set(WRITERS), "classify the new key helpers in WRITERS"
    table = {r.name: r for r in roles(keys)}
    assert set(table) == {COORDINATOR, HOOKS, AGENT, ADMIN}
    for name, key in every.items():
        writers = {r for r, role in table.items() if permits(role, key, "write")}
        assert writers == {COORDINATOR, ADMIN} | WRITERS[name], (name, key)
        assert permits(table[COORDINATOR], key, "read") and permits(table[ADMIN], key, "read")
        reads = any(key.startswith(every[p]) for p in AGENT_READS)
        assert permits(table[AGENT], key, "read") == reads, (name, key)
        assert permits(table[HOOKS], key, "read") == (HOOKS in WRITERS[name]), (name, key)
    assert not permits(table[AGENT], "/site/raps-other/leader", "read")


def test_the_agent_cannot_write_what_the_leader_or_the_hooks_decide() -> None:
    keys = Keys()
    agent = next(r for r in roles(keys) if r.name == AGENT)
    hooks = next(r for r in roles(keys) if r.name == HOOKS)
    for key in (keys.job_map(1), keys.job(1), keys.job_rank(1, 0), keys.plan("1-0-1"),
                keys.leader(), keys.job_secret(1)):
        assert not permits(agent, key, "write"), key
    for key in (keys.leader(), keys.node_verdict("n1"), keys.plan("1-0-1")):
        assert not permits(hooks, key, "write"), key


def test_etcdctl_commands() -> None:
    lines = etcdctl_commands(Keys(), no_password=True)
    assert "etcdctl role grant-permission raps-agent read /raps/v1/leader" in lines
    assert "etcdctl role grant-permission raps-agent --prefix=true readwrite " \
           "/raps/v1/reports/" in lines
    assert "etcdctl user add raps-hooks --no-password" in lines
    assert "etcdctl user grant-role raps-admin raps-admin" in lines
    assert sum(line.startswith("etcdctl role add ") for line in lines) == 4
