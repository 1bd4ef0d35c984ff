"""Key files: the cluster key and node keys read only from a private regular file, and
written atomically with mode 0600, never over an existing file."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat

from raps_slurm.errors import ConfigError

KEY_BYTES = 32  # minimum key length: HMAC-SHA256 gains nothing above the 32-byte output
CREATED_KEY_BYTES = 64  # create_key writes one full SHA-256 block of randomness
MAX_KEY_FILE = 4096  # a key file larger than this is not a key file


def accepted_key(path: str) -> bytes | None:
    """The rollover's second key (``detection.accepted_key_file``), None when not set;
    checked like the cluster key."""
    return load_key(path) if path else None


def load_key(path: str, node: str | None = None) -> bytes:
    """Read the cluster key (``node``'s key if given); ConfigError (one line) unless a
    private regular file of >= 32 bytes."""
    what = "cluster key" if node is None else "node key"
    if node is not None:
        hint = (f"make it on the head node (rapsctl config node-key {node} --out FILE) and "
                f"install it at {path} on {node} only")
    else:
        hint = (f"create it once (rapsctl config create-key {path}) and copy it to every "
                "node, like munge.key")
    key = read_private(path, what, hint, MAX_KEY_FILE)
    if len(key) < KEY_BYTES:
        raise ConfigError([f"{what} {path}: holds {len(key)} bytes; must hold at least "
                           f"{KEY_BYTES} (random bytes)"])
    return key


def read_private(path: str, what: str, hint: str, limit: int) -> bytes:
    """The bytes of a secret file: ConfigError (one line: ``what``, ``path``, the problem;
    ``hint`` when it is missing) unless a regular file, mode 0600 or 0400, owned by root
    or this uid, of at most ``limit`` bytes."""

    def bad(problem: str) -> ConfigError:
        return ConfigError([f"{what} {path}: {problem}"])

    # O_NOFOLLOW + fstat check the very file we read (no lstat-then-open race); O_NONBLOCK
    # keeps a FIFO planted at the path from hanging the daemon.
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise bad(f"missing; {hint}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise bad("is a symlink; must be a regular file (mode 0600 or 0400)") from None
        raise bad(f"unreadable: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise bad("not a regular file; must be a regular file (mode 0600 or 0400)")
        mode = stat.S_IMODE(st.st_mode)
        if mode not in (0o600, 0o400):
            raise bad(f"mode {mode:04o} allows more than owner read/write; must be 0600 or "
                      "0400 (chmod 600)")
        if st.st_uid not in (0, os.geteuid()):
            raise bad(f"owned by uid {st.st_uid}; must be owned by root or uid {os.geteuid()}")
        chunks: list[bytes] = []
        total = 0
        while total <= limit:
            chunk = os.read(fd, limit + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise bad(f"unreadable: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise bad(f"larger than {limit} bytes; not a {what} file")
    return data


def create_key(path: str) -> None:
    """Write a new random cluster key atomically with mode 0600; ConfigError if ``path`` exists."""
    write_key(path, secrets.token_bytes(CREATED_KEY_BYTES), "cluster key",
              "every node must share the same key")


def write_key(path: str, key: bytes, what: str, why: str) -> None:
    """Write ``key`` to ``path`` atomically with mode 0600, never over an existing file."""
    if os.path.lexists(path):
        raise ConfigError([f"{what} {path}: already exists; refusing to overwrite it "
                           f"({why})"])
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    try:
        # O_EXCL: never reuse a file someone else prepared; 0600 from the first byte.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError as exc:
        raise ConfigError([f"{what} {path}: cannot create in {directory}: "
                           f"{exc.strerror or exc}"]) from None
    try:
        try:
            os.fchmod(fd, 0o600)  # the umask may have narrowed it, never widened; be exact
            data = memoryview(key)
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)
        # link(), not rename(): rename would silently replace a key created meanwhile by
        # another process, and nodes would disagree on the key; link fails with EEXIST.
        os.link(tmp, path)
    except FileExistsError:
        raise ConfigError([f"{what} {path}: already exists; refusing to overwrite "
                           "it"]) from None
    except OSError as exc:
        raise ConfigError([f"{what} {path}: cannot write: {exc.strerror or exc}"]) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    """Make the new directory entry durable; best effort where directories cannot be fsynced."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the key file itself is synced
    finally:
        os.close(fd)
