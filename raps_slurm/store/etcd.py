"""StateStore over etcd v3's JSON gateway, through ``etcd3gw``.

etcd3gw gives us the HTTP session (TLS), URLs and its error mapping; the
payloads are built here because its helpers lose what the contract needs
(``put`` drops the revision, keys are encoded as latin-1), and the watch is
our own: etcd3gw's watch thread swallows a lost stream (its iterator then
blocks forever) and its connect has no timeout.

Authentication: etcd3gw has none. With ``user``/``password`` this module asks
``/v3/auth/authenticate`` for a token, sends it as the ``Authorization``
header, and fetches a new one once when etcd says the token is invalid
(simple tokens expire after ``--auth-token-ttl``, 300 s by default).
The user needs read-write permission on the RAPS key prefix.

Failover: endpoints are tried in order, starting with the last one that
answered. A write whose outcome a retry could falsify (create, CAS, delete)
is retried on the next endpoint only if the request never left this host;
otherwise ``StoreUnavailable`` says the outcome is unknown.
"""

from __future__ import annotations

import base64
import contextlib
import json
import queue
import socket
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import requests
from etcd3gw import exceptions as gw_exc
from etcd3gw.client import Etcd3Client

from raps_slurm.errors import (
    HistoryCompacted,
    LeaseExpired,
    StoreError,
    StorePermissionDenied,
    StoreUnavailable,
)
from raps_slurm.store.base import (
    Guard,
    KeyValue,
    Lease,
    Put,
    StateStore,
    StoreStatus,
    TxnOp,
    Watch,
    WatchEvent,
    check_key,
    check_revision,
    check_ttl,
    check_txn,
    check_value,
)
from raps_slurm.store.etcd_gateway import (
    GRPC_NOT_FOUND,
    GRPC_UNAUTHENTICATED,
    GW_TRANSPORT,
    TRANSPORT_ERRORS,
    b64,
    error_detail,
    header_revision,
    key_value,
    never_sent,
    range_end,
    refused,
    short_error,
)


class EtcdStore(StateStore):
    """StateStore on an etcd >= 3.4 cluster (``endpoints`` like ``http://127.0.0.1:2379``).

    No I/O happens before the first call. ``timeout`` bounds each request.
    """

    def __init__(self, endpoints: Sequence[str], *, timeout: float = 5.0,
                 ca_cert: str | None = None, cert_file: str | None = None,
                 key_file: str | None = None, user: str | None = None,
                 password: str | None = None) -> None:
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        if not endpoints:
            raise ValueError("EtcdStore needs at least one endpoint")
        if (cert_file is None) != (key_file is None):
            raise ValueError("cert_file and key_file must be given together")
        if (user is None) != (password is None):
            raise ValueError("user and password must be given together")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self._endpoints = tuple(endpoints)
        self._timeout = timeout
        self._user, self._password = user, password
        self._session = requests.Session()
        # The configured CA and nothing else: with trust_env, REQUESTS_CA_BUNDLE or
        # CURL_CA_BUNDLE in a daemon's environment would replace ``ca_cert``, and an
        # HTTP(S)_PROXY would route etcd traffic through a proxy.
        self._session.trust_env = False
        if ca_cert is not None:
            self._session.verify = ca_cert
        if cert_file is not None and key_file is not None:
            self._session.cert = (cert_file, key_file)
        self._clients = [self._client(url) for url in self._endpoints]
        self._preferred = 0
        self._token: str | None = None
        self._auth_lock = threading.Lock()
        self._watches: weakref.WeakSet[_EtcdWatch] = weakref.WeakSet()
        self._closed = False
        self._members: list[str] = []  # client URLs of every member (quorum_lost)
        self._prober: ThreadPoolExecutor | None = None
        self._probe_lock = threading.Lock()

    def _client(self, url: str) -> Etcd3Client:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"etcd endpoint must look like http://HOST:PORT, got {url!r}")
        # api_path fixed: skips etcd3gw's /version probe (one round trip per client).
        return Etcd3Client(host=parts.hostname, port=parts.port or 2379, protocol=parts.scheme,
                           timeout=self._timeout, api_path="/v3/", session=self._session)

    def __repr__(self) -> str:
        return f"EtcdStore({list(self._endpoints)!r})"

    # -- transport ------------------------------------------------------------

    def _order(self) -> list[int]:
        first = self._preferred
        return [first] + [i for i in range(len(self._clients)) if i != first]

    def _authenticate(self, client: Etcd3Client, stale: str | None) -> None:
        with self._auth_lock:
            if self._token is not None and self._token != stale:
                return  # another thread already renewed it
            try:
                # headers=None entry: never send a stale token to authenticate.
                result = client.post(client.get_url("/auth/authenticate"),
                                     json={"name": self._user, "password": self._password},
                                     headers={"Authorization": None})
            except gw_exc.Etcd3Exception as exc:
                if isinstance(exc, GW_TRANSPORT):
                    raise
                raise StoreError(f"etcd {client.base_url}: authentication as {self._user!r} "
                                 f"failed: {error_detail(exc)[1]}") from exc
            self._token = str(result["token"])
            self._session.headers["Authorization"] = self._token

    def _post(self, client: Etcd3Client, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        for attempt in range(2):
            if self._user is not None and self._token is None:
                self._authenticate(client, None)
            token = self._token
            try:
                result: dict[str, Any] = client.post(client.get_url(path), json=payload)
                return result
            except gw_exc.Etcd3Exception as exc:
                if isinstance(exc, GW_TRANSPORT):
                    raise
                code, message = error_detail(exc)
                if code == GRPC_UNAUTHENTICATED and self._user is not None and attempt == 0:
                    self._authenticate(client, token)
                    continue
                if code == GRPC_NOT_FOUND and "lease not found" in message:
                    raise LeaseExpired(f"etcd: {message}") from exc
                if "user name is empty" in message:
                    message += " (etcd has auth enabled: configure a user and password)"
                if "permission denied" in message:  # this user's roles (docs/store.md, Roles)
                    raise StorePermissionDenied(f"etcd {client.base_url}{path}: {message} "
                                                f"for user {self._user!r}") from exc
                raise StoreError(f"etcd {client.base_url}{path}: {message}") from exc
        raise AssertionError("unreachable")

    def _call(self, path: str, payload: dict[str, Any], *, retry_unknown: bool = True
              ) -> dict[str, Any]:
        if self._closed:
            raise StoreUnavailable("etcd store is closed")
        failures: list[str] = []
        for i in self._order():
            client = self._clients[i]
            try:
                result = self._post(client, path, payload)
            except TRANSPORT_ERRORS as exc:
                failures.append(f"{self._endpoints[i]}: {short_error(exc)}")
                if retry_unknown or never_sent(exc):
                    continue
                raise StoreUnavailable(
                    f"etcd {self._endpoints[i]} failed during {path} ({short_error(exc)}); "
                    "the write may or may not have been applied: read before retrying") from exc
            self._preferred = i
            return result
        raise StoreUnavailable("no etcd endpoint answered (timeout "
                               f"{self._timeout}s): " + "; ".join(failures))

    def _open_watch(self, request: dict[str, Any]) -> tuple[requests.Session, requests.Response]:
        """Open a watch stream on the first endpoint that accepts it (own session: the
        stream holds its connection for as long as the watch lives)."""
        if self._closed:
            raise StoreUnavailable("etcd store is closed")
        failures: list[str] = []
        for i in self._order():
            client = self._clients[i]
            if self._user is not None and self._token is None:
                self._authenticate(client, None)
            session = requests.Session()
            session.trust_env = False  # as for the main session
            session.verify, session.cert = self._session.verify, self._session.cert
            session.headers.update(self._session.headers)
            try:
                resp = session.post(client.get_url("/watch"), json=request, stream=True,
                                    timeout=(self._timeout, None))
            except requests.RequestException as exc:
                session.close()
                failures.append(f"{self._endpoints[i]}: {short_error(exc)}")
                continue
            if resp.status_code != 200:
                text = resp.text[:200]
                session.close()
                if resp.status_code >= 500:
                    failures.append(f"{self._endpoints[i]}: HTTP {resp.status_code} {text}")
                    continue
                raise StoreError(f"etcd {self._endpoints[i]} refused the watch: {text}")
            return session, resp
        raise StoreUnavailable("no etcd endpoint accepted the watch: " + "; ".join(failures))

    # -- StateStore -----------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        result = self._call("/kv/range", {"key": b64(check_key(key).encode())})
        kvs = result.get("kvs", [])
        return key_value(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        raw = check_key(prefix, "prefix").encode()
        result = self._call("/kv/range", {"key": b64(raw), "range_end": b64(range_end(raw))})
        return [key_value(item) for item in result.get("kvs", [])]  # etcd sorts by key

    @staticmethod
    def _put_request(key: str, value: bytes, lease: Lease | None) -> dict[str, Any]:
        request: dict[str, Any] = {"key": b64(check_key(key).encode()),
                                   "value": b64(check_value(value))}
        if lease is not None:
            request["lease"] = str(lease.id)
        return request

    def put(self, key: str, value: bytes, lease: Lease | None = None) -> int:
        return header_revision(self._call("/kv/put", self._put_request(key, value, lease)))

    def create(self, key: str, value: bytes, lease: Lease | None = None) -> bool:
        return self._txn_put(key, value, "CREATE", 0, lease)

    def compare_and_swap(self, key: str, value: bytes, mod_revision: int,
                         lease: Lease | None = None) -> bool:
        return self._txn_put(key, value, "MOD", check_revision(mod_revision), lease)

    def _txn_put(self, key: str, value: bytes, target: str, revision: int,
                 lease: Lease | None) -> bool:
        put = self._put_request(key, value, lease)
        field = "create_revision" if target == "CREATE" else "mod_revision"
        txn = {"compare": [{"key": put["key"], "result": "EQUAL", "target": target,
                            field: str(revision)}],
               "success": [{"request_put": put}], "failure": []}
        return bool(self._call("/kv/txn", txn, retry_unknown=False).get("succeeded", False))

    def transaction(self, guards: Sequence[Guard], ops: Sequence[TxnOp]) -> bool:
        check_txn(guards, ops)
        compare = [{"key": b64(g.key.encode()), "result": "EQUAL", "target": "MOD",
                    "mod_revision": str(g.mod_revision)} for g in guards]
        success: list[dict[str, Any]] = []
        for op in ops:
            if isinstance(op, Put):
                success.append({"request_put": self._put_request(op.key, op.value, op.lease)})
            else:
                raw = op.key.encode()
                request = {"key": b64(raw)}
                if op.prefix:
                    request["range_end"] = b64(range_end(raw))
                success.append({"request_delete_range": request})
        txn = {"compare": compare, "success": success, "failure": []}
        return bool(self._call("/kv/txn", txn, retry_unknown=False).get("succeeded", False))

    def delete(self, key: str) -> bool:
        result = self._call("/kv/deleterange", {"key": b64(check_key(key).encode())},
                            retry_unknown=False)
        return int(result.get("deleted", 0)) > 0

    def delete_prefix(self, prefix: str) -> int:
        raw = check_key(prefix, "prefix").encode()
        result = self._call("/kv/deleterange",
                            {"key": b64(raw), "range_end": b64(range_end(raw))},
                            retry_unknown=False)
        return int(result.get("deleted", 0))

    def grant_lease(self, ttl: int) -> Lease:
        # A retried grant may leak one unused lease; it expires on its own.
        result = self._call("/lease/grant", {"TTL": check_ttl(ttl), "ID": 0})
        if result.get("error"):
            raise StoreError(f"etcd refused a lease of {ttl}s: {result['error']}")
        return Lease(id=int(result["ID"]), ttl=int(result["TTL"]))

    def refresh_lease(self, lease: Lease) -> None:
        result = self._call("/lease/keepalive", {"ID": str(lease.id)})
        if "error" in result:
            raise StoreUnavailable(f"etcd lease keep-alive failed: {result['error']}")
        # An expired or unknown lease comes back with no TTL (zero is omitted).
        if int(result.get("result", {}).get("TTL", 0)) <= 0:
            raise LeaseExpired(f"lease {lease.id:x} has expired or was revoked")

    def revoke_lease(self, lease: Lease) -> None:
        with contextlib.suppress(LeaseExpired):  # already gone: so are its keys
            self._call("/kv/lease/revoke", {"ID": str(lease.id)})

    def watch_prefix(self, prefix: str, start_revision: int | None = None) -> Watch:
        raw = check_key(prefix, "prefix").encode()
        create: dict[str, Any] = {"key": b64(raw), "range_end": b64(range_end(raw))}
        if start_revision is not None:
            if start_revision < 1:
                raise ValueError(f"start_revision must be >= 1, got {start_revision}")
            create["start_revision"] = str(start_revision)
        for attempt in range(2):
            watch = _EtcdWatch(self, {"create_request": create})
            token = self._token
            try:
                watch.start(self._timeout * (len(self._clients) + 1))
            except StoreError as exc:
                if attempt == 0 and self._user is not None and "Unauthenticated" in str(exc):
                    self._authenticate(self._clients[self._preferred], token)
                    continue
                raise
            self._watches.add(watch)
            return watch
        raise AssertionError("unreachable")

    def current_revision(self) -> int:
        # status needs no key permission, unlike a range read
        return header_revision(self._call("/maintenance/status", {}))

    def status(self) -> StoreStatus:
        st = self._call("/maintenance/status", {})
        try:
            raised = self._call("/maintenance/alarm", {"action": "GET"}).get("alarms") or []
        except StoreError:  # alarms need more rights than status; size still says a lot
            raised = []
        alarms = tuple(sorted({str(a.get("alarm", "?")) for a in raised if isinstance(a, dict)}))
        size = int(st.get("dbSize", 0))
        return StoreStatus(header_revision(st), size, int(st.get("dbSizeInUse", size)),
                           str(st.get("version", "")), alarms)

    def quorum_lost(self, timeout: float = 1.0) -> bool:
        # Callers (an agent deciding whether to fence) need an answer within their own
        # interval: members are asked at once, each bounded by ``timeout``, and the member
        # list (served by any member, quorum or not) is kept once read.
        wait = min(self._timeout, timeout)
        members = self._members
        if not members:
            for url in self._endpoints:
                try:
                    listed = self._probe(url, "/cluster/member/list", wait)
                except (requests.RequestException, ValueError):
                    continue
                members = [str(m["clientURLs"][0]) for m in listed.get("members", [])
                           if isinstance(m, dict) and m.get("clientURLs")]
                break
            if not members:
                return False
            self._members = members
        with self._probe_lock:
            if self._prober is None:
                self._prober = ThreadPoolExecutor(max_workers=8, thread_name_prefix="etcd-probe")
            prober = self._prober
        out = sum(prober.map(lambda url: self._member_out(url, wait), members))
        return out > len(members) / 2

    def _member_out(self, url: str, timeout: float) -> bool:
        """True if the member is provably outside any quorum: not running, or no leader."""
        try:
            st = self._probe(url, "/maintenance/status", timeout)
        except (requests.RequestException, ValueError) as exc:
            return refused(exc)  # not running there; a timeout proves nothing
        errors = " ".join(str(e) for e in st.get("errors") or [])
        return str(st.get("leader", "0")) in ("", "0") or "no leader" in errors

    def _probe(self, url: str, path: str, timeout: float) -> dict[str, Any]:
        """One request to one member, no failover (a member's own view)."""
        resp = self._session.post(url.rstrip("/") + "/v3" + path, json={}, timeout=timeout)
        resp.raise_for_status()
        result: dict[str, Any] = resp.json()
        return result

    def compact(self, revision: int) -> None:
        if isinstance(revision, bool) or not isinstance(revision, int) or revision < 1:
            raise ValueError(f"revision must be a positive integer, got {revision!r}")
        try:
            self._call("/kv/compaction", {"revision": revision})
        except StoreError as exc:
            if "has been compacted" in str(exc):
                return  # compacted there or later already: what was asked holds
            raise

    def close(self) -> None:
        self._closed = True
        if self._prober is not None:
            self._prober.shutdown(wait=False)
        for watch in list(self._watches):
            watch.cancel()
        self._session.close()


def _shutdown(resp: requests.Response) -> None:
    """Unblock a reader thread stuck in recv() on a streaming response."""
    try:
        # Closing the response alone does not wake a thread blocked in recv();
        # shutdown() on the socket does (same trick as etcd3gw's Watcher.stop).
        sock = socket.fromfd(resp.raw._fp.fileno(), socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()
    except (AttributeError, OSError, ValueError):
        pass  # already closed
    resp.close()


class _EtcdWatch(Watch):
    """A watch stream read by a daemon thread into a queue."""

    def __init__(self, store: EtcdStore, request: dict[str, Any]) -> None:
        self._store = store
        self._request = request
        self._events: queue.Queue[WatchEvent | StoreError | None] = queue.Queue()
        self._cancelled = threading.Event()
        self._created = threading.Event()
        self._startup_error: StoreError | None = None
        self._failure: StoreError | None = None
        self._lock = threading.Lock()
        self._session: requests.Session | None = None
        self._resp: requests.Response | None = None
        self._thread = threading.Thread(target=self._run, name="raps-etcd-watch", daemon=True)

    def start(self, timeout: float) -> None:
        """Return once etcd confirmed the watch, so no later write can be missed."""
        self._thread.start()
        if not self._created.wait(timeout):
            self.cancel()
            raise StoreUnavailable(f"etcd did not confirm the watch within {timeout:.0f}s")
        if self._startup_error is not None:
            self.cancel()
            raise self._startup_error

    def _run(self) -> None:
        try:
            session, resp = self._store._open_watch(self._request)
            with self._lock:
                self._session, self._resp = session, resp
            if self._cancelled.is_set():
                return  # cancel() may have run before _resp was set
            buf = b""
            for chunk in resp.iter_content(chunk_size=None):
                # One JSON object per line; the gateway flushes one HTTP chunk
                # per message today, but nothing promises it: buffer lines.
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        self._handle(json.loads(line))
            if buf.strip():
                self._handle(json.loads(buf))
            raise StoreUnavailable("etcd closed the watch stream")
        except Exception as exc:  # every failure must reach next()
            if self._cancelled.is_set():
                return
            err = exc if isinstance(exc, StoreError) else StoreUnavailable(
                f"etcd watch stream lost: {short_error(exc)}")
            if self._created.is_set():
                self._events.put(err)
            else:
                self._startup_error = err
                self._created.set()
        finally:
            self._close_stream()  # queued events stay readable

    def _handle(self, message: dict[str, Any]) -> None:
        if "error" in message:
            raise StoreUnavailable(f"etcd watch stream failed: {message['error']}")
        result = message.get("result", {})
        if result.get("canceled"):
            compacted = int(result.get("compact_revision", 0))
            if compacted:
                raise HistoryCompacted(f"watch start revision is compacted; the oldest "
                                       f"available is {compacted}")
            raise StoreError("etcd cancelled the watch: "
                             + str(result.get("cancel_reason") or "no reason given"))
        if result.get("created"):
            self._created.set()
        for ev in result.get("events", []):
            kv = ev["kv"]
            deleted = ev.get("type") == "DELETE"
            self._events.put(WatchEvent(
                kind="delete" if deleted else "put",
                key=base64.b64decode(kv["key"]).decode("utf-8", "replace"),
                value=b"" if deleted else base64.b64decode(kv.get("value", "")),
                mod_revision=int(kv.get("mod_revision", 0)),
                create_revision=0 if deleted else int(kv.get("create_revision", 0))))

    def _close_stream(self) -> None:
        with self._lock:
            resp, session = self._resp, self._session
            self._resp = self._session = None
        if resp is not None:
            _shutdown(resp)
        if session is not None:
            session.close()

    def next(self, timeout: float) -> WatchEvent | None:
        if self._cancelled.is_set():
            return None
        if self._failure is not None:
            raise self._failure
        try:
            item = self._events.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None
        if isinstance(item, StoreError):
            self._failure = item
            raise item
        return item  # None: cancelled while waiting

    def cancel(self) -> None:
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        self._events.put(None)  # wake a next() blocked in another thread
        self._close_stream()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._store._timeout)
