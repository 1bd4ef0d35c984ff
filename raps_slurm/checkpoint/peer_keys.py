"""Keys of the chunk transfer between agents: one per (client, server) pair of nodes.

The key of client ``c`` at server ``s`` is ``HMAC-SHA256(node key of s,
"raps-transfer\\0" + c)`` (:func:`pair_key`). A server derives it from its own node key
(``detection.node_key_file``) for whichever client connects; a client holds it as a
*ticket* for that server, made on the head node from the cluster key
(``rapsctl config transfer-tickets``) and installed with the node key
(``detection.transfer_tickets_file``). With both files an agent reads no cluster key, and
root on one compute node can authenticate only as that node: its tickets name it, and no
key it holds lets it pass for another node as a client or as a server.

Without a tickets file an agent derives everything from the cluster key, as ``rapsctl``
on the head node always does (:meth:`PeerKeys.from_cluster`).

Rank-to-rank traffic uses the same pair keys under another label (:func:`rank_key`): a
rank on node ``c`` connecting to a rank on node ``s`` proves ``rank_key(pair key of c at
s, run)``, so only the agents of ``c`` and ``s`` can hand it out (docs/messaging.md,
Authentication).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from raps_slurm.errors import BadDatagram, ConfigError
from raps_slurm.wire.keyfile import read_private, write_key

TICKET_CONTEXT = b"raps-transfer\x00"  # domain separation from the heartbeat node keys
RANK_CONTEXT = b"raps-rank\x00"  # rank traffic keys: another use of the same pair keys
TICKETS_FORMAT = "raps-transfer-tickets/1"
MAX_TICKETS_FILE = 8 << 20  # about 80,000 nodes' tickets


def pair_key(server_key: bytes, client: str) -> bytes:
    """The key client ``client`` uses at the server whose node key is ``server_key``."""
    return hmac.digest(server_key, TICKET_CONTEXT + client.encode("utf-8", "replace"),
                       "sha256")


def rank_key(pair: bytes, run: str) -> bytes:
    """The key of one run's rank traffic from the pair key ``pair`` (client node at server
    node); ``run`` names the run (job id, restart count, registration time), so ranks of an
    earlier run of the job cannot talk to this one's."""
    return hmac.digest(pair, RANK_CONTEXT + run.encode("utf-8", "replace"), "sha256")


class PeerKeys:
    """One node's keys for the transfer protocol: the keys it accepts from a client (as
    a server), and its ticket for a server (as a client)."""

    def __init__(self, node: str, own: Callable[[], list[bytes]],
                 tickets: Callable[[str], bytes | None]) -> None:
        self.node = node
        self._own = own
        self._own_keys: list[bytes] | None = None
        self._tickets = tickets

    @classmethod
    def from_cluster(cls, cluster_key: bytes, node: str,
                     also: bytes | None = None) -> PeerKeys:
        """Everything derived from the cluster key (and a rollover's accepted key, whose
        pair keys a server also accepts)."""
        from raps_slurm.wire.heartbeat import node_key

        roots = [cluster_key] if also is None else [cluster_key, also]
        return cls(node, lambda: [node_key(r, node) for r in roots],
                   lambda server: pair_key(node_key(cluster_key, server), node))

    @classmethod
    def from_files(cls, node: str, own_key: bytes, tickets_path: str,
                   also: bytes | None = None) -> PeerKeys:
        """An agent that holds no cluster key: its node key (and a rollover's other node
        key, accepted as a server) and its tickets file."""
        tickets = load_tickets(tickets_path, node)
        own = [own_key] if also is None else [own_key, also]
        return cls(node, lambda: own, tickets.get)

    def accepting(self, client: str) -> list[bytes]:
        """The keys a client named ``client`` may prove (as this node's server)."""
        if self._own_keys is None:
            self._own_keys = self._own()
        return [pair_key(k, client) for k in self._own_keys]

    def connecting(self, server: str) -> bytes | None:
        """This node's pair key at ``server`` as a client: its ticket, or for itself its
        own key (a node holds no ticket for itself)."""
        return self.accepting(server)[0] if server == self.node else self.ticket(server)

    def ticket(self, server: str) -> bytes | None:
        """This node's key at ``server`` (None: no ticket for it)."""
        try:
            return self._tickets(server)
        except BadDatagram:  # not a node name: nobody holds a ticket for it
            return None


def make_tickets(cluster_key: bytes, node: str, servers: list[str]) -> bytes:
    """The tickets file of ``node`` for ``servers`` (itself left out), as JSON."""
    from raps_slurm.wire.heartbeat import node_key

    node_key(cluster_key, node)  # BadDatagram if ``node`` is no node name
    tickets = {s: pair_key(node_key(cluster_key, s), node).hex()
               for s in sorted(set(servers)) if s != node}
    return json.dumps({"format": TICKETS_FORMAT, "node": node, "tickets": tickets},
                      indent=1).encode() + b"\n"


def create_tickets(path: str, cluster_key: bytes, node: str, servers: list[str]) -> int:
    """Write ``node``'s tickets file (mode 0600, never over an existing file); the number of
    tickets."""
    data = make_tickets(cluster_key, node, servers)
    write_key(path, data, "transfer tickets", "remove the old file first to replace it")
    return len(json.loads(data)["tickets"])


def load_tickets(path: str, node: str) -> dict[str, bytes]:
    """``node``'s tickets (server -> key); ConfigError (one line) if the file is not a
    private tickets file of this node."""
    data = read_private(path, "transfer tickets", "make it on the head node (rapsctl "
                        f"config transfer-tickets {node} --peers NODES --out FILE) and "
                        f"install it at {path} on {node} only", MAX_TICKETS_FILE)

    def bad(problem: str) -> ConfigError:
        return ConfigError([f"transfer tickets {path}: {problem}"])

    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"not JSON ({exc}); remake it with rapsctl config transfer-tickets") from None
    if not isinstance(doc, dict) or doc.get("format") != TICKETS_FORMAT:
        raise bad(f"not a tickets file (expected format {TICKETS_FORMAT!r})")
    if doc.get("node") != node:
        raise bad(f"made for node {doc.get('node')!r}, not {node!r}")
    raw = doc.get("tickets")
    if not isinstance(raw, dict):
        raise bad("'tickets' must map server names to 64 hex digits")
    out: dict[str, bytes] = {}
    for server, text in raw.items():
        if not (isinstance(text, str) and len(text) == 64):
            raise bad(f"ticket for {server!r}: expected 64 hex digits")
        try:
            out[server] = bytes.fromhex(text)
        except ValueError:
            raise bad(f"ticket for {server!r}: expected 64 hex digits") from None
    return out
