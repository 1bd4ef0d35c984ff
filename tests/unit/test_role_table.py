"""The etcd role table (``raps_slurm/store/roles.py``) against every key helper: a new key
must be classified here, no agent or hook may write what the leader decides, and an agent
writes no other node's keys."""

from __future__ import annotations

import inspect

from raps_slurm.store import Keys
from raps_slurm.store.roles import (
    ADMIN,
    AGENT,
    COORDINATOR,
    HOOKS,
    agent_user,
    etcdctl_commands,
    permits,
    roles,
    user_permits,
)

ARGS = {"name": "n1", "node": "n1", "job_id": "12", "rank": 3, "gen": 7, "plan_id": "12-3-4",
        "phase": "running", "event_id": "1", "ident": "1-h-1", "run": 0}

# Who besides the coordinator and the admin may write under each helper's key (with
# node n1: N1 is n1's agent alone; AGENT_W every agent, through the shared role).
N1, N2 = agent_user("n1"), agent_user("n2")
AGENT_W, HOOKS_W, BOTH = {N1, N2}, {HOOKS}, {N1, N2, HOOKS}
NOBODY: set[str] = set()
WRITERS: dict[str, set[str]] = {
    "leader": NOBODY,
    # an agent registers its own node and its health; the leader's verdicts under the
    # node's name are the leader's alone
    "nodes_prefix": NOBODY, "node": {N1}, "node_health": {N1},
    "node_verdict": NOBODY, "node_health_verdict": NOBODY,
    "purged_prefix": HOOKS_W, "purged": HOOKS_W,
    "jobs_prefix": HOOKS_W, "job": HOOKS_W, "job_prefix": HOOKS_W, "job_map": HOOKS_W,
    "job_groups_prefix": HOOKS_W, "job_ranks_prefix": HOOKS_W, "job_rank": HOOKS_W,
    "job_group": HOOKS_W, "job_escalation": HOOKS_W,
    "job_hung_verdict": HOOKS_W, "job_paused": HOOKS_W,
    # checkpoint records: every agent (a holder updates another node's record)
    "reports_prefix": NOBODY, "job_reports_root": BOTH, "job_reports_prefix": BOTH,
    "job_ckpts_prefix": BOTH, "ckpt_prefix": BOTH, "ckpt": BOTH,
    # what n1 reports about ranks and plans: n1's agent alone (and the hooks, which
    # delete them when a job id is used again)
    "rank_reports_root": HOOKS_W, "node_rank_reports_prefix": {N1, HOOKS},
    "node_job_reports_prefix": {N1, HOOKS}, "rank_escalation": {N1, HOOKS},
    "job_peer": {N1, HOOKS}, "job_msgstats": {N1, HOOKS}, "job_step": {N1, HOOKS},
    "ckpt_commits_prefix": {N1, HOOKS}, "ckpt_commit": {N1, HOOKS},
    "plan_events_prefix": HOOKS_W, "node_plan_events_prefix": {N1, HOOKS},
    "plan_event": {N1, HOOKS}, "job_plan_events_prefix": {N1, HOOKS},
    "plans_prefix": NOBODY, "plan": NOBODY, "job_plans_prefix": NOBODY,
    "cancels_prefix": NOBODY, "plan_cancel": NOBODY, "job_cancels_prefix": NOBODY,
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
    table = roles(keys, ["n1", "n2"])
    users = [r.name for r in table if r.user]
    assert sorted(users) == sorted([COORDINATOR, HOOKS, ADMIN, N1, N2])
    for name, key in every.items():
        writers = {u for u in users if user_permits(table, u, key, "write")}
        assert writers == {COORDINATOR, ADMIN} | WRITERS[name], (name, key)
        assert all(user_permits(table, u, key, "read") for u in (COORDINATOR, ADMIN))
        reads = any(key.startswith(every[p]) for p in AGENT_READS)
        assert user_permits(table, N1, key, "read") == reads, (name, key)
        assert user_permits(table, N2, key, "read") == reads, (name, key)
        assert user_permits(table, HOOKS, key, "read") == (HOOKS in WRITERS[name]), (name, key)
    assert not user_permits(table, N1, "/site/raps-other/leader", "read")
    # no user named raps-agent: the shared role is held through the per-node users
    assert not user_permits(table, AGENT, keys.job_peer("n1", 1, 0), "write")


def test_the_agent_cannot_write_what_the_leader_or_the_hooks_decide() -> None:
    keys = Keys()
    agent = next(r for r in roles(keys) if r.name == AGENT)
    hooks = next(r for r in roles(keys) if r.name == HOOKS)
    for key in (keys.job_map(1), keys.job(1), keys.job_rank(1, 0), keys.plan("1-0-1"),
                keys.leader(), keys.node_verdict("n1"), keys.node("n1")):
        assert not permits(agent, key, "write"), key
    for key in (keys.leader(), keys.node_verdict("n1"), keys.plan("1-0-1")):
        assert not permits(hooks, key, "write"), key


def test_an_agent_writes_its_own_node_keys_alone() -> None:
    keys = Keys()
    table = roles(keys, ["n1", "n2", "n10"])
    assert user_permits(table, agent_user("n1"), keys.node("n1"), "write")
    assert user_permits(table, agent_user("n1"), keys.node_health("n1"), "write")
    for key in (keys.node("n2"), keys.node_health("n2"), keys.node("n10"),
                keys.node_verdict("n1"), keys.node_health_verdict("n1"), keys.node("n1x")):
        assert not user_permits(table, agent_user("n1"), key, "write"), key
    assert not user_permits(table, agent_user("n3"), keys.node("n3"), "write")  # not made


def test_an_agent_reports_under_its_own_name_alone() -> None:
    """n1's agent writes what it reports about ranks and plans under n1's prefixes, and
    nothing under n2's or n10's: it cannot pass a report off as another node's."""
    keys = Keys()
    table, n1 = roles(keys, ["n1", "n2", "n10"]), agent_user("n1")
    for key in (keys.rank_escalation("n1", 5, 0), keys.job_peer("n1", 5, 0),
                keys.job_msgstats("n1", 5, 0), keys.plan_event("n1", "5-0-2", "running"),
                keys.ckpt(5, 0, 1)):
        assert user_permits(table, n1, key, "write"), key
    for node in ("n2", "n10"):
        for key in (keys.rank_escalation(node, 5, 0), keys.job_peer(node, 5, 0),
                    keys.job_msgstats(node, 5, 0), keys.plan_event(node, "5-0-2", "running")):
            assert not user_permits(table, n1, key, "write"), key
    for key in (keys.job_hung_verdict(5, 0), keys.plan_cancel("5-0-2")):
        assert not user_permits(table, n1, key, "write"), key


def test_etcdctl_commands() -> None:
    lines = etcdctl_commands(Keys(), no_password=True, nodes=["n1"])
    assert "etcdctl role grant-permission raps-agent read /raps/v1/leader" in lines
    assert "etcdctl role grant-permission raps-agent --prefix=true read " \
           "/raps/v1/reports/" in lines
    assert "etcdctl role grant-permission raps-agent --prefix=true readwrite " \
           "/raps/v1/reports/jobs/" in lines
    assert "etcdctl role grant-permission raps-agent-n1 --prefix=true readwrite " \
           "/raps/v1/reports/ranks/n1/" in lines
    assert "etcdctl role grant-permission raps-agent --prefix=true read /raps/v1/nodes/" \
        in lines
    assert "etcdctl role grant-permission raps-agent-n1 readwrite /raps/v1/nodes/n1" in lines
    assert "etcdctl role grant-permission raps-agent-n1 readwrite /raps/v1/nodes/n1/health" \
        in lines
    assert "etcdctl user add raps-hooks --no-password" in lines
    assert "etcdctl user grant-role raps-admin raps-admin" in lines
    assert "etcdctl user add raps-agent --no-password" not in lines
    assert lines.index("etcdctl role add raps-agent") < \
        lines.index("etcdctl user grant-role raps-agent-n1 raps-agent")
    assert "etcdctl user grant-role raps-agent-n1 raps-agent-n1" in lines
    assert sum(line.startswith("etcdctl role add ") for line in lines) == 5
    assert sum(line.startswith("etcdctl user add ") for line in lines) == 4
