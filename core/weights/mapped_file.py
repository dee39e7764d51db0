"""A checkpoint file memory-mapped read-only."""

from __future__ import annotations

import mmap
import os
from pathlib import Path


class MappedFile:
    """Opens and maps `path` (OSError or ValueError if it cannot). `holds(end)` says whether bytes
    up to `end` are still in the file: reading a mapped page the file no longer holds (it was
    truncated after opening) kills the process with SIGBUS instead of raising."""

    def __init__(self, path: str | Path) -> None:
        self._file = open(path, "rb")
        try:
            self.size = os.fstat(self._file.fileno()).st_size
            self.map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None
        except BaseException:
            self._file.close()
            raise

    def holds(self, end: int) -> bool:
        return self.map is not None and end <= min(len(self.map), os.fstat(self._file.fileno()).st_size)

    def release_pages(self) -> None:
        """Unmap the pages read so far from this process's memory; the map stays usable."""
        if self.map is not None and hasattr(mmap, "MADV_DONTNEED"):
            self.map.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
            self.map = None
        self._file.close()
