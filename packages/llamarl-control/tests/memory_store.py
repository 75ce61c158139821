"""An in-memory key-value store with the part of torch.distributed.Store that stream control uses, for
the tests that run stream mode's machines in one process (no process group, no launcher)."""

from __future__ import annotations

import threading


class DictStore:
    """A thread-safe key-value store with torch.distributed.Store's set/get/check."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def set(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self._data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._data[key]

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return all(k in self._data for k in keys)

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            return value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """As torch's stores: sets `desired` if the value is `expected` ("": no value); returns the
        value after."""
        with self._lock:
            if self._data.get(key, b"") == expected.encode():
                self._data[key] = desired.encode()
            return self._data[key]

    def delete_key(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None
