"""Node processes forked from a warm interpreter, so that a test cluster's start-up does not pay for importing torch
and transformers again in every node (about 4 s of CPU per node on a 2-core machine, two nodes per cluster, some 150
clusters in ``make test``).

Two halves:

* the *zygote* (``python tests/node_zygote.py SOCKET``, started once per test session by tests/conftest.py): imports
  the node packages and the tiny models' transformers classes, then listens on a Unix socket; for each request it
  forks a child that runs the node exactly as tests/node_entry.py's script would (same argv, environment, working
  directory, stdio), and reports the child's exit status.
* the *proxy* (:func:`delegate`, what tests/node_entry.py's ``main`` runs when :data:`ZYGOTE_ENV` is set): the process
  ``launch.Cluster`` started. It hands its argv, environment, working directory and stdio to the zygote, forwards
  SIGTERM/SIGINT to the forked node and exits with the node's status; if the proxy is killed (SIGKILL, or the
  launcher dying), a lifeline pipe closes and the node kills itself, as a killed node process would be dead.

A node started inside another network namespace (``launch.Cluster(prefix=["ip", "netns", "exec", …])``) is not
forked (the zygote lives in the test's namespace): the proxy then runs the node itself, as without a zygote.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import selectors
import signal
import socket
import sys
import time

#: ``SOCKET_PATH?netns=NETNS`` of the session's zygote (NETNS: the ``/proc/self/ns/net`` link it runs in); set by
#: tests/conftest.py in the test process, so node processes inherit it.
ZYGOTE_ENV = "PIPESPEC_TEST_NODE_ZYGOTE"
_NETNS_MARK = "?netns="
#: How long a proxy waits for a zygote still importing (it is started at the beginning of the session).
CONNECT_TIMEOUT_S = 120.0
#: What the zygote imports before it forks: the node packages and the modelling code of the tiny test models.
PRELOAD = (
    "runtime.launch", "verifier_node.server", "drafter_node.node", "drafter_node.lm_drafter",
    "drafter_node.early_exit", "drafter_node.prompt_lookup", "drafter_node.universal", "drafter_node.mtp",
    "drafter_node.mtp_drafter", "drafter_node.suffix", "shared.costs.measure", "shared.costs.cache",
    "shared.sampling", "node_entry",
    "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.gpt2.modeling_gpt2",
)


def _netns() -> str:
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


def zygote_env_value(path: str) -> str:
    return f"{path}{_NETNS_MARK}{_netns()}"


# ------------------------------------------------------------------------------------------------ the proxy


def _connect(path: str) -> socket.socket | None:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)


def delegate(argv: list[str]) -> int | None:
    """Run this node in a child of the zygote and return its exit status; None when there is no zygote to use (not
    set, another network namespace, not reachable): the caller then runs the node itself."""
    path, _, netns = os.environ.get(ZYGOTE_ENV, "").rpartition(_NETNS_MARK)
    if not path or netns != _netns():
        return None
    sock = _connect(path)
    if sock is None:
        print(f"node_zygote: no zygote at {path}; starting the node in this process", file=sys.stderr, flush=True)
        return None
    lifeline_read, lifeline_write = os.pipe()
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode() + b"\n"
    fds = array.array("i", [0, 1, 2, lifeline_read])
    sock.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    os.close(lifeline_read)
    reader = sock.makefile("rb")
    pid = json.loads(reader.readline())["pid"]

    def forward(signum, _frame):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    line = reader.readline()
    status = json.loads(line)["status"] if line else 1
    if status < 0:  # killed by a signal: die of the same signal, so Popen.returncode reads as the node's would
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os.close(lifeline_write)
    return status


# ----------------------------------------------------------------------------------------------- the zygote


def _run_child(request: dict, fds: list[int]) -> int:
    """In the forked child: become the node process the request describes and run it."""
    import threading

    stdin, stdout, stderr, lifeline = fds
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)

    def die_with_the_proxy() -> None:
        while os.read(lifeline, 1):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=die_with_the_proxy, daemon=True, name="zygote-lifeline").start()
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = list(request["argv"])
    import node_entry

    try:
        code = node_entry.run_here(sys.argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    for thread in threading.enumerate():  # what interpreter shutdown does: wait for non-daemon threads
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    import atexit
    import logging

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    return int(code or 0)


def _receive(conn: socket.socket) -> tuple[dict, list[int]] | None:
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, ancdata, _flags, _addr = conn.recvmsg(1 << 20, socket.CMSG_SPACE(4 * array.array("i").itemsize * 4))
        if not chunk:
            return None
        data += chunk
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                fds.extend(got)
    return json.loads(data), fds


def serve(path: str) -> None:
    for name in PRELOAD:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # proxies connect once the preload is done
    listener.listen(64)
    wake_read, wake_write = socket.socketpair()
    wake_read.setblocking(False)
    wake_write.setblocking(False)
    signal.set_wakeup_fd(wake_write.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is wake_read:
                with contextlib.suppress(BlockingIOError):
                    wake_read.recv(4096)
                continue
            conn, _ = listener.accept()
            received = _receive(conn)
            if received is None:
                conn.close()
                continue
            request, fds = received
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
                    signal.signal(signum, signal.SIG_DFL)
                selector.close()
                for sock in (listener, wake_read, wake_write, conn, *children.values()):
                    sock.close()
                code = 1
                try:
                    code = _run_child(request, fds)
                finally:
                    os._exit(code)
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = conn
        while children:  # reap every child that ended and tell its proxy
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is None:
                continue
            status = -os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else os.WEXITSTATUS(wait_status)
            with contextlib.suppress(OSError):  # the proxy may be gone (killed): nobody to tell
                conn.sendall(json.dumps({"status": status}).encode() + b"\n")
            conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
