"""Ranks' output in whole lines, as srun keeps each task's.

The ranks of a node share one output stream: the supervisor's, which is the node's one
Slurm task (the local launcher's, without Slurm). Writing into it directly, two ranks'
partial writes interleave: a program run with ``PYTHONUNBUFFERED=1`` writes each word of
a ``print`` on its own, and two ranks printing at once give ``rankrank  12``. Each rank
therefore writes into pipes of its own (:meth:`Lines.start`), and :class:`Lines` reads them on
one thread and writes only whole lines to the stream, as slurmstepd does for the tasks
of a plain srun: a line longer than :data:`LINE_MAX` goes in pieces of that size, and a
rank's last partial line goes when its pipe closes (the rank, and whatever inherited the
pipe from it, gone). With a label (``raps-run --label``: :func:`label`) each line
starts with it, and a last partial line is ended with a newline, as srun's are.

The thread is the streams' only writer of ranks' output. If a stream blocks (whoever
reads it is slow) the thread waits and the ranks' pipes fill, as a rank writing to the
stream itself would wait; the supervisor's control loop does not. If a stream is gone
(EPIPE), what comes for it is read and dropped, counted in :attr:`Lines.dropped`, so
that no rank blocks on a full pipe. An error nothing here expects ends only the pipe it
came from (:attr:`Lines.cut`): that rank's next write fails, the others' output goes on.
The owner's own lines go through the same thread (:meth:`Lines.say`), so that nothing
else writes to the streams while it does.
"""

from __future__ import annotations

import contextlib
import os
import select
import selectors
import subprocess
import sys
import threading
from typing import Any

LINE_MAX = 64 << 10  # a longer line is written in pieces: the buffer per pipe stays bounded
READ = 64 << 10




def say(line: str, output: Lines | None = None) -> None:
    """Write ``line`` (one whole line) to stderr in one write: through ``output``, the
    ranks' forwarder, while there is one, since their lines go there too."""
    if output is not None:
        output.say(2, line.encode(errors="replace"))
        return
    sys.stderr.write(line)
    sys.stderr.flush()


def label(rank: int, size: int) -> bytes:
    """The label of rank ``rank`` of ``size``, as srun's ``--label`` writes a task's:
    right-aligned to the width of the largest rank (`` 3: `` among 16)."""
    return f"{rank:>{len(str(max(size - 1, 0)))}}: ".encode()


class Lines:
    """Forwards pipes to streams in whole lines, on a thread of its own."""

    def __init__(self) -> None:
        self.dropped = 0  # bytes read for a stream that was gone
        self.cut = 0  # pipes no longer forwarded after an unexpected error
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._new: list[tuple[int, int, bytes]] = []
        self._bufs: dict[int, bytearray] = {}
        self._fresh: dict[int, bool] = {}  # per pipe: the next byte starts a line
        self._gone: set[int] = set()  # streams that raised EPIPE
        self._said: list[tuple[int, bytes]] = []  # the owner's own lines, to write in turn
        self._exited = False
        self._closing = self._stop = False
        self._thread = threading.Thread(target=self._run, name="raps-output", daemon=True)
        self._thread.start()

    def start(self, argv: list[str], label: bytes = b"", **popen: Any
              ) -> subprocess.Popen[bytes]:
        """``subprocess.Popen(argv, **popen)`` with its stdout and stderr forwarded to
        this process's (fds 1 and 2) in whole lines, each starting with ``label``; the
        pipes' write ends stay with the child alone. OSError if it cannot start."""
        (out_r, out_w), (err_r, err_w) = os.pipe2(os.O_CLOEXEC), os.pipe2(os.O_CLOEXEC)
        try:
            proc = subprocess.Popen(argv, stdout=out_w, stderr=err_w, **popen)
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        self.add(out_r, 1, label)
        self.add(err_r, 2, label)
        return proc

    def add(self, pipe: int, stream: int, label: bytes = b"") -> None:
        """Forward read end ``pipe`` (closed here at its end) to file descriptor
        ``stream`` (1 or 2), each line starting with ``label``."""
        os.set_blocking(pipe, False)
        with self._lock:
            self._new.append((pipe, stream, label))
        self._wake()

    def say(self, stream: int, data: bytes) -> None:
        """Write ``data`` (the owner's own whole lines) to ``stream`` between the ranks'
        lines, from the forwarding thread: a rank's long line the thread is writing into
        a full pipe is never cut by it. Written here if the thread has ended."""
        with self._lock:
            queued = not self._exited and self._thread.is_alive()
            if queued:
                self._said.append((stream, data))
        if queued:
            self._wake()
        else:
            self._write(stream, bytearray(data))

    def close(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for every pipe to close, then write what is left of
        each and stop (a pipe a stray process still holds is cut off there)."""
        with self._lock:
            self._closing = True
        self._wake()
        self._thread.join(timeout)
        with self._lock:
            self._stop = True
        self._wake()
        self._thread.join(5.0)
        if not self._thread.is_alive():
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            self._sel.close()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # full: a wake-up is pending
            os.write(self._wake_w, b"w")

    def _run(self) -> None:
        while True:
            with self._lock:
                new, self._new = self._new, []
                said, self._said = self._said, []
                done = self._stop or (self._closing and not self._bufs and not new)
            for pipe, stream, label in new:
                self._sel.register(pipe, selectors.EVENT_READ, (stream, label))
                self._bufs[pipe] = bytearray()
                self._fresh[pipe] = True
            for stream, data in said:
                self._write(stream, bytearray(data))
            if done:
                break
            for key, _ in self._sel.select(1.0):
                if key.data is None:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wake_r, 512):
                            pass
                else:
                    try:
                        self._read(key.fd, key.data)
                    except Exception as exc:  # one pipe's failure, not every rank's
                        self._cut(key.fd, exc)
        for pipe in list(self._bufs):  # stopped with pipes still open: their rests
            try:
                self._end(pipe, self._sel.get_key(pipe).data)
            except Exception as exc:  # the other pipes' rests still go
                self._cut(pipe, exc)
        while True:  # the owner's last lines; later ones it writes itself
            with self._lock:
                said, self._said = self._said, []
                self._exited = not said
            if not said:
                break
            for stream, data in said:
                self._write(stream, bytearray(data))

    def _read(self, pipe: int, to: tuple[int, bytes]) -> None:
        try:
            chunk = os.read(pipe, READ)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._end(pipe, to)
            return
        buf = self._bufs[pipe]
        buf += chunk
        cut = buf.rfind(b"\n") + 1
        if not cut and len(buf) >= LINE_MAX:
            cut = LINE_MAX
        if cut:
            self._put(pipe, to, buf[:cut])
            del buf[:cut]

    def _cut(self, pipe: int, exc: Exception) -> None:
        """Stop forwarding ``pipe`` after an error nothing here expects: its rank gets
        EPIPE (SIGPIPE) on its next write, the other ranks' output goes on."""
        self.cut += 1
        self._bufs.pop(pipe, None)
        self._fresh.pop(pipe, None)
        if pipe in self._sel.get_map():  # else _end closed it: its number may be reused
            self._sel.unregister(pipe)
            os.close(pipe)
        with contextlib.suppress(OSError):
            os.write(2, f"raps: a rank's output is cut off: {exc!r}\n".encode())

    def _end(self, pipe: int, to: tuple[int, bytes]) -> None:
        rest = self._bufs.pop(pipe)
        self._sel.unregister(pipe)
        os.close(pipe)
        if rest:
            if to[1] and not rest.endswith(b"\n"):
                rest += b"\n"  # labelled, a last partial line is ended, as srun does
            self._put(pipe, to, rest)
        del self._fresh[pipe]

    def _put(self, pipe: int, to: tuple[int, bytes], data: bytearray) -> None:
        """Write ``data`` (whole lines, or a piece of a long or last line) to its stream,
        with the pipe's label at the start of each line."""
        stream, label = to
        if label:
            out, fresh = bytearray(), self._fresh[pipe]
            parts = data.split(b"\n")
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                if last and not part:
                    break  # data ended with a newline
                if fresh:
                    out += label
                out += part
                if not last:
                    out += b"\n"
                fresh = not last
            self._fresh[pipe] = fresh
            data = out
        self._write(stream, data)

    def _write(self, stream: int, data: bytearray) -> None:
        view = memoryview(data)
        while view and stream not in self._gone:
            try:
                view = view[os.write(stream, view):]
            except BlockingIOError:  # a stream someone left non-blocking: wait for room
                select.select([], [stream], [], 1.0)
            except OSError:  # EPIPE, EBADF: nobody reads this stream any more
                self._gone.add(stream)
        self.dropped += len(view)
