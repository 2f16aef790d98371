"""Two Linux network namespaces joined by a veth pair: two hosts on one machine, for the two-host test and the
latency benchmark. Needs root and iproute2 (``ip netns``).

    with netns_pair() as net:            # net.a = 10.77.0.1 (verifier side), net.b = 10.77.0.2 (drafter side)
        subprocess.run([*net.exec("b"), "python", "-c", "..."])

``delay_proxy(net, side, listen, connect, ms)`` runs ``runtime.delay_proxy`` in one of them. Each pair gets unique
names (the process id and a counter), and is deleted on exit, on failure too; pairs left by a
process that was killed are removed the next time one is made.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import selectors
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from runtime.launch import stop_process

REPO_ROOT = Path(__file__).resolve().parent.parent
PREFIX = "pipespec-"
_counter = itertools.count()


class NetnsError(RuntimeError):
    """The namespaces cannot be made here (no root, no iproute2, or a kernel without network namespaces)."""


@dataclass(frozen=True)
class NetnsPair:
    names: dict[str, str]  # side ("a", "b") -> namespace name
    addresses: dict[str, str]  # side -> IPv4 address on the veth link

    @property
    def a(self) -> str:
        return self.addresses["a"]

    @property
    def b(self) -> str:
        return self.addresses["b"]

    def exec(self, side: str) -> list[str]:
        """The command prefix that runs a program in ``side``'s namespace."""
        return ["ip", "netns", "exec", self.names[side]]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15, check=check)
    except subprocess.CalledProcessError as exc:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {exc.stderr.strip() or exc}") from None
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`ip {' '.join(args)}` did not finish in 15 s") from None


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "not running as root (network namespaces need CAP_SYS_ADMIN)"
    listed = _ip("netns", "list", check=False)
    if listed.returncode != 0:
        return f"`ip netns list` fails: {listed.stderr.strip()}"
    return None


def _remove_stale() -> None:
    """Delete pairs whose creating process is gone (a killed test run leaves them behind)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        m = re.match(rf"({re.escape(PREFIX)}(\d+)-\d+-[ab])\b", line)
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            _ip("netns", "del", m.group(1), check=False)


@contextlib.contextmanager
def netns_pair(subnet: str = "10.77.0") -> Iterator[NetnsPair]:
    """Make two namespaces, a (``subnet.1``) and b (``subnet.2``), joined by a veth pair, with loopback up in
    both; delete them on exit. Raises :class:`NetnsError` with the reason when this machine cannot."""
    reason = unavailable_reason()
    if reason:
        raise NetnsError(f"two network namespaces cannot be made here: {reason}")
    _remove_stale()
    tag = f"{os.getpid()}-{next(_counter)}"
    names = {side: f"{PREFIX}{tag}-{side}" for side in "ab"}
    addresses = {"a": f"{subnet}.1", "b": f"{subnet}.2"}
    veth = {side: f"psv{os.getpid() % 100000}{next(_counter)}{side}"[:15] for side in "ab"}  # ≤ 15 characters
    made: list[str] = []
    try:
        for name in names.values():
            _ip("netns", "add", name)
            made.append(name)
        _ip("link", "add", veth["a"], "type", "veth", "peer", "name", veth["b"])
        for side in "ab":
            _ip("link", "set", veth[side], "netns", names[side])
            _ip("-n", names[side], "addr", "add", f"{addresses[side]}/24", "dev", veth[side])
            _ip("-n", names[side], "link", "set", veth[side], "up")
            _ip("-n", names[side], "link", "set", "lo", "up")
        yield NetnsPair(names, addresses)
    finally:
        for name in made:  # deleting a namespace deletes the veth end inside it, and so the pair
            _ip("netns", "del", name, check=False)
        _ip("link", "del", veth["a"], check=False)  # a pair still in this namespace (a failed move)


@contextlib.contextmanager
def delay_proxy(net: NetnsPair, side: str, listen: str, connect: str, delay_ms: float) -> Iterator[None]:
    """``runtime.delay_proxy`` (``HOST:PORT`` to ``HOST:PORT``, ``delay_ms`` each way) as a process in ``side``'s
    namespace, until the block ends."""
    proc = subprocess.Popen(
        [*net.exec(side), sys.executable, "-m", "runtime.delay_proxy", "--listen", listen, "--connect", connect,
         "--delay-ms", str(delay_ms)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))},
    )
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if not sel.select(30):
                raise NetnsError("the delay proxy did not start within 30 s")
        line = proc.stdout.readline()
        if not line.startswith("delay proxy:"):
            raise NetnsError(f"the delay proxy failed: {line}{proc.stdout.read()}")
        yield
    finally:
        stop_process(proc, 5)
