"""Start a throw-away single-member etcd for tests (contract and integration).

    with EtcdServer() as etcd:
        store = EtcdStore([etcd.url])

Ports are picked free on 127.0.0.1, data lives in a temporary directory, and
on exit exactly the process started here is stopped (by its pid) and the
directory removed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from raps_slurm.errors import ClusterError

_DEBIAN_ETCD = "/usr/bin/etcd"


def find_etcd(binary: str | None = None) -> str:
    """The etcd binary to run: ``binary``, Debian's ``/usr/bin/etcd``, or ``etcd`` on PATH."""
    if binary is not None:
        if not os.access(binary, os.X_OK):
            raise ClusterError(f"etcd binary {binary!r} is missing or not executable")
        return binary
    if os.access(_DEBIAN_ETCD, os.X_OK):
        return _DEBIAN_ETCD
    found = shutil.which("etcd")
    if found is None:
        raise ClusterError("etcd is not installed: no /usr/bin/etcd and no etcd on PATH "
                           "(Debian: apt-get install etcd-server)")
    return found


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class TlsFiles:
    """A throw-away CA and the server and client certificates it signed (PEM paths)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls(directory: Path, client_cn: str = "raps") -> TlsFiles:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, with openssl."""
    directory.mkdir(parents=True, exist_ok=True)
    d = directory

    def run(*args: str) -> None:
        proc = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False,
                              cwd=d)
        if proc.returncode != 0:
            raise ClusterError(f"openssl {args[0]} failed: {proc.stderr.strip()[-500:]}")

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
        "/CN=raps-test-ca", "-keyout", "ca.key", "-out", "ca.pem")
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                  "extendedKeyUsage=serverAuth,clientAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, cn in (("server", "127.0.0.1"), ("client", client_cn)):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout",
            f"{name}.key", "-out", f"{name}.csr")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem")
    for key in d.glob("*.key"):
        key.chmod(0o600)
    return TlsFiles(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem",
                    d / "client.key")


class EtcdServer:
    """One etcd member on loopback; use as a context manager or call start()/stop().

    With ``tls`` it serves https and demands a client certificate signed by the CA."""

    def __init__(self, binary: str | None = None, *, startup_timeout: float = 20.0,
                 extra_args: tuple[str, ...] = (), tls: TlsFiles | None = None,
                 tmp_root: str | None = None) -> None:
        self._binary = find_etcd(binary)
        self._tmp_root = tmp_root  # where its data dir goes (e.g. /dev/shm: no disk fsync)
        self._startup_timeout = startup_timeout
        self.tls = tls
        self._extra_args = extra_args + (() if tls is None else (
            "--cert-file", str(tls.server_cert), "--key-file", str(tls.server_key),
            "--client-cert-auth", "--trusted-ca-file", str(tls.ca)))
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: Path | None = None
        self.client_port = 0
        self.peer_port = 0

    @property
    def url(self) -> str:
        """Client URL, e.g. ``http://127.0.0.1:40123``."""
        if self._proc is None:
            raise ClusterError("etcd is not running")
        return f"{self._scheme}://127.0.0.1:{self.client_port}"

    @property
    def _scheme(self) -> str:
        return "http" if self.tls is None else "https"

    @property
    def pid(self) -> int | None:
        """Pid of the etcd process started here, None when stopped."""
        return None if self._proc is None else self._proc.pid

    @property
    def log_path(self) -> Path | None:
        """etcd's stdout/stderr while running (removed on stop)."""
        return None if self._tmp is None else self._tmp / "etcd.log"

    def start(self) -> EtcdServer:
        """Start etcd and wait until it serves; retries on a lost port race."""
        if self._proc is not None:
            return self
        errors: list[str] = []
        for _ in range(3):
            try:
                self._start_once()
                return self
            except ClusterError as exc:
                errors.append(str(exc))
                self.stop()
        raise ClusterError("etcd did not start:\n" + "\n---\n".join(errors))

    def _start_once(self) -> None:
        self._tmp = Path(tempfile.mkdtemp(prefix="raps-etcd-", dir=self._tmp_root))
        self.client_port, self.peer_port = free_port(), free_port()
        while self.peer_port == self.client_port:
            self.peer_port = free_port()
        client = f"{self._scheme}://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [self._binary, "--name", "default", "--data-dir", str(self._tmp / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"default={peer}", "--initial-cluster-state", "new",
                *self._extra_args]
        assert self.log_path is not None
        with open(self.log_path, "wb") as log:
            # New session: a Ctrl-C to the test run must not hit etcd before we stop it.
            self._proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self._startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ClusterError(f"etcd exited with {self._proc.returncode}:\n{self._log_tail()}")
            if self._healthy(client, self.tls):
                return
            time.sleep(0.05)
        raise ClusterError(f"etcd not healthy within {self._startup_timeout}s:\n{self._log_tail()}")

    @staticmethod
    def _healthy(client_url: str, tls: TlsFiles | None = None) -> bool:
        context = None
        if tls is not None:
            context = ssl.create_default_context(cafile=str(tls.ca))
            context.load_cert_chain(str(tls.client_cert), str(tls.client_key))
        try:
            with urllib.request.urlopen(client_url + "/health", timeout=1.0,
                                        context=context) as resp:
                return b'"true"' in resp.read()
        except (OSError, urllib.error.URLError):
            return False

    def _log_tail(self, lines: int = 20) -> str:
        try:
            assert self.log_path is not None
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, AssertionError):
            return "(no log)"

    def etcdctl(self, *args: str, user: str | None = None) -> str:
        """Run ``etcdctl`` (v3 API) against this server; returns stdout, raises on failure."""
        ctl = shutil.which("etcdctl", path=os.path.dirname(self._binary)) or shutil.which("etcdctl")
        if ctl is None:
            raise ClusterError("etcdctl is not installed next to etcd nor on PATH")
        argv = [ctl, "--endpoints", self.url, *(["--user", user] if user else []), *args]
        env = {**os.environ, "ETCDCTL_API": "3"}
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=30,
                              check=False)
        if done.returncode != 0:
            raise ClusterError(f"{' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def stop(self) -> None:
        """Stop the etcd started here (SIGTERM, then SIGKILL) and remove its data."""
        proc, self._proc = self._proc, None
        terminate(proc)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def terminate(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM, then SIGKILL after 10 s, and reap."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class EtcdCluster:
    """``size`` etcd members on loopback, one process each; a member can be stopped and
    started again on its data (production runs three: one may be lost, two stop writes)."""

    def __init__(self, size: int = 3, binary: str | None = None, *,
                 startup_timeout: float = 30.0) -> None:
        self._binary = find_etcd(binary)
        self.size = size
        self._timeout = startup_timeout
        self._tmp = Path(tempfile.mkdtemp(prefix="raps-etcd3-"))
        ports: set[int] = set()
        while len(ports) < 2 * size:
            ports.add(free_port())
        p = sorted(ports)
        self.client_ports, self.peer_ports = p[:size], p[size:]
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * size
        self._started: list[bool] = [False] * size

    @property
    def urls(self) -> list[str]:
        """Client URLs of every member, in member order."""
        return [f"http://127.0.0.1:{port}" for port in self.client_ports]

    def _argv(self, i: int) -> list[str]:
        peers = ",".join(f"m{j}=http://127.0.0.1:{self.peer_ports[j]}" for j in range(self.size))
        return [self._binary, "--name", f"m{i}", "--data-dir", str(self._tmp / f"m{i}"),
                "--listen-client-urls", self.urls[i], "--advertise-client-urls", self.urls[i],
                "--listen-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                "--initial-cluster", peers,
                "--initial-cluster-state", "existing" if self._started[i] else "new",
                "--initial-cluster-token", "raps-test"]

    def _spawn(self, i: int) -> None:
        log = open(self._tmp / f"m{i}.log", "ab")  # noqa: SIM115 - held by the process
        self._procs[i] = subprocess.Popen(self._argv(i), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self._started[i] = True

    def _wait_healthy(self, members: list[int]) -> None:
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if all(EtcdServer._healthy(self.urls[i]) for i in members):
                return
            for i in members:
                proc = self._procs[i]
                if proc is not None and proc.poll() is not None:
                    raise ClusterError(f"etcd member m{i} exited with {proc.returncode}")
            time.sleep(0.1)
        raise ClusterError(f"etcd members {members} not healthy within {self._timeout}s")

    def start(self) -> EtcdCluster:
        """Start every member and wait until the cluster serves (a leader is elected)."""
        for i in range(self.size):
            self._spawn(i)
        self._wait_healthy(list(range(self.size)))
        return self

    def stop_member(self, i: int) -> None:
        """Stop one member (SIGTERM), keeping its data."""
        proc, self._procs[i] = self._procs[i], None
        terminate(proc)

    def start_member(self, i: int, wait: bool = True) -> None:
        """Start a stopped member again on its data; with ``wait``, until it serves."""
        if self._procs[i] is None:
            self._spawn(i)
        if wait:
            self._wait_healthy([i])

    def pause_member(self, i: int, paused: bool = True) -> None:
        """Freeze (SIGSTOP) or thaw (SIGCONT) one member: it accepts connections but
        answers nothing, as a member behind a partition looks to a client."""
        proc = self._procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)

    def stop(self) -> None:
        """Stop every member and remove the data."""
        for i in range(self.size):
            self.pause_member(i, False)
            self.stop_member(i)
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
