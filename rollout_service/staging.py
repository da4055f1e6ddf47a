"""The shared-memory staging file one weight version is received into (tcp, nccl) before the worker loads it."""

from __future__ import annotations

import mmap


class StagingFile:
    """A file in shared memory that one version is received into, mapped while it is written.

    ``view(nbytes)`` sizes and maps it (None for an empty version); the worker maps it again to load it.
    """

    def __init__(self, path: str):
        self.path = path
        self._file = None
        self._map: mmap.mmap | None = None
        self._views: list[memoryview] = []

    def __enter__(self) -> StagingFile:
        return self

    def view(self, nbytes: int) -> memoryview | None:
        self._file = open(self.path, "wb+")  # noqa: SIM115 - closed in __exit__
        self._file.truncate(nbytes)
        if nbytes == 0:
            return None
        self._map = mmap.mmap(self._file.fileno(), nbytes)
        self._views.append(memoryview(self._map))
        return self._views[-1]

    def release(self) -> None:
        for view in self._views:
            view.release()
        self._views.clear()

    def __exit__(self, *exc) -> None:
        self.release()
        if self._map is not None:
            self._map.close()
        if self._file is not None:
            self._file.close()
