"""Signal handling of a node process's entry point (not of the node itself).

A node's ``serve()`` loop runs in whatever thread its host gives it: the main thread of a ``pipespec node`` process,
or a worker thread (a test, an actor of a cluster manager), where ``signal.signal`` raises. So the entry points
(``verifier_node.server.run``, ``drafter_node.node.run``) install the handlers, and ``serve()`` only loops until its
``stop()`` is called.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable


def stop_on_signals(stop: Callable[[], None]) -> bool:
    """Call ``stop()`` on SIGTERM and SIGINT (the launcher's stop, Ctrl-C). Only the main thread may install signal
    handlers: elsewhere nothing is installed and False is returned (the host stops the node through ``stop()``)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop())
    return True
