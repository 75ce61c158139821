"""A child process of a rank ends when the rank is gone, whatever it is doing meanwhile.

A rank's helper processes (reward workers) talk to it over a socket, but their main thread may sit in a
user's function for a long time (a reward that hangs until its deadline), so they would notice a closed
socket only afterwards; a rank killed with SIGKILL must not leave them holding memory. A daemon thread
watches the parent's pid instead. Standard library only: it runs in processes that import little.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable


def exit_with_parent(poll_s: float = 0.5, *, on_exit: Callable[[int], None] | None = None) -> None:
    """Ends this process (`os._exit(1)`) within about `poll_s` of its parent's exit; `on_exit(parent_pid)`
    runs first (e.g. a line in a log)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        if on_exit is not None:
            on_exit(parent)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
