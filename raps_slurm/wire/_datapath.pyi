"""A logged message's send and its copy into the log (raps_slurm/wire/_datapath.c)."""

from collections.abc import Sequence

MAX_PARTS: int
STREAMING: int  # large copies bypass the cache (x86-64 with AVX2)
FOLDING: int  # the copy can take the CRC-32C in its pass (AVX-512 and VPCLMULQDQ)

def send_copy(fd: int, head: bytes | memoryview, parts: Sequence[bytes | bytearray | memoryview],
              dst: memoryview, sent: int, copied: int, piece: int, crc: int, fold: bool, /
              ) -> tuple[int, int, int, int | None]: ...
def copy(dst: memoryview, parts: Sequence[bytes | bytearray | memoryview], fold: bool, /
         ) -> int | None: ...
def sum(buf: bytes | bytearray | memoryview, crc: int, /) -> int: ...
def address(buf: bytes | bytearray | memoryview, /) -> int: ...
