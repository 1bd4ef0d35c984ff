"""The least-privilege etcd roles (``raps_slurm/store/roles.py``) against a real etcd with
auth enabled: applied by ``rapsctl etcd-roles --apply``, an agent's and a hook's
credentials do their own work through the real code paths and are refused the rest; an
agent's credential writes its own node's keys and no other node's."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from raps_slurm.agent.recovery_api import record_event
from raps_slurm.cli import main as rapsctl
from raps_slurm.config import StoreConfig
from raps_slurm.coordinator.recovery import read_plans
from raps_slurm.coordinator.snapshot import read_snapshot
from raps_slurm.core.planner import Plan
from raps_slurm.errors import StorePermissionDenied
from raps_slurm.hooks.run import run_hook
from raps_slurm.store import EtcdStore, Keys, StateStore, open_store
from raps_slurm.store.etcd_auth import apply_roles
from raps_slurm.store.roles import roles
from raps_slurm.testing import EtcdServer

pytestmark = pytest.mark.etcd

JOB = "4242"
PID = f"{JOB}-0-2"


class Cluster:
    """An etcd with root, the four RAPS users (passwords in ``pw``) and auth enabled."""

    def __init__(self, server: EtcdServer, tmp: Path) -> None:
        self.server, self.tmp, self.pw = server, tmp, tmp / "pw"
        self.keys = Keys()

    def config(self, user: str) -> StoreConfig:
        return StoreConfig(endpoints=(self.server.url,), user=user,
                           password_file=str(self.pw / f"{user}.password"))

    def store(self, user: str) -> StateStore:
        return open_store(self.config(user))[0]

    def config_file(self, user: str) -> Path:
        path = self.tmp / f"{user}.yaml"
        path.write_text(yaml.safe_dump({
            "store": {"endpoints": [self.server.url], "user": user,
                      "password_file": str(self.pw / f"{user}.password")},
            "hooks": {"log_dir": str(self.tmp), "fail_open": False}}))
        return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("roles")
    with EtcdServer() as server:
        c = Cluster(server, tmp)
        server.etcdctl("user", "add", "root:rootpw")
        server.etcdctl("user", "grant-role", "root", "root")
        # before auth: no credentials needed to set the roles up
        bare = EtcdStore([server.url])
        try:
            changes = apply_roles(bare, roles(c.keys, ["n1", "n2"]), c.pw)
        finally:
            bare.close()
        assert "user raps-agent-n1: created (password in" in "\n".join(changes)
        assert "user raps-agent-n1: granted role raps-agent" in changes
        assert sorted(p.name for p in c.pw.iterdir()) == [
            "raps-admin.password", "raps-agent-n1.password", "raps-agent-n2.password",
            "raps-coordinator.password", "raps-hooks.password"]
        assert all(p.stat().st_mode & 0o777 == 0o600 for p in c.pw.iterdir())
        server.etcdctl("auth", "enable")
        yield c


def _refused(store: StateStore, key: str) -> None:
    with pytest.raises(StorePermissionDenied, match="permission denied for user 'raps-"):
        store.put(key, b"forged")


def _env(job: str = JOB) -> dict[str, str]:
    return {"SPANK_RAPS_ENABLED": "1", "SLURM_JOB_ID": job, "SLURM_JOB_UID": "1000",
            "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_RESTART_COUNT": "0",
            "SLURM_JOB_USER": "alice"}


def test_apply_again_changes_nothing_and_reverts_a_drifted_role(
        cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster.server.etcdctl("role", "grant-permission", "raps-agent", "--prefix=true",
                           "readwrite", "/raps/v1/jobs/", user="root:rootpw")
    (tmp_path / "root").write_text("rootpw\n")
    args = ["--config", str(cluster.config_file("root")), "etcd-roles", "--apply",
            "--user", "root", "--password-file", str(tmp_path / "root")]
    with pytest.raises(SystemExit) as done:
        rapsctl(args)
    assert done.value.code == 0
    out = capsys.readouterr().out
    # the readwrite replaced the read grant: revoked, and the read granted back
    assert "role raps-agent: revoked READWRITE '/raps/v1/jobs/'" in out
    assert "role raps-agent: granted read /raps/v1/jobs/*" in out
    for extra in ([], ["--nodes", "n[1-2]"]):
        with pytest.raises(SystemExit):
            rapsctl(args + extra)
        assert capsys.readouterr().out.strip() == \
            "roles and users already as wanted: nothing changed"


def test_a_node_added_later_gets_its_user_and_an_old_shared_user_is_named(
        cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "root").write_text("rootpw\n")
    cluster.server.etcdctl("user", "add", "raps-agent", "--no-password", user="root:rootpw")
    try:
        with pytest.raises(SystemExit) as done:
            rapsctl(["--config", str(cluster.config_file("root")), "etcd-roles", "--apply",
                     "--user", "root", "--password-file", str(tmp_path / "root"),
                     "--password-dir", str(tmp_path / "pw"), "--nodes", "n3"])
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert "role raps-agent-n3: created" in out and "user raps-agent-n3: created" in out
        assert "user raps-agent: left from an earlier install, it can no longer write node " \
               "keys; delete it (etcdctl user delete raps-agent)" in out
        assert "raps-agent-n1" not in out  # nodes not named are left as they are
        assert (tmp_path / "pw" / "raps-agent-n3.password").stat().st_mode & 0o777 == 0o600
    finally:
        cluster.server.etcdctl("user", "delete", "raps-agent", user="root:rootpw")


def test_bad_nodes_are_one_line(cluster: Cluster, capsys: pytest.CaptureFixture[str]
                                ) -> None:
    for bad, said in (("n[1-", "bad hostlist"), ("-x", "is no node name")):
        with pytest.raises(SystemExit) as done:
            rapsctl(["--config", str(cluster.config_file("root")), "etcd-roles",
                     "--nodes", bad])
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert "--nodes" in err and said in err, err


def test_hooks_register_and_end_a_job_but_touch_nothing_else(cluster: Cluster) -> None:
    k = cluster.keys
    conf = str(cluster.config_file("raps-hooks"))
    assert run_hook("prolog-slurmctld", conf, _env()) == 0  # fail_open false: 1 on error
    assert run_hook("epilog-slurmctld", conf, {**_env(), "SLURM_JOB_EXIT_CODE2": "0:0"}) == 0
    with cluster.store("raps-coordinator") as coord:
        record = json.loads(coord.get(k.job(JOB)).value)  # type: ignore[union-attr]
        assert record["owner_uid"] == 1000 and record["state"] == "ended"
    # requeued onto other nodes: the earlier run's stay nodes of the job for its records
    assert run_hook("prolog-slurmctld", conf, {**_env(), "SLURM_JOB_RESTART_COUNT": "1",
                                               "SLURM_JOB_NODELIST": "n[2-3]"}) == 0
    with cluster.store("raps-coordinator") as coord:
        record = json.loads(coord.get(k.job(JOB)).value)  # type: ignore[union-attr]
        assert (record["nodes"], record["earlier_nodes"]) == (["n2", "n3"], ["n1"])
    with cluster.store("raps-hooks") as hooks:
        hooks.delete_prefix(k.job_reports_prefix("1"))  # a job id used again
        hooks.delete_prefix(k.node_job_reports_prefix("n1", "1"))
        hooks.delete_prefix(k.job_plan_events_prefix("n1", "1"))
        hooks.delete(k.purged("1"))
        for key in (k.leader(), k.node_verdict("n1"), k.node_health_verdict("n1"),
                    k.node("n1"), k.plan(PID), k.plan_cancel(PID),
                    k.weight("n1"), k.audit("1-h-1")):
            _refused(hooks, key)
        with pytest.raises(StorePermissionDenied):
            hooks.get(k.leader())


def test_agent_reports_but_cannot_rewrite_what_others_decide(cluster: Cluster) -> None:
    k = cluster.keys
    job = "4343"
    assert run_hook("prolog-slurmctld", str(cluster.config_file("raps-hooks")),
                    _env(job)) == 0
    plan = Plan(f"{job}-0-2", job, 0, "n1", "n2", 2, "DEAD", 0, state="running",
                created_at=time.time())
    with cluster.store("raps-coordinator") as coord:
        coord.put(k.job_map(job), b"{}")
        coord.put(k.plan(plan.plan_id), plan.to_json())
        coord.put(k.leader(), b"{}")
    # the agent's config names its user with %n (docs/store.md, Roles)
    conf = dataclasses.replace(cluster.config("raps-agent-%n"),
                               password_file=str(cluster.pw / "raps-agent-%n.password"))
    with open_store(conf, "n1")[0] as agent:
        # its own node, under its lease
        lease = agent.grant_lease(10)
        agent.put(k.node("n1"), json.dumps({"transfer": "127.0.0.1:1"}).encode(), lease)
        agent.put(k.node_health("n1"), b"{}", lease)
        assert agent.get_prefix(k.nodes_prefix())  # it reads every node's registration
        # another node's registration and health, and the leader's verdicts on its own
        for key in (k.node("n2"), k.node_health("n2"), k.node_verdict("n1"),
                    k.node_health_verdict("n1"), k.node_verdict("n2"), k.node("n1x")):
            _refused(agent, key)
        with pytest.raises(StorePermissionDenied):
            agent.delete(k.node("n2"))
        # what it reports for the ranks it hosts, under its own name
        agent.put(k.job_peer("n1", job, 0), json.dumps({"done": True, "epoch": 1}).encode())
        agent.put(k.job_msgstats("n1", job, 0), b"{}")
        agent.put(k.rank_escalation("n1", job, 0), json.dumps(
            {"kind": "ESCALATE", "at": time.time(), "epoch": 1}).encode())
        assert agent.create(k.ckpt(job, 0, 1), b"{}")
        assert agent.delete(k.ckpt(job, 0, 1))
        # its own commit of a generation, never another node's (a restore trusts these)
        assert agent.create(k.ckpt_commit("n1", job, 0, 1), b"{}")
        assert agent.delete(k.ckpt_commit("n1", job, 0, 1))
        _refused(agent, k.ckpt_commit("n2", job, 0, 1))
        with pytest.raises(StorePermissionDenied):
            agent.delete(k.ckpt_commit("n2", job, 0, 1))
        assert record_event(agent, k, "n1", plan.plan_id, "restored", {"bytes": 0})
        # and nothing under another node's name, nor an admin's cancel, nor a HUNG verdict
        for key in (k.job_peer("n2", job, 0), k.job_msgstats("n2", job, 0),
                    k.rank_escalation("n2", job, 0), k.rank_escalation("n10", job, 0),
                    k.plan_event("n2", plan.plan_id, "restored"), k.plan_cancel(plan.plan_id),
                    k.job_hung_verdict(job, 0)):
            _refused(agent, key)
        assert not record_event(agent, k, "n2", plan.plan_id, "running", {})
        # what it reads
        for key in (k.leader(), k.job(job), k.job_map(job), k.plan(plan.plan_id)):
            assert agent.get(key) is not None, key
        agent.get_prefix(k.purged_prefix())
        agent.get_prefix(k.job_ranks_prefix(job))
        # what it must not write: maps, job records (owner), plans, the leader, ranks
        for key in (k.job_map(job), k.job(job), k.job_rank(job, 0),
                    k.job_group(job, 0), k.job_escalation(job), k.plan(plan.plan_id),
                    k.leader(), k.purged(job), k.history_event("n1", "1"), k.weight("n1"),
                    k.weight_pin("n1"), k.audit("1-h-1")):
            _refused(agent, key)
        with pytest.raises(StorePermissionDenied):
            agent.delete_prefix(k.job_prefix(job))
        with pytest.raises(StorePermissionDenied):
            agent.get_prefix(k.audit_prefix())
        agent.revoke_lease(lease)
    # the leader reads the reports from their place
    with cluster.store("raps-coordinator") as coord:
        view = read_snapshot(coord, k).jobs[job]
        assert view.done == {0: 1} and 0 in view.escalated
        assert read_plans(coord, k).events[plan.plan_id].keys() == {"restored"}


def test_the_admin_writes_what_rapsctl_writes(cluster: Cluster) -> None:
    k = cluster.keys
    with cluster.store("raps-admin") as admin:
        admin.put(k.audit("1-h-1"), b"{}")
        admin.put(k.weight_pin("n1"), b"{}")
        admin.put(k.plan_cancel(PID), b"{}")
