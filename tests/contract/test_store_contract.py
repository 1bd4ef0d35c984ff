"""The StateStore contract, run on MemoryStore and on a real etcd (EtcdStore)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raps_slurm.errors import HistoryCompacted, LeaseExpired, StoreError, StoreUnavailable
from raps_slurm.store import MAX_TXN_OPS, Delete, EtcdStore, Guard, MemoryStore, Put, WatchEvent
from raps_slurm.testing import EtcdServer, free_port
from raps_slurm.testing.cluster import wait_until

if TYPE_CHECKING:  # the fixture's type; conftest is not importable at run time
    from conftest import Backend

# -- plain key-value ----------------------------------------------------------


def test_put_get_and_revisions(backend: Backend) -> None:
    s, k = backend.store, backend.key("a")
    assert s.get(k) is None
    before = s.current_revision()
    rev1 = s.put(k, b"one")
    assert rev1 > before
    assert s.current_revision() == rev1
    kv = s.get(k)
    assert kv is not None
    assert (kv.key, kv.value, kv.mod_revision, kv.create_revision, kv.lease_id) == (
        k, b"one", rev1, rev1, None)
    rev2 = s.put(k, b"two")
    assert rev2 > rev1
    kv2 = s.get(k)
    assert kv2 is not None
    assert (kv2.value, kv2.mod_revision, kv2.create_revision) == (b"two", rev2, rev1)


def test_get_prefix_is_sorted_and_bounded(backend: Backend) -> None:
    s = backend.store
    names = ["b", "a/2", "a/10", "c", "a/1"]
    for n in names:
        s.put(backend.key("p", n), n.encode())
    s.put(backend.key("p2"), b"sibling")  # shares the text "p" but not "p/"
    s.put(backend.prefix[:-1] + "x/p/a", b"outside")  # the test prefix without its '/'
    got = s.get_prefix(backend.key("p", ""))
    assert [kv.key for kv in got] == [backend.key("p", n) for n in sorted(names)]
    assert [kv.value for kv in got] == [n.encode() for n in sorted(names)]
    assert s.get_prefix(backend.key("nothing/")) == []
    s.delete(backend.prefix[:-1] + "x/p/a")


def test_delete_and_delete_prefix(backend: Backend) -> None:
    s = backend.store
    k = backend.key("solo")
    first = s.put(k, b"1")
    assert s.delete(k) is True
    assert s.get(k) is None
    assert s.delete(k) is False
    s.put(k, b"again")
    again = s.get(k)
    assert again is not None and again.create_revision > first  # a new life
    for i in range(3):
        s.put(backend.key("d", str(i)), b"x")
    s.put(backend.key("dd"), b"keep")
    before = s.current_revision()
    assert s.delete_prefix(backend.key("d", "")) == 3
    assert s.current_revision() == before + 1  # one revision for the whole range
    assert s.get_prefix(backend.key("d", "")) == []
    assert s.get(backend.key("dd")) is not None
    assert s.delete_prefix(backend.key("d", "")) == 0


def test_values_are_bytes_and_keys_checked(backend: Backend) -> None:
    s = backend.store
    with pytest.raises(TypeError):
        s.put(backend.key("t"), "text")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        s.put("", b"x")
    with pytest.raises(ValueError):
        s.grant_lease(0)
    with pytest.raises(ValueError):
        s.compare_and_swap(backend.key("t"), b"x", -1)
    s.put(backend.key("empty"), b"")
    kv = s.get(backend.key("empty"))
    assert kv is not None and kv.value == b""


def test_unicode_keys_round_trip(backend: Backend) -> None:
    s = backend.store
    k = backend.key("nœud-é", "ü")
    s.put(k, b"v")
    kv = s.get(k)
    assert kv is not None and kv.key == k
    assert [x.key for x in s.get_prefix(backend.key("nœud-é", ""))] == [k]


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.binary(max_size=4096))
def test_arbitrary_bytes_round_trip(backend: Backend, value: bytes) -> None:
    s, k = backend.store, backend.key("bin")
    s.put(k, value)
    kv = s.get(k)
    assert kv is not None and kv.value == value
    assert s.compare_and_swap(k, value[::-1], kv.mod_revision)
    after = s.get(k)
    assert after is not None and after.value == value[::-1]


# -- atomic writes ------------------------------------------------------------


def test_create_if_absent(backend: Backend) -> None:
    s, k = backend.store, backend.key("c")
    assert s.create(k, b"first") is True
    assert s.create(k, b"second") is False
    kv = s.get(k)
    assert kv is not None and kv.value == b"first"


def test_compare_and_swap(backend: Backend) -> None:
    s, k = backend.store, backend.key("cas")
    assert s.compare_and_swap(k, b"v0", 0) is True  # 0: must not exist
    assert s.compare_and_swap(k, b"again", 0) is False
    kv = s.get(k)
    assert kv is not None and kv.value == b"v0"
    assert s.compare_and_swap(k, b"v1", kv.mod_revision) is True
    kv1 = s.get(k)
    assert kv1 is not None and kv1.value == b"v1" and kv1.mod_revision > kv.mod_revision
    # stale revision: refused, value unchanged
    assert s.compare_and_swap(k, b"stale", kv.mod_revision) is False
    kv2 = s.get(k)
    assert kv2 == kv1


def test_transaction_applies_all_in_one_revision(backend: Backend) -> None:
    s = backend.store
    guard, a, b, gone = (backend.key(x) for x in ("leader", "a", "b", "old/"))
    s.put(guard, b"me")
    s.put(gone + "1", b"x")
    s.put(gone + "2", b"y")
    g = s.get(guard)
    assert g is not None
    assert s.transaction([Guard(guard, g.mod_revision), Guard(a, 0)],
                         [Put(a, b"1"), Put(b, b"2"), Delete(gone, prefix=True)]) is True
    ka, kb = s.get(a), s.get(b)
    assert ka is not None and kb is not None and (ka.value, kb.value) == (b"1", b"2")
    assert ka.mod_revision == kb.mod_revision == s.current_revision()
    assert s.get_prefix(gone) == []


def test_transaction_guard_mismatch_writes_nothing(backend: Backend) -> None:
    s = backend.store
    guard, a, keep = backend.key("leader"), backend.key("a"), backend.key("keep")
    s.put(guard, b"me")
    s.put(keep, b"k")
    stale = s.get(guard)
    assert stale is not None
    s.put(guard, b"someone else")  # a new leader: the old revision no longer guards
    before = s.current_revision()
    assert s.transaction([Guard(guard, stale.mod_revision)],
                         [Put(a, b"1"), Delete(keep)]) is False
    assert s.get(a) is None and s.get(keep) is not None
    assert s.current_revision() == before
    # a guard on an absent key with revision 0 holds; with any other it fails
    assert s.transaction([Guard(backend.key("none"), 5)], [Put(a, b"1")]) is False
    assert s.transaction([Guard(backend.key("none"), 0)], [Put(a, b"1")]) is True


def test_transaction_lease_and_validation(backend: Backend) -> None:
    s, a = backend.store, backend.key("a")
    lease = s.grant_lease(30)
    assert s.transaction([], [Put(a, b"1", lease)]) is True
    kv = s.get(a)
    assert kv is not None and kv.lease_id == lease.id
    s.revoke_lease(lease)
    assert s.get(a) is None
    with pytest.raises(LeaseExpired):
        s.transaction([], [Put(a, b"2", lease)])
    assert s.get(a) is None
    with pytest.raises(ValueError, match="twice"):
        s.transaction([], [Put(a, b"1"), Put(a, b"2")])
    with pytest.raises(ValueError, match="twice"):
        s.transaction([], [Delete(backend.key(""), prefix=True), Put(a, b"2")])
    with pytest.raises(ValueError, match=f"at most {MAX_TXN_OPS}"):
        s.transaction([], [Put(backend.key(str(i)), b"") for i in range(MAX_TXN_OPS + 1)])
    # the largest allowed transaction goes through on every backend
    assert s.transaction([], [Put(backend.key(str(i)), b"") for i in range(MAX_TXN_OPS)])


def test_concurrent_create_has_one_winner(backend: Backend) -> None:
    s, k = backend.store, backend.key("race")
    results: list[bool] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def contend(i: int) -> None:
        start.wait()
        won = s.create(k, str(i).encode())
        with lock:
            results.append(won)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(results) == [False] * 7 + [True]


def test_concurrent_cas_increments_lose_nothing(backend: Backend) -> None:
    s, k = backend.store, backend.key("counter")
    s.put(k, b"0")

    def bump(times: int) -> None:
        for _ in range(times):
            while True:
                kv = s.get(k)
                assert kv is not None
                if s.compare_and_swap(k, str(int(kv.value) + 1).encode(), kv.mod_revision):
                    break

    threads = [threading.Thread(target=bump, args=(10,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    kv = s.get(k)
    assert kv is not None and kv.value == b"40"


# -- leases -------------------------------------------------------------------


def test_revoke_removes_only_leased_keys(backend: Backend) -> None:
    s = backend.store
    lease = s.grant_lease(30)
    assert lease.ttl >= 30
    s.put(backend.key("l1"), b"a", lease)
    assert s.create(backend.key("l2"), b"b", lease)
    s.put(backend.key("free"), b"c")
    kv = s.get(backend.key("l1"))
    assert kv is not None and kv.lease_id == lease.id
    s.revoke_lease(lease)
    assert s.get(backend.key("l1")) is None
    assert s.get(backend.key("l2")) is None
    assert s.get(backend.key("free")) is not None
    s.revoke_lease(lease)  # already gone: no-op
    with pytest.raises(LeaseExpired):
        s.refresh_lease(lease)
    with pytest.raises(LeaseExpired):
        s.put(backend.key("l3"), b"x", lease)


def test_put_without_lease_detaches_it(backend: Backend) -> None:
    s, k = backend.store, backend.key("detach")
    lease = s.grant_lease(30)
    s.put(k, b"held", lease)
    s.put(k, b"free")
    kv = s.get(k)
    assert kv is not None and kv.lease_id is None
    s.revoke_lease(lease)
    assert s.get(k) is not None


def test_lease_expiry_removes_keys(backend: Backend) -> None:
    s, k = backend.store, backend.key("ephemeral")
    lease = s.grant_lease(2)
    assert lease.ttl >= 2  # etcd may round a TTL up to its minimum
    s.put(k, b"alive", lease)
    assert s.get(k) is not None
    backend.elapse(lease.ttl)
    backend.poll(lambda: s.get(k) is None, timeout=lease.ttl + 5, what="leased key to vanish")
    with pytest.raises(LeaseExpired):
        s.refresh_lease(lease)
    with pytest.raises(LeaseExpired):
        s.create(backend.key("late"), b"x", lease)


def test_refresh_keeps_lease_alive(backend: Backend) -> None:
    s, k = backend.store, backend.key("kept")
    lease = s.grant_lease(2)
    s.put(k, b"alive", lease)
    for _ in range(3):  # 3 s in total, longer than the TTL
        backend.elapse(lease.ttl / 2)
        s.refresh_lease(lease)
        assert s.get(k) is not None
    s.revoke_lease(lease)


# -- watches ------------------------------------------------------------------


def _drain(watch_next: object, count: int, timeout: float = 5.0) -> list[WatchEvent]:
    events: list[WatchEvent] = []
    deadline = time.monotonic() + timeout
    while len(events) < count and time.monotonic() < deadline:
        ev = watch_next(0.2)  # type: ignore[operator]
        if ev is not None:
            events.append(ev)
    return events


def test_watch_from_revision_delivers_history_in_order(backend: Backend) -> None:
    s = backend.store
    a, b = backend.key("w", "a"), backend.key("w", "b")
    r1 = s.put(a, b"1")
    r2 = s.put(b, b"2")
    s.put(backend.key("elsewhere"), b"not watched")
    r3 = s.put(a, b"3")
    s.delete(b)
    r4 = s.current_revision()
    with s.watch_prefix(backend.key("w", ""), start_revision=r1) as w:
        events = _drain(w.next, 4)
        assert [(e.kind, e.key, e.value, e.mod_revision, e.create_revision)
                for e in events] == [
            ("put", a, b"1", r1, r1), ("put", b, b"2", r2, r2), ("put", a, b"3", r3, r1),
            ("delete", b, b"", r4, 0)]
        # history then live, same stream: a key created again has a new create revision
        r5 = s.put(b, b"5")
        assert _drain(w.next, 1) == [WatchEvent("put", b, b"5", r5, r5)]
        assert w.next(0.2) is None


def test_watch_sees_live_put_and_delete(backend: Backend) -> None:
    s, k = backend.store, backend.key("live", "x")
    created = s.put(k, b"before the watch")
    w = s.watch_prefix(backend.key("live", ""))
    try:
        assert w.next(0.2) is None  # no history without start_revision
        rp = s.put(k, b"now")
        rd = s.current_revision() + 1
        assert s.delete(k)
        events = _drain(w.next, 2)
        assert events == [WatchEvent("put", k, b"now", rp, created),
                          WatchEvent("delete", k, b"", rd)]  # created before the watch
    finally:
        w.cancel()
    assert w.next(0.1) is None  # cancelled
    w.cancel()  # idempotent


def test_watch_sees_lease_keys_vanish(backend: Backend) -> None:
    s, k = backend.store, backend.key("wl", "n1")
    lease = s.grant_lease(30)
    s.put(k, b"up", lease)
    with s.watch_prefix(backend.key("wl", "")) as w:
        s.revoke_lease(lease)
        events = _drain(w.next, 1)
        assert [(e.kind, e.key) for e in events] == [("delete", k)]


def test_watch_delivers_large_values_intact(backend: Backend) -> None:
    # ~700 KB of JSON per event: spans many HTTP chunks on the etcd stream
    big = bytes(range(256)) * 2048
    s, k = backend.store, backend.key("big", "v")
    with s.watch_prefix(backend.key("big", "")) as w:
        s.put(k, big)
        s.put(k, big[::-1])
        events = _drain(w.next, 2)
        assert [e.value for e in events] == [big, big[::-1]]


def test_cancel_wakes_a_blocked_next(backend: Backend) -> None:
    w = backend.store.watch_prefix(backend.key("idle", ""))
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(w.next(10.0)))
    started = time.monotonic()
    t.start()
    time.sleep(0.1)  # let next() block (not a correctness wait: the assert holds either way)
    w.cancel()
    t.join(timeout=5)
    assert not t.is_alive() and got == [None]
    assert time.monotonic() - started < 5


def test_watch_from_compacted_revision_raises(backend: Backend) -> None:
    s, k = backend.store, backend.key("compact")
    first = s.put(k, b"1")
    last = s.put(k, b"2")
    s.compact(last)
    s.compact(first)  # below the last compaction: nothing to do, no error
    with pytest.raises(HistoryCompacted):
        w = s.watch_prefix(backend.key(""), start_revision=first)
        w.next(2.0)  # etcd reports compaction on the stream, after creation
        w.cancel()
    with s.watch_prefix(backend.prefix, start_revision=last) as w:
        ev = w.next(2.0)
        assert ev is not None and ev.mod_revision == last


def test_compact_a_future_revision_is_refused(backend: Backend) -> None:
    s = backend.store
    now = s.put(backend.key("future"), b"x")
    with pytest.raises(StoreError, match="future revision"):
        s.compact(now + 1000)
    with pytest.raises(ValueError):
        s.compact(0)


def test_status_reports_revision_and_size(backend: Backend) -> None:
    s = backend.store
    before = s.status()
    for i in range(20):
        s.put(backend.key(f"size/{i}"), b"v" * 4096)
    after = s.status()
    assert after.revision == s.current_revision() >= before.revision + 20
    assert after.db_size >= after.db_size_in_use > 0
    assert after.version and after.alarms == ()


def test_a_working_store_has_not_lost_its_quorum(backend: Backend) -> None:
    assert backend.store.quorum_lost() is False


# -- etcd only: failures, failover, auth ----------------------------------------


@pytest.mark.etcd
def test_closed_port_raises_store_unavailable() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    store = EtcdStore([url], timeout=1.0)
    calls = [lambda: store.get("/k"), lambda: store.put("/k", b"v"),
             lambda: store.create("/k", b"v"), lambda: store.grant_lease(5),
             lambda: store.watch_prefix("/k"), store.current_revision]
    for call in calls:
        with pytest.raises(StoreUnavailable, match=url):
            call()
    assert store.quorum_lost() is False  # nothing answers: nothing proven
    store.close()


@pytest.mark.etcd
def test_failover_to_the_next_endpoint(etcd_server: EtcdServer) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with EtcdStore([dead, etcd_server.url], timeout=2.0) as store:
        k = "/contract/failover/k"
        assert store.create(k, b"v")  # safe to retry: never reached the dead one
        kv = store.get(k)
        assert kv is not None and kv.value == b"v"
        with store.watch_prefix("/contract/failover/") as w:
            store.delete(k)
            ev = w.next(5.0)
            assert ev is not None and ev.kind == "delete"


@pytest.mark.etcd
def test_server_loss_breaks_watch_and_calls() -> None:
    with EtcdServer() as server:
        store = EtcdStore([server.url], timeout=2.0)
        w = store.watch_prefix("/gone/")
        store.put("/gone/a", b"1")
        # The event must have reached the watch before the server goes: stopping
        # right after the put races the stream (on a loaded machine etcd is gone
        # before it streamed the event). Wait for it to be queued, unread, so the
        # test still checks that an event received before the loss stays readable.
        wait_until("the put streamed to the watch", w._events.qsize,  # type: ignore[attr-defined]
                   lambda n: n >= 1, timeout=10)
        server.stop()
        ev = w.next(5.0)  # delivered before the loss
        assert ev is not None and ev.key == "/gone/a"
        with pytest.raises(StoreUnavailable):
            w.next(5.0)
        with pytest.raises(StoreUnavailable):
            w.next(0.1)  # stays failed
        with pytest.raises(StoreUnavailable):
            store.get("/gone/a")
        store.close()


@pytest.mark.etcd
def test_auth_with_user_and_token_renewal() -> None:
    with EtcdServer() as server:
        server.etcdctl("user", "add", "root:rootpw")
        server.etcdctl("user", "grant-role", "root", "root")
        server.etcdctl("role", "add", "raps")
        server.etcdctl("role", "grant-permission", "raps", "--prefix=true", "readwrite",
                       "/raps/")
        server.etcdctl("auth", "enable")

        def add_user() -> None:
            server.etcdctl("user", "add", "raps:rapspw", user="root:rootpw")
            server.etcdctl("user", "grant-role", "raps", "raps", user="root:rootpw")

        def invalidate_tokens() -> None:
            # etcd drops every token of a user it deletes: a deterministic "expiry"
            server.etcdctl("user", "delete", "raps", user="root:rootpw")
            add_user()

        add_user()
        with pytest.raises(StoreError, match="auth"):
            EtcdStore([server.url]).get("/raps/x")
        with pytest.raises(StoreError, match="authentication"):
            EtcdStore([server.url], user="raps", password="wrong").get("/raps/x")

        store = EtcdStore([server.url], user="raps", password="rapspw")
        assert store.create("/raps/x", b"1")
        with pytest.raises(StoreError, match="permission denied"):
            store.put("/other", b"x")
        lease = store.grant_lease(5)
        store.put("/raps/l", b"v", lease)
        store.refresh_lease(lease)

        tokens = [store._token]
        invalidate_tokens()
        with store.watch_prefix("/raps/") as w:  # renews the token on the watch path
            tokens.append(store._token)
            invalidate_tokens()
            kv = store.get("/raps/x")  # ... and on the unary path
            assert kv is not None and kv.value == b"1"
            tokens.append(store._token)
            assert None not in tokens and len(set(tokens)) == 3, tokens
            store.put("/raps/y", b"2")
            ev = w.next(5.0)
            assert ev is not None and ev.key == "/raps/y"
        store.close()


def test_memory_store_real_clock_expiry() -> None:
    s = MemoryStore()
    lease = s.grant_lease(1)
    s.put("/k", b"v", lease)
    deadline = time.monotonic() + 5
    while s.get("/k") is not None:
        assert time.monotonic() < deadline, "lease never expired on the real clock"
        time.sleep(0.05)
    with pytest.raises(LeaseExpired):
        s.refresh_lease(lease)
    s.close()
    with pytest.raises(StoreUnavailable):
        s.get("/k")


def test_memory_history_limit_behaves_like_compaction() -> None:
    s = MemoryStore(history_limit=4)
    revs = [s.put(f"/h/{i}", b"x") for i in range(10)]
    with pytest.raises(HistoryCompacted, match="compacted"):
        s.watch_prefix("/h/", start_revision=revs[0])
    with s.watch_prefix("/h/", start_revision=revs[-1]) as w:
        ev = w.next(0.1)
        assert ev is not None and ev.key == "/h/9"


# -- key layout (used by every caller of the store) ------------------------------


def test_keys_layout_and_validation() -> None:
    from raps_slurm.store import Keys

    k = Keys()
    assert k.leader() == "/raps/v1/leader"
    assert k.node("n1") == "/raps/v1/nodes/n1"
    assert k.node_health("n1") == "/raps/v1/nodes/n1/health"
    assert k.job(42) == k.job("42") == "/raps/v1/jobs/42"
    assert k.job_rank(42, 3) == "/raps/v1/jobs/42/ranks/3"
    assert k.job_group(42, 3) == "/raps/v1/jobs/42/groups/3"
    assert k.ckpt(42, 3, 7) == "/raps/v1/reports/jobs/42/ckpt/3/7"
    assert k.plan("p-1") == "/raps/v1/plans/p-1"
    assert k.plan_event("n1", "p-1", "running") == "/raps/v1/reports/phases/n1/p-1/running"
    assert k.plan_cancel("42-3-2") == "/raps/v1/cancels/42-3-2"
    assert k.plan_cancel("42-3-2").startswith(k.job_cancels_prefix(42))
    # what a node reports lives under its own prefix, the job after it
    assert k.job_peer("n1", 42, 3) == "/raps/v1/reports/ranks/n1/42/peers/3"
    assert k.job_peer("n1", 42, 3).startswith(k.node_job_reports_prefix("n1", 42))
    assert not k.job_peer("n10", 42, 3).startswith(k.node_rank_reports_prefix("n1"))
    assert k.rank_escalation("n1", 42, 3) == "/raps/v1/reports/ranks/n1/42/verdicts/3"
    assert k.job_msgstats("n1", 42, 3) == "/raps/v1/reports/ranks/n1/42/msgstats/3"
    assert k.job_hung_verdict(42, 3) == "/raps/v1/jobs/42/verdicts/3"
    assert not k.plan_event("n1", "420-1-2", "x").startswith(k.job_plan_events_prefix("n1", 42))
    assert k.ckpt(42, 3, 7).startswith(k.ckpt_prefix(42, 3))
    assert k.job_rank(42, 3).startswith(k.job_prefix(42))
    assert not k.job(420).startswith(k.job_prefix(42))  # prefixes end with '/'
    for prefix in (k.nodes_prefix(), k.jobs_prefix(), k.plans_prefix()):
        assert prefix.endswith("/") and prefix.startswith(k.prefix)
    assert k.split(k.job_rank(42, 3)) == ("jobs", "42", "ranks", "3")
    assert Keys("/other/").leader() == "/other/leader"
    bad_calls: list[Callable[[], object]] = [
        lambda: k.node(""), lambda: k.node("a/b"), lambda: k.job("1\n"),
        lambda: k.job_rank(1, -1), lambda: k.job_rank(1, True),
        lambda: k.ckpt(1, 0, "7"),  # type: ignore[arg-type]
        lambda: k.split("/elsewhere/x"),
        lambda: Keys("raps/"), lambda: Keys("/raps"), lambda: Keys("/a//b/")]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
    with pytest.raises(ValueError, match="must not contain '/'"):
        k.plan("a/b")
