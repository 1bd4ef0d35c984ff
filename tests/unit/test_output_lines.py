"""launcher/output.py: ranks' output forwarded in whole lines, with real processes
writing into real pipes."""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from raps_slurm.launcher.output import LINE_MAX, Lines, label

# print() with several arguments and PYTHONUNBUFFERED=1: one write(2) per word
WORDY = ("import sys\nr = sys.argv[1]\nfor i in range(300):\n"
         "    print('rank', r, 'line', i, 'of', 300, 'words', flush=True)\n")


def _start(lines: Lines, streams: tuple[int, int], code: str, *args: str,
           label: bytes = b"") -> subprocess.Popen[bytes]:
    """``code`` in a process whose stdout and stderr go to ``streams`` through ``lines``
    (``streams`` stand in for this process's fds 1 and 2)."""
    (out_r, out_w), (err_r, err_w) = os.pipe2(os.O_CLOEXEC), os.pipe2(os.O_CLOEXEC)
    try:
        proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=out_w,
                                stderr=err_w, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    finally:
        os.close(out_w)
        os.close(err_w)
    lines.add(out_r, streams[0], label)
    lines.add(err_r, streams[1], label)
    return proc


def _files(tmp_path: Path) -> tuple[int, int]:
    out = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    err = os.open(tmp_path / "err", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    return out, err


def test_four_processes_printing_word_by_word_give_whole_lines(tmp_path: Path) -> None:
    out, err = _files(tmp_path)
    lines = Lines()
    try:
        procs = [_start(lines, (out, err), WORDY, str(r)) for r in range(4)]
        assert [p.wait(60) for p in procs] == [0] * 4
    finally:
        lines.close(10)
        os.close(out)
        os.close(err)
    text = (tmp_path / "out").read_text()
    got = text.splitlines()
    assert len(got) == 1200 and text.endswith("\n")
    pattern = re.compile(r"rank (\d) line (\d+) of 300 words")
    assert all(pattern.fullmatch(line) for line in got), [g for g in got
                                                          if not pattern.fullmatch(g)][:3]
    for r in range(4):  # each process's lines, all of them, in its order
        mine = [int(m.group(2)) for m in map(pattern.fullmatch, got) if m and m[1] == str(r)]
        assert mine == list(range(300))
    assert (tmp_path / "err").read_text() == "" and lines.dropped == 0


def test_a_last_partial_line_a_long_line_and_stderr(tmp_path: Path) -> None:
    out, err = _files(tmp_path)
    long = LINE_MAX + 1000
    code = (f"import sys\nsys.stdout.write('x' * {long} + '\\n')\nsys.stdout.flush()\n"
            "sys.stderr.write('warn: ')\nsys.stderr.flush()\nsys.stderr.write('half')\n"
            "sys.stdout.write('no newline at the end')\n")
    lines = Lines()
    try:
        assert _start(lines, (out, err), code).wait(30) == 0
    finally:
        lines.close(10)
        os.close(out)
        os.close(err)
    assert (tmp_path / "out").read_text() == "x" * long + "\nno newline at the end"
    assert (tmp_path / "err").read_text() == "warn: half"


def test_a_label_starts_every_line_once(tmp_path: Path) -> None:
    out, err = _files(tmp_path)
    long = 2 * LINE_MAX + 5  # written in three pieces: labelled at its start only
    code = (f"import sys\nprint('a', 'b', flush=True)\nprint(flush=True)\n"
            f"sys.stdout.write('x' * {long} + '\\nlast')\nsys.stdout.flush()\n"
            "print('oops', file=sys.stderr)\n")
    lines = Lines()
    try:
        assert _start(lines, (out, err), code, label=b"7: ").wait(30) == 0
    finally:
        lines.close(10)
        os.close(out)
        os.close(err)
    # the last partial line ended, as srun ends a labelled task's
    assert (tmp_path / "out").read_text() == f"7: a b\n7: \n7: {'x' * long}\n7: last\n"
    assert (tmp_path / "err").read_text() == "7: oops\n"


def test_labels_are_as_wide_as_the_largest_rank_as_sruns() -> None:
    assert [label(r, n) for r, n in ((0, 1), (9, 10), (3, 16), (15, 16), (7, 101))] == [
        b"0: ", b"9: ", b" 3: ", b"15: ", b"  7: "]


def test_a_stream_nobody_reads_any_more_blocks_no_writer(tmp_path: Path) -> None:
    dead_r, dead_w = os.pipe()
    os.close(dead_r)  # writing to dead_w now fails with EPIPE
    lines = Lines()
    code = "import sys\nfor i in range(4096):\n    sys.stdout.write('y' * 255 + '\\n')\n"
    try:
        proc = _start(lines, (dead_w, dead_w), code)
        assert proc.wait(30) == 0  # 1 MiB, far more than a pipe holds: it was read
    finally:
        lines.close(10)
        os.close(dead_w)
    assert lines.dropped == 4096 * 256


def test_a_pipe_still_held_is_cut_off_at_close(tmp_path: Path) -> None:
    out, err = _files(tmp_path)
    r, w = os.pipe2(os.O_CLOEXEC)
    lines = Lines()
    try:
        lines.add(r, out)
        os.write(w, b"whole\npart")
        deadline = time.monotonic() + 10
        while (tmp_path / "out").read_bytes() != b"whole\n":
            assert time.monotonic() < deadline, (tmp_path / "out").read_bytes()
            time.sleep(0.02)
        started = time.monotonic()
        lines.close(0.5)  # the write end is still open here: nothing more will come
        assert time.monotonic() - started < 3
    finally:
        os.close(w)
        os.close(out)
        os.close(err)
    assert (tmp_path / "out").read_bytes() == b"whole\npart"


class _Faulty(Lines):
    """Lines whose writing fails, as a bug would, for a line that says so."""

    def _put(self, pipe: int, to: tuple[int, bytes], data: bytearray) -> None:
        if b"boom" in data:
            raise RuntimeError("injected")
        super()._put(pipe, to, data)


def test_an_unexpected_error_cuts_off_one_pipe_and_the_others_go_on(tmp_path: Path) -> None:
    out, err = _files(tmp_path)
    lines = _Faulty()
    # After "boom" this process writes 1 MiB: far more than a pipe holds, so it would
    # block for ever if its pipe were neither read nor closed.
    loud = ("import sys\nprint('boom', flush=True)\ntry:\n"
            "    for i in range(4096):\n        sys.stdout.write('z' * 255 + '\\n')\n"
            "    sys.stdout.flush()\nexcept BrokenPipeError:\n    sys.exit(9)\n")
    try:
        bad = _start(lines, (out, err), loud)
        good = _start(lines, (out, err), WORDY, "1")
        assert bad.wait(30) == 9  # its writes failed: its pipe was closed
        assert good.wait(60) == 0
    finally:
        lines.close(10)
        os.close(out)
        os.close(err)
    got = (tmp_path / "out").read_text().splitlines()
    assert [g for g in got if g.startswith("rank")] == \
        [f"rank 1 line {i} of 300 words" for i in range(300)]
    assert "boom" not in got and lines.cut == 1


def test_the_owners_own_line_never_cuts_a_ranks_line(tmp_path: Path) -> None:
    # The stream is a pipe of one page nobody reads yet: the thread is stuck midway
    # through a rank's 60 KiB line when the owner says something.
    r, w = os.pipe2(os.O_CLOEXEC)
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    out, err = _files(tmp_path)
    lines = Lines()
    size = 60 << 10
    code = ("import sys\nfor c in 'abc':\n    sys.stdout.write(c * " + str(size) +
            " + '\\n')\n    sys.stdout.flush()\n")
    try:
        proc = _start(lines, (w, err), code)
        deadline = time.monotonic() + 10
        while _pending(r) < 4096:
            assert time.monotonic() < deadline, "the thread wrote nothing"
            time.sleep(0.01)
        started = time.monotonic()
        lines.say(w, b"owner says hi\n")
        assert time.monotonic() - started < 0.5  # queued: the owner does not wait
        got = bytearray()
        want = 3 * (size + 1) + len(b"owner says hi\n")
        while len(got) < want:
            assert time.monotonic() < deadline + 20, bytes(got[-100:])
            if select.select([r], [], [], 1.0)[0]:
                got += os.read(r, 1 << 16)
        assert proc.wait(30) == 0
    finally:
        lines.close(10)
        for fd in (r, w, out, err):
            os.close(fd)
    assert sorted(bytes(got).split(b"\n")) == sorted(
        [b"", b"owner says hi", b"a" * size, b"b" * size, b"c" * size])


def _pending(fd: int) -> int:
    """Bytes waiting in pipe ``fd``."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
