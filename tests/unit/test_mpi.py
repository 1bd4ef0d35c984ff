"""raps_slurm.mpi: the matching engine and its determinants (pure logic on a scripted
runtime), buffers and operations, the runtime hooks it needs (real contexts on loopback),
and unsupported calls."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from raps_slurm.checkpoint.codec import CodecParams
from raps_slurm.mpi import MPI, shim_env
from raps_slurm.mpi.buffers import as_buffer
from raps_slurm.mpi.engine import ANY_SOURCE, ANY_TAG, D_MATCH, D_NEG, D_TEST, DET, OBJ, Engine
from raps_slurm.mpi.types import OPS, TYPES
from raps_slurm.runtime.context import Context, Settings
from raps_slurm.runtime.ports import LocalPort


class ScriptedRuntime:
    """Stands in for a Context (pure logic): messages per source arrive when the test
    says; recv_any takes the source the test scripted; records are kept."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.inbox: dict[int, deque[bytes]] = {s: deque() for s in range(size)}
        self.order: deque[int] = deque()  # arrival order across sources
        self.sent: list[tuple[int, bytes]] = []
        self.records: list[bytes] = []
        self.progress: list[int] = []  # the steps reported

    def arrive(self, src: int, ctx: int, tag: int, obj: Any) -> None:
        from raps_slurm.mpi.engine import ENVELOPE

        self.inbox[src].append(ENVELOPE.pack(OBJ, ctx, tag) + pickle.dumps(obj))
        self.order.append(src)

    def try_recv_buffer(self, src: int) -> bytes | None:
        # Only what "has arrived": the head of the global order decides visibility.
        if self.inbox[src] and src in self.order:
            self.order.remove(src)
            return self.inbox[src].popleft()
        return None

    def recv_any_buffer(self, sources: list[int], timeout: float | None = None,
                        into: Any = None) -> tuple[int, bytes]:
        for src in list(self.order):
            if src in sources:
                self.order.remove(src)
                return src, self.inbox[src].popleft()
        raise AssertionError(f"would block for ever waiting for {sources}")

    def recv_buffer(self, src: int, timeout: float | None = None, into: Any = None) -> bytes:
        return self.recv_any_buffer([src], timeout)[1]  # whole messages only: no ``into``

    def send(self, dst: int, payload: bytes) -> None:
        self.sent.append((dst, payload))

    def send_parts(self, dst: int, parts: list[bytes | memoryview]) -> None:
        self.send(dst, b"".join(parts))

    def send_small(self, dst: int, head: bytes, data: bytes | memoryview) -> None:
        self.send_parts(dst, [head, data])

    def record(self, data: bytes) -> None:
        self.records.append(data)

    def heartbeat(self, step: int, items: int = 0) -> None:
        self.progress.append(step)

    def poll(self) -> None:
        """Nothing to read: what has arrived is what the test scripted."""


def engine(rt: ScriptedRuntime) -> Engine:
    return Engine(rt)  # type: ignore[arg-type]


def obj(e: Engine, r: Any) -> Any:
    return pickle.loads(e.wait(r).data)


def test_messages_from_one_sender_never_overtake_and_tags_select() -> None:
    rt = ScriptedRuntime(0, 3)
    for i, tag in enumerate([5, 6, 5, 6]):
        rt.arrive(1, 0, tag, f"m{i}")
    e = engine(rt)
    assert obj(e, e.post(0, 1, 6)) == "m1"      # skips the tag-5 message, keeps it
    assert obj(e, e.post(0, 1, ANY_TAG)) == "m0"
    assert obj(e, e.post(0, 1, 5)) == "m2"
    assert obj(e, e.post(0, ANY_SOURCE, ANY_TAG)) == "m3"
    assert rt.records == [DET.pack(D_MATCH, 4, 1, 0, 0)]  # only the any-source match


def test_posted_receives_match_in_posting_order_and_contexts_never_mix() -> None:
    rt = ScriptedRuntime(0, 3)
    e = engine(rt)
    a = e.post(0, ANY_SOURCE, 1)   # first posted: wins a message both could take
    b = e.post(0, 2, ANY_TAG)
    coll = e.post(1, 2, ANY_TAG)   # another context (a collective's)
    rt.arrive(2, 1, 0, "collective")
    rt.arrive(2, 0, 1, "p2p-1")
    rt.arrive(2, 0, 3, "p2p-3")
    assert obj(e, coll) == "collective"
    assert obj(e, a) == "p2p-1"
    assert obj(e, b) == "p2p-3"


def test_any_source_takes_the_first_message_in_and_records_it() -> None:
    rt = ScriptedRuntime(0, 4)
    e = engine(rt)
    r = e.post(0, ANY_SOURCE, 0)
    rt.arrive(3, 0, 0, "from 3")
    rt.arrive(1, 0, 0, "from 1")
    assert obj(e, r) == "from 3"
    assert rt.records == [DET.pack(D_MATCH, 1, 3, 0, 0)]
    # Among unexpected messages, the one taken in first (drain goes by rank).
    rt.arrive(2, 0, 0, "from 2")
    e.drain()
    assert obj(e, e.post(0, ANY_SOURCE, 0)) == "from 1"


def test_a_replayed_any_source_receive_takes_the_recorded_source() -> None:
    # Failure-free: rank 3's message came first. Replayed: rank 1's comes first, but the
    # recorded decision says 3, and the later receive gets rank 1's message.
    rt = ScriptedRuntime(0, 4)
    e = engine(rt)
    e.load({}, [DET.pack(D_MATCH, 1, 3, 0, 0)])
    assert rt.records == [DET.pack(D_MATCH, 1, 3, 0, 0)]  # recorded again, same order
    rt.arrive(1, 0, 0, "from 1")
    rt.arrive(3, 0, 0, "from 3")
    first = e.post(0, ANY_SOURCE, ANY_TAG)
    second = e.post(0, ANY_SOURCE, ANY_TAG)
    assert obj(e, first) == "from 3"
    assert obj(e, second) == "from 1"
    # The second decision was not recorded before: it is taken live, and recorded.
    assert rt.records[1:] == [DET.pack(D_MATCH, 2, 1, 0, 0)]


def test_test_outcomes_are_recorded_and_replayed() -> None:
    rt = ScriptedRuntime(0, 2)
    e = engine(rt)
    r = e.post(0, 1, 0)
    assert e.decision(lambda: (1, 0, 0) if r.msg else None, lambda _: None) is None
    assert rt.records == []            # a negative outcome is cheap ...
    e.send(1, 0, 0, OBJ, b"x")         # ... until a send may depend on it
    assert rt.records == [DET.pack(D_NEG, 1, 0, 0, 0)]
    rt.arrive(1, 0, 0, "late")
    assert e.decision(lambda: (1, 0, 0) if r.msg else None, lambda _: None) == (1, 0, 0)
    assert rt.records[-1] == DET.pack(D_TEST, 2, 1, 0, 0)
    # Replay: the message is there at once, but test 1 was negative; test 2 positive.
    rt2 = ScriptedRuntime(0, 2)
    rt2.arrive(1, 0, 0, "late")
    e2 = engine(rt2)
    e2.load({}, rt.records)
    r2 = e2.post(0, 1, 0)
    waited: list[Any] = []
    assert e2.decision(lambda: (1, 0, 0), lambda rep: waited.append(rep)) is None
    assert e2.decision(lambda: None, lambda rep: waited.append(rep)) == (1, 0, 0)
    assert waited == [(1, 0, 0)]
    assert obj(e2, r2) == "late"


def test_iprobe_outcome_is_replayed_with_its_source() -> None:
    rt = ScriptedRuntime(0, 3)
    rt.arrive(2, 0, 4, "probe me")
    e = engine(rt)
    m = e.probe(0, ANY_SOURCE, ANY_TAG, block=False)
    assert m is not None and (m.src, m.tag) == (2, 4)
    assert rt.records == [DET.pack(D_TEST, 1, 1, 2, 4)]
    rt2 = ScriptedRuntime(0, 3)
    rt2.arrive(1, 0, 4, "other")
    rt2.arrive(2, 0, 4, "probe me")
    e2 = engine(rt2)
    e2.load({}, rt.records)
    m2 = e2.probe(0, ANY_SOURCE, ANY_TAG, block=False)
    assert m2 is not None and m2.src == 2


def test_checkpoint_state_keeps_unexpected_messages_and_refuses_pending_receives() -> None:
    rt = ScriptedRuntime(0, 3)
    rt.arrive(1, 0, 9, "kept")
    e = engine(rt)
    e.drain()
    st = e.state()
    e2 = engine(ScriptedRuntime(0, 3))
    e2.load(pickle.loads(pickle.dumps(st)), [])
    assert obj(e2, e2.post(0, 1, 9)) == "kept"
    e2.post(0, 1, 1)
    with pytest.raises(RuntimeError, match="1 receive request"):
        e2.state()


def test_every_send_to_another_rank_is_reported_progress_kept_across_a_checkpoint() -> None:
    rt = ScriptedRuntime(0, 3)
    e = engine(rt)
    e.send(1, 0, 0, OBJ, b"a")
    e.send(0, 0, 0, OBJ, b"to itself")  # not sent anywhere: no progress
    e.send(2, 0, 0, OBJ, b"b")
    assert rt.progress == [1, 2]
    rt2 = ScriptedRuntime(0, 3)
    e2 = engine(rt2)
    e2.load(pickle.loads(pickle.dumps(e.state())), [])
    e2.send(1, 0, 0, OBJ, b"c")
    assert rt2.progress == [3]


def test_buffer_specifications() -> None:
    a = np.arange(6, dtype=np.float64)
    assert as_buffer(a).datatype is TYPES["DOUBLE"]
    b = as_buffer([a, MPI.DOUBLE])
    assert b.count == 6 and bytes(b.raw()) == a.tobytes()
    assert as_buffer([a, 2, MPI.DOUBLE]).count == 2
    assert as_buffer([a, (2, 3), MPI.DOUBLE]).array.tolist() == [3.0, 4.0]
    assert as_buffer([a, MPI.INT]).count == 12          # reinterpreted, as MPI would
    assert as_buffer(bytearray(5)).datatype is TYPES["BYTE"]
    with pytest.raises(TypeError, match="is not a buffer"):
        as_buffer(object())
    with pytest.raises(TypeError, match="not contiguous"):
        as_buffer(np.zeros((4, 4))[:, 1])
    with pytest.raises(ValueError, match="exceed the buffer"):
        as_buffer([a, 7, MPI.DOUBLE])


def test_operations_on_objects_and_arrays() -> None:
    assert OPS["MAXLOC"]((3, 2), (3, 1)) == (3, 1)    # a tie: the lower index
    assert OPS["MINLOC"]((1, 5), (2, 0)) == (1, 5)
    pair = TYPES["DOUBLE_INT"].dtype
    x = np.array([(1.0, 0), (5.0, 0)], dtype=pair)
    y = np.array([(2.0, 1), (5.0, 1)], dtype=pair)
    got = OPS["MAXLOC"].apply(x, y)
    assert got["v"].tolist() == [2.0, 5.0] and got["i"].tolist() == [1, 0]
    assert OPS["LAND"].apply(np.array([1, 0], np.int32), np.array([1, 1], np.int32)).tolist() \
        == [1, 0]
    assert OPS["BOR"](0b01, 0b10) == 0b11


def test_unsupported_calls_raise_not_implemented_naming_them() -> None:
    with pytest.raises(NotImplementedError, match=r"MPI\.Win is not supported"):
        MPI.Win  # noqa: B018
    with pytest.raises(NotImplementedError, match=r"MPI\.Intracomm\.Igatherv is not"):
        MPI.COMM_WORLD.Igatherv  # noqa: B018
    with pytest.raises(NotImplementedError, match=r"MPI\.Request\.Cancel is not"):
        MPI.REQUEST_NULL.Cancel()
    with pytest.raises(NotImplementedError, match=r"MPI\.Request\.Get_status is not"):
        MPI.REQUEST_NULL.Get_status  # noqa: B018
    with pytest.raises(NotImplementedError, match=r"MPI\.Datatype\.Create_darray"):
        MPI.DOUBLE.Create_darray  # noqa: B018
    # Names looked up on the classes themselves, and on an operation.
    with pytest.raises(NotImplementedError, match=r"MPI\.Op\.Create is not"):
        MPI.Op.Create  # noqa: B018
    with pytest.raises(NotImplementedError, match=r"MPI\.Comm\.Get_parent is not"):
        MPI.Comm.Get_parent  # noqa: B018
    with pytest.raises(NotImplementedError, match=r"MPI\.Op\.Get_attr is not"):
        MPI.SUM.Get_attr  # noqa: B018
    with pytest.raises(NotImplementedError, match=r"MPI\.Status\.Get_elements_x is not"):
        MPI.Status().Get_elements_x  # noqa: B018
    # hasattr() is False for them: programs probe for optional features that way.
    assert not hasattr(MPI, "Win") and not hasattr(MPI.COMM_WORLD, "Ineighbor_alltoall")
    assert not hasattr(MPI.Op, "Create")
    assert hasattr(MPI, "Wtime") and hasattr(MPI.COMM_WORLD, "Allreduce")


def test_every_call_the_issue_lists_exists() -> None:
    """The mpi4py names docs/mpi.md promises (each is run against Open MPI by
    tests/unit/test_mpi_programs.py)."""
    for name in ("COMM_WORLD", "COMM_SELF", "ANY_SOURCE", "ANY_TAG", "PROC_NULL", "IN_PLACE",
                 "Status", "Request", "Wtime", "Abort", "Finalize", "DOUBLE", "INT",
                 "DOUBLE_INT", "SUM", "PROD", "MAX", "MIN", "LAND", "LOR", "BAND", "BOR",
                 "MAXLOC", "MINLOC"):
        assert hasattr(MPI, name), name
    comm_calls = """Get_rank Get_size send recv isend irecv sendrecv probe iprobe Send Recv
        Isend Irecv Sendrecv barrier bcast reduce allreduce gather scatter allgather alltoall
        Bcast Reduce Allreduce Gather Scatter Allgather Alltoall Dup Split Free Abort""".split()  # noqa: SIM905
    for name in comm_calls:
        assert callable(getattr(MPI.COMM_WORLD, name)), name
    for name in ("Wait", "Test", "Waitall", "Waitany", "Testall", "Testany"):
        assert callable(getattr(MPI.Request, name)), name
    assert MPI.DOUBLE_INT.Get_size() == 16 and MPI.FLOAT_INT.Get_size() == 8  # C layout


def test_comm_methods_called_on_the_class_as_mpi4py_allows(tmp_path: Path) -> None:
    """``MPI.Comm.Dup(comm)``, ``MPI.Comm.Split(comm, ...)``: mpi4py defines them on
    Comm. One rank started without a launcher, the shim first on its path."""
    prog = tmp_path / "prog.py"
    prog.write_text("from mpi4py import MPI\n"
                    "d = MPI.Comm.Dup(MPI.COMM_WORLD)\n"
                    "s = MPI.Comm.Split(d, 0, 0)\n"
                    "c = MPI.Comm.Clone(s)\n"
                    "print(d.Get_size(), s.Get_size(), c.allreduce(3), isinstance(c, MPI.Comm))\n"
                    "MPI.Comm.Free(c)\n")
    env = {k: v for k, v in shim_env(os.environ).items() if not k.startswith("RAPS_")}
    p = subprocess.run([sys.executable, str(prog)], env=env, cwd=tmp_path, text=True,
                       capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["1", "1", "3", "True"]


def test_shim_env_puts_the_mpi4py_shim_first(tmp_path: Path) -> None:
    env = shim_env({"PYTHONPATH": "/a:/b"})
    first = env["PYTHONPATH"].split(":")[0]
    assert (Path(first) / "mpi4py" / "__init__.py").is_file()
    assert env["PYTHONPATH"].endswith(":/a:/b")
    assert shim_env(env)["PYTHONPATH"] == env["PYTHONPATH"]  # idempotent


# --- the runtime hooks, real contexts on loopback --------------------------------------

S = Settings(flush_ms=20, checkpoint_interval=1e9, recv_timeout=20.0, buffer_bytes=16 << 20)


def ctx(root: Path, rank: int, size: int, epoch: int = 1) -> Context:
    return Context(LocalPort(root, "1", rank, epoch, CodecParams(avg_chunk_kb=4)), rank, size,
                   epoch, S)


def test_runtime_recv_any_try_recv_and_records_survive_a_restart(tmp_path: Path) -> None:
    c0, c1, c2 = (ctx(tmp_path, r, 3) for r in range(3))
    try:
        for c in (c0, c1, c2):
            assert c.restore() is None
        assert c0.try_recv(1) is None
        c2.send(0, b"two")
        src, msg = c0.recv_any([1, 2])
        assert (src, msg) == (2, b"two")
        c0.record(b"decision-1")
        c0.checkpoint({"x": np.zeros(1)})
        c0.record(b"decision-2")
        c0.record(b"decision-3")
        c0.send(1, b"depends on them")   # the records are durable before this leaves
        assert c1.recv(0) == b"depends on them"
        c1.send(0, b"one")
        got: list[bytes | None] = []
        t = threading.Thread(target=lambda: got.append(c0.recv_any([1, 2])[1]))
        t.start()
        t.join(10)
        assert got == [b"one"]
    finally:
        c0.close()  # a crash: nothing more flushed
    again = ctx(tmp_path, 0, 3, epoch=2)
    try:
        assert again.restore() is not None
        assert again.replayed_records() == [b"decision-2", b"decision-3"]
    finally:
        for c in (again, c1, c2):
            c.close()
    with pytest.raises(ValueError, match="expected other ranks"):
        c1.recv_any([1])


def test_a_copy_keeps_a_padded_pairs_bytes_as_they_are() -> None:
    import numpy as np

    from raps_slurm.mpi.types import OPS, copy_array

    dt = np.dtype([("v", np.float64), ("i", np.int32)], align=True)  # 4 bytes of padding
    for n in range(1, 40):
        a = np.zeros(n, dtype=dt)
        a["v"], a["i"] = np.arange(n) % 5, 1
        assert copy_array(a).tobytes() == a.tobytes(), n
        # MAXLOC's result carries its inputs' padding, not whatever memory held
        assert OPS["MAXLOC"].apply(copy_array(a), copy_array(a)).tobytes() == a.tobytes()
    strided = np.zeros(8, dtype=dt)[::2]
    assert copy_array(strided).tobytes() == bytes(4 * 16)
    plain = np.arange(6.0)
    assert copy_array(plain).tobytes() == plain.tobytes() and copy_array(plain) is not plain
