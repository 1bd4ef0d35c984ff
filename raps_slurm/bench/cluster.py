"""A private 6-node local cluster for the benchmarks that crash nodes (detect, loss,
recovery, efficiency): a fresh run dir in /tmp, ports from the caller, detection at the
interval asked for and the default strikes and margin; always taken down at the end."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from raps_slurm.testing.cluster import LocalCluster

REPO = Path(__file__).resolve().parents[2]

# With ``quiet``, these keys take their defaults (configs/raps.yaml) instead of the test
# profile's short intervals: what every node and rank reports in the background while a
# job runs (statistics, telemetry, log flushes, DEBUG logs, the leader's polls).
QUIET = (("messagelog", "stats_interval_sec"), ("messagelog", "batch_flush_ms"),
         ("detection", "telemetry_interval_sec"), ("coordinator", "cycle_interval_sec"),
         ("coordinator", "slurm_poll_sec"), ("logging", "level"))


def profile(directory: Path, interval: float, quiet: bool = False,
            defaults_for: tuple[tuple[str, str], ...] = ()) -> Path:
    """configs/test.yaml with detection at ``interval`` and the default strikes and margin,
    and the default receive timeout: the tests' 60 s fails a stuck test fast, but a bench
    moving gigabytes on a loaded machine can make a healthy rank wait longer for a peer."""
    data = yaml.safe_load((REPO / "configs" / "test.yaml").read_text())
    data["messagelog"].pop("recv_timeout_sec", None)
    # Only the node detection changes: the test profile's rank detection (1 s app
    # heartbeats) stays, so that a rank gone on a live node is HUNG within seconds, well
    # inside recovery_timeout_sec (raps-run waits that long for a fenced rank's new epoch).
    data["detection"].update({"kernel_heartbeat_interval_sec": interval, "miss_threshold": 3,
                              "fence_margin_sec": 0.5,
                              "lease_duration_sec": max(15.0, 5 * interval)})
    # ``defaults_for``: more keys at their shipped values (a bench that needs the
    # production rhythm for them)
    if quiet or defaults_for:
        defaults = yaml.safe_load((REPO / "configs" / "raps.yaml").read_text())
        for section, key in (QUIET if quiet else ()) + defaults_for:
            data.setdefault(section, {})[key] = defaults[section][key]
    path = directory / "bench-profile.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@contextmanager
def private_cluster(prefix: str, port: int, interval: float,
                    extra_env: dict[str, str] | None = None, net: str = "lo",
                    quiet: bool = False,
                    defaults_for: tuple[tuple[str, str], ...] = ()) -> Iterator[LocalCluster]:
    """A 6-node cluster in a fresh run dir, detection at ``interval``, on loopback or
    (``net="ns"``) in network namespaces; always taken down."""
    run_dir = Path(tempfile.mkdtemp(prefix=prefix))
    run_dir.chmod(0o755)  # slurmctld runs as SlurmUser
    # in namespace mode a request to an etcd member behind a cut fails over within 1 s,
    # well inside the leader's and the agents' leases (docs/detection.md, Real partitions)
    cluster = LocalCluster(run_dir, port_base=port, profile=profile(run_dir, interval, quiet,
                                                                  defaults_for),
                           net=net, store_timeout=1.0 if net == "ns" else None)
    try:
        cluster.up(extra_env=extra_env)
        yield cluster
    finally:
        cluster.down()
        shutil.rmtree(run_dir, ignore_errors=True)
