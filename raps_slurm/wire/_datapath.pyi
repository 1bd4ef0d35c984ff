"""A logged message's send and its copy into the log (raps_slurm/wire/_datapath.c)."""

from collections.abc import Sequence

MAX_PARTS: int
STREAMING: int  # large copies bypass the cache (x86-64 with AVX2)

def send_copy(fd: int, head: bytes | memoryview, parts: Sequence[bytes | bytearray | memoryview],
              dst: memoryview, sent: int, copied: int, piece: int, /) -> tuple[int, int, int]: ...
def copy(dst: memoryview, parts: Sequence[bytes | bytearray | memoryview], /) -> int: ...
def address(buf: bytes | bytearray | memoryview, /) -> int: ...
