"""Create the RAPS etcd roles and users (``roles.py``) through etcd's v3 auth API.

``rapsctl etcd-roles --apply`` runs this as etcd's ``root`` (or against an etcd whose
auth is not enabled yet). It goes through :class:`EtcdStore`'s transport (endpoints,
TLS, token, failover, errors) but not through the StateStore contract: roles and users
are etcd's own administration, not RAPS state. etcd3gw has no auth helpers.

Each role ends up with exactly the permissions of the table: missing ones are granted,
others revoked (a role from an older key layout is brought up to date). A missing user is
created, with the password from ``<password_dir>/<user>.password`` (made with 24 random
bytes and mode 0600 when absent) or, without ``password_dir``, with no password (client
certificate authentication: the certificate's CN names the user). An existing user keeps
its password. The shared ``raps-agent`` role has no user: each agent's user
``raps-agent-<node>`` holds it beside its own role. Enabling auth stays a separate step
(docs/store.md, Roles).
"""

from __future__ import annotations

import base64
import os
import secrets
from pathlib import Path
from typing import Any

from raps_slurm.errors import ConfigError, StoreError
from raps_slurm.store.etcd import EtcdStore
from raps_slurm.store.etcd_gateway import range_end
from raps_slurm.store.roles import Grant, Role

_TYPES = {"read": "READ", "write": "WRITE", "readwrite": "READWRITE"}


def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode("ascii")


def _perm(g: Grant) -> tuple[str, str, str]:
    """(type, key, range_end) as etcd returns them (base64; '' for a single key)."""
    end = _b64(range_end(g.key.encode())) if g.prefix else ""
    return _TYPES[g.permission], _b64(g.key), end


def _call(store: EtcdStore, path: str, payload: dict[str, Any], exists: str = ""
          ) -> dict[str, Any] | None:
    """One auth request; None when etcd says ``exists`` (e.g. 'not found')."""
    try:
        return store._call(path, payload)
    except StoreError as exc:
        if exists and exists in str(exc):
            return None
        raise


def _password(password_dir: Path, user: str) -> str:
    path = password_dir / f"{user}.password"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        text = path.read_text().strip()
        if not text:
            raise ConfigError([f"{path}: empty password file"]) from None
        return text
    with os.fdopen(fd, "w") as f:
        password = secrets.token_hex(24)
        f.write(password + "\n")
    return password


def apply_role(store: EtcdStore, role: Role) -> list[str]:
    """Make ``role`` hold exactly its grants; what changed, one line each."""
    out = []
    current = _call(store, "/auth/role/get", {"role": role.name}, "role name not found")
    if current is None:
        _call(store, "/auth/role/add", {"name": role.name}, "role name already exists")
        out.append(f"role {role.name}: created")
        current = {}
    have = {(str(p.get("permType", "READ")), str(p.get("key", "")), str(p.get("range_end", "")))
            for p in current.get("perm") or []}
    want = {_perm(g): g for g in role.grants}
    for perm_type, key, end in sorted(have - want.keys()):
        _call(store, "/auth/role/revoke", {"role": role.name, "key": key, "range_end": end})
        out.append(f"role {role.name}: revoked {perm_type} {base64.b64decode(key).decode()!r}")
    for perm, g in want.items():
        if perm in have:
            continue
        _call(store, "/auth/role/grant", {"name": role.name, "perm": {
            "permType": perm[0], "key": perm[1], "range_end": perm[2]}})
        out.append(f"role {role.name}: granted {g.permission} {g.key}"
                   + ("*" if g.prefix else ""))
    return out


def apply_user(store: EtcdStore, role: Role, password_dir: Path | None) -> list[str]:
    """Make the user named after ``role`` exist and hold it and the roles of ``also``."""
    out = []
    user = _call(store, "/auth/user/get", {"name": role.name}, "user name not found")
    if user is None:
        password = _password(password_dir, role.name) if password_dir else ""
        _call(store, "/auth/user/add", {"name": role.name, "password": password,
                                        "options": {"no_password": not password}},
              "user name already exists")
        out.append(f"user {role.name}: created " + (
            f"(password in {password_dir}/{role.name}.password)" if password_dir
            else "without a password (client certificate CN)"))
        user = {}
    held = user.get("roles") or []
    for name in (role.name, *role.also):
        if name not in held:
            _call(store, "/auth/user/grant", {"user": role.name, "role": name})
            out.append(f"user {role.name}: granted role {name}")
    return out


def apply_roles(store: EtcdStore, roles: tuple[Role, ...], password_dir: Path | None
                ) -> list[str]:
    """Every role and its user; what changed, one line each. Roles and users of nodes not
    in ``roles`` are left as they are (nodes are added a few at a time)."""
    out: list[str] = []
    if password_dir is not None:
        password_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    for role in roles:
        out += apply_role(store, role)
        if role.user:
            out += apply_user(store, role, password_dir)
        elif _call(store, "/auth/user/get", {"name": role.name}, "user name not found"):
            # One agent user for every node was the layout before per-node users.
            out.append(f"user {role.name}: left from an earlier install, it can no longer "
                       f"write node keys; delete it (etcdctl user delete {role.name}) once "
                       f"every agent runs as {role.name}-<node>")
    return out
