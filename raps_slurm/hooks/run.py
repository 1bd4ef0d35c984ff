"""The four hooks. Each reads its Slurm environment, talks to etcd at most, and returns fast.

- ``prolog-slurmctld`` (SlurmUser, on the controller): registers the job run
  (job id + restart count) with compare-and-swap; see ``core.jobs.registration``.
- ``epilog-slurmctld`` (SlurmUser): marks the run ended. Deletes nothing: epilogs
  also run before a requeue, and the requeued job restores from its data.
- ``prolog`` (root, each node): creates the job's checkpoint dir (root, 0700: the
  chunk store belongs to the agent). Never contacts etcd, never fails the job.
- ``epilog`` (root, each node): records in the hook log what the job leaves on the
  node. Deletes nothing.

The wrappers run ``python -I`` (isolated: no ``PYTHON*`` variables, no user site, no
current directory on the path), so nothing a user left in the environment or a
directory is imported by a hook that runs as root or SlurmUser. The hook log is opened
with ``O_NOFOLLOW`` and must be a regular file: a symlink planted in its place is
refused with one line on stderr, where the hook then logs.

Failure policy: a node hook always exits 0 (a failing node prolog drains the node).
``prolog-slurmctld`` exits 0 when etcd is unreachable or the budget runs out, unless
``hooks.fail_open`` is false: then it exits 1 and Slurm requeues the job held.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import signal
import stat
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import TextIO

from raps_slurm.config import Config, load_config, node_dir
from raps_slurm.core.jobs import JobRecord, record_from_env, registration
from raps_slurm.errors import ConfigError, RapsError, RecordError, StoreError
from raps_slurm.store import Delete, Guard, Keys, Put, StateStore, open_store

log = logging.getLogger("raps.hooks")

# A share of the budget for each etcd request, so a slow first endpoint leaves time
# for the next one and for the one-line report.
_REQUEST_SHARE = 0.4


class BudgetExceeded(RapsError):
    """The hook ran out of ``hooks.time_budget_sec``."""


def run_hook(hook: str, config_path: str | None, env: Mapping[str, str]) -> int:
    """Run ``hook`` for the job in ``env``; the exit status for Slurm."""
    started = time.monotonic()
    job = env.get("SLURM_JOB_ID", "?")
    try:
        cfg = load_config(config_path)
    except ConfigError as exc:
        _setup_log(None, hook, job)
        log.error("config: %s; job left alone", exc)
        return 0
    _setup_log(cfg.hooks.log_dir, hook, job)
    budget = cfg.hooks.time_budget_sec
    strict = hook == "prolog-slurmctld" and not cfg.hooks.fail_open
    try:
        with _deadline(budget - (time.monotonic() - started)):
            if hook == "prolog-slurmctld":
                return _prolog_slurmctld(cfg, env, budget)
            if hook == "epilog-slurmctld":
                return _epilog_slurmctld(cfg, env, budget)
            if hook == "prolog":
                return _prolog(cfg, env)
            return _epilog(cfg, env)
    except BudgetExceeded:
        reason = f"time budget hooks.time_budget_sec={budget:g}s exceeded"
    except StoreError as exc:
        reason = f"etcd {', '.join(cfg.store.endpoints)}: {exc}"
    except (ValueError, OSError) as exc:
        reason = str(exc)
    if strict:
        log.error("%s; failing the prolog (hooks.fail_open is false): Slurm requeues "
                  "the job held", reason)
        return 1
    log.error("%s; job continues without RAPS registration", reason)
    return 0


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise BudgetExceeded in this (main) thread once ``seconds`` have passed."""
    def expire(signum: int, frame: FrameType | None) -> None:
        raise BudgetExceeded("time budget exceeded")

    if seconds <= 0:
        raise BudgetExceeded("time budget exceeded")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


LOG_MODE = 0o600


def open_log(path: Path) -> TextIO:
    """``path`` opened to append (created with mode 0600), never through a symlink and
    only if it is a regular file; OSError naming what is wrong otherwise."""
    # O_NONBLOCK: a FIFO planted in its place must not hang the hook until its budget.
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | \
        os.O_NONBLOCK
    try:
        fd = os.open(path, flags, LOG_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(exc.errno, f"refusing hook log {path}: it is a symbolic link "
                                     "(opened with O_NOFOLLOW; remove it)") from None
        raise OSError(exc.errno, f"cannot open hook log {path}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"refusing hook log {path}: not a regular file "
                                        "(remove it)")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "a", encoding="utf-8", errors="backslashreplace")
    except BaseException:
        os.close(fd)
        raise


def _setup_log(log_dir: str | None, hook: str, job: str) -> None:
    """Log lines to ``<log_dir>/<hook>.log``, or stderr when that cannot be written
    (saying why on stderr when the file is there but refused)."""
    handler: logging.Handler
    try:
        if not log_dir:
            raise FileNotFoundError("no log dir")
        handler = logging.StreamHandler(open_log(Path(log_dir) / f"{hook}.log"))
    except OSError as exc:
        if exc.errno not in (None, errno.ENOENT, errno.EACCES, errno.EROFS):
            print(f"raps {hook}: {exc.strerror}; logging to stderr", file=sys.stderr)
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s raps {hook}[%(process)d] job={job}: %(message)s", "%Y-%m-%dT%H:%M:%S"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


def _open(cfg: Config, budget: float) -> tuple[StateStore, Keys]:
    timeout = max(0.1, min(cfg.store.timeout_sec, budget * _REQUEST_SHARE))
    return open_store(dataclasses.replace(cfg.store, timeout_sec=timeout))


def _prolog_slurmctld(cfg: Config, env: Mapping[str, str], budget: float) -> int:
    record = record_from_env(env, time.time())
    if record is None:
        return 0
    store, keys = _open(cfg, budget)
    with store:
        key = keys.job(record.job_id)
        for _ in range(3):  # a concurrent writer (another prolog run) makes CAS retry
            kv = store.get(key)
            existing = None
            if kv is not None:
                try:
                    existing = JobRecord.from_json(key, kv.value)
                except RecordError as exc:
                    log.error("%s; replacing it", exc)
            action = registration(existing, record)
            if action == "same":
                log.info("run %d already registered", record.restart_count)
                return 0
            if action == "requeue" and existing is not None:
                record = record.after(existing)  # its checkpoints may be on the old nodes
            ops: list[Put | Delete] = [Put(key, record.to_json())]
            if action == "requeue":
                ops.append(Delete(keys.job_map(record.job_id)))  # the leader maps the new run
            elif action == "reuse" and kv is not None:
                ops.append(Delete(keys.job_prefix(record.job_id), prefix=True))
                ops.append(Delete(keys.job_reports_prefix(record.job_id), prefix=True))
            if action in ("create", "reuse"):
                ops.append(Delete(keys.purged(record.job_id)))  # a new job with an old id
            guard = Guard(key, kv.mod_revision if kv is not None else 0)
            if store.transaction([guard], ops):
                if action == "reuse":
                    # What the old job's nodes reported (too many ranges for the txn).
                    old = set(existing.nodes) if existing is not None else set()
                    for node in sorted(old | set(record.nodes)):
                        store.delete_prefix(keys.node_job_reports_prefix(node, record.job_id))
                        store.delete_prefix(keys.job_plan_events_prefix(node, record.job_id))
                spec = record.spec
                log.info("registered run %d (%s): uid %d, %d nodes, spares=%d "
                         "ranks_per_node=%d", record.restart_count, action, record.owner_uid,
                         len(record.nodes), spec.spares, spec.ranks_per_node)
                return 0
    raise StoreError(f"{key} kept changing during registration")


def _epilog_slurmctld(cfg: Config, env: Mapping[str, str], budget: float) -> int:
    job_id = env.get("SLURM_JOB_ID", "")
    restarts = env.get("SLURM_JOB_RESTART_COUNT", "0") or "0"
    if not (job_id.isascii() and job_id.isdigit() and restarts.isascii() and restarts.isdigit()):
        raise ValueError(f"SLURM_JOB_ID={job_id!r} SLURM_JOB_RESTART_COUNT={restarts!r}: "
                         "expected numbers")
    code_text = env.get("SLURM_JOB_EXIT_CODE2", "").partition(":")[0]
    exit_code = int(code_text) if code_text.isascii() and code_text.isdigit() else None
    store, keys = _open(cfg, budget)
    with store:
        key = keys.job(job_id)
        for _ in range(3):
            kv = store.get(key)
            if kv is None:
                log.info("not registered (etcd was unreachable at its start?): nothing to mark")
                return 0
            record = JobRecord.from_json(key, kv.value)
            # On a requeue Slurm counts the restart before this epilog runs: the run
            # that ended is then the one before SLURM_JOB_RESTART_COUNT.
            if record.restart_count not in (int(restarts), int(restarts) - 1) \
                    or record.state == "ended":
                log.info("run %s is not the registered running run (%d, %s): left alone",
                         restarts, record.restart_count, record.state)
                return 0
            ended = record.ended(time.time(), exit_code)
            if store.compare_and_swap(key, ended.to_json(), kv.mod_revision):
                log.info("run %d ended (exit code %s); its data stays until Slurm shows "
                         "the job finished for good", record.restart_count, exit_code)
                return 0
    raise StoreError(f"{key} kept changing while marking the run ended")


def job_dir(cfg: Config, node: str, job_id: str) -> Path:
    """The node-local checkpoint dir of a job."""
    return Path(node_dir(cfg.checkpoint.local_dir, node)) / f"job-{job_id}"


def _node_job(env: Mapping[str, str]) -> tuple[str, str]:
    node, job_id = env.get("SLURMD_NODENAME", ""), env.get("SLURM_JOB_ID", "")
    if not node or not (job_id.isascii() and job_id.isdigit()):
        raise ValueError(f"SLURMD_NODENAME={node!r} SLURM_JOB_ID={job_id!r}: "
                         "expected a node name and a job number")
    return node, job_id


def _prolog(cfg: Config, env: Mapping[str, str]) -> int:
    node, job_id = _node_job(env)
    path = job_dir(cfg, node, job_id)
    existed = path.is_dir()
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    if path.is_symlink() or not path.is_dir():
        raise OSError(f"{path} exists and is not a directory")
    os.chmod(path, 0o700)
    log.info("%s: checkpoint dir %s %s", node, path, "kept" if existed else "created")
    return 0


def _epilog(cfg: Config, env: Mapping[str, str]) -> int:
    node, job_id = _node_job(env)
    path = job_dir(cfg, node, job_id)
    if path.is_dir():
        files = sum(len(f) for _, _, f in os.walk(path))
        log.info("%s: %s kept (%d files) until the job is finished for good", node, path, files)
    else:
        log.info("%s: no checkpoint dir %s", node, path)
    return 0
