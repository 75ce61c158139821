"""Network helpers for the launcher and the controller."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port that was free on `host` a moment ago (the OS picks it; never a fixed port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
