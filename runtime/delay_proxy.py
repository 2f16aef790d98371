"""A TCP proxy that adds a fixed one-way delay, for running pipespec over a slow link where ``tc netem`` is missing.

    python -m runtime.delay_proxy --listen 10.77.0.2:6555 --connect 10.77.0.1:5555 --delay-ms 5

Every chunk read from one side is written to the other side ``delay`` after it arrived, in order: one queue per
direction, so nothing is reordered and delays do not add up along a stream (a chunk that arrives while an earlier
one waits leaves at its own due time). A round trip through it gains twice the delay; bandwidth is not limited.
It forwards bytes only (CURVE traffic stays end to end: the proxy sees ciphertext). ``tap`` (from Python) sees every
chunk, for tests that check what is on the wire.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import Callable

CHUNK = 1 << 16
#: Chunks held per direction before reading pauses (bounds memory at 64 MiB per direction).
MAX_QUEUED = 1024

Tap = Callable[[str, bytes], None]


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # Nagle would add delay of its own


async def _forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, direction: str,
                   tap: Tap | None) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(MAX_QUEUED)

    async def read() -> None:
        try:
            while data := await reader.read(CHUNK):
                await queue.put((loop.time() + delay_s, data))
        except (ConnectionError, OSError):
            pass
        await queue.put((loop.time() + delay_s, b""))  # end of stream, delayed like the data

    async def write() -> None:
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                return
            if tap is not None:
                tap(direction, data)
            writer.write(data)
            await writer.drain()

    reading = asyncio.ensure_future(read())
    try:
        await write()
    finally:
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading


async def _handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, host: str, port: int,
                  delay_s: float, tap: Tap | None) -> None:
    try:
        server_r, server_w = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
    except (OSError, asyncio.TimeoutError):
        client_w.close()
        return
    for w in (client_w, server_w):
        _nodelay(w)
    up = asyncio.ensure_future(_forward(client_r, server_w, delay_s, "up", tap))
    down = asyncio.ensure_future(_forward(server_r, client_w, delay_s, "down", tap))
    try:
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)  # one side closed: close both
    except (ConnectionError, OSError):
        pass
    finally:
        for task in (up, down):
            task.cancel()
        for w in (client_w, server_w):
            w.close()
        await asyncio.gather(up, down, return_exceptions=True)


async def serve(listen: tuple[str, int], connect: tuple[str, int], delay_s: float,
                tap: Tap | None = None) -> asyncio.Server:
    """Start the proxy on ``listen``; every connection is forwarded to ``connect`` with ``delay_s`` each way."""
    if delay_s < 0:
        raise ValueError(f"delay must be ≥ 0, got {delay_s}")
    return await asyncio.start_server(lambda r, w: _handle(r, w, connect[0], connect[1], delay_s, tap),
                                      listen[0], listen[1])


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: use HOST:PORT")
    return host.strip("[]"), int(port)


async def _main(args: argparse.Namespace) -> None:
    server = await serve(args.listen, args.connect, args.delay_ms / 1000)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    host, port = server.sockets[0].getsockname()[:2]
    print(f"delay proxy: {host}:{port} -> {args.connect[0]}:{args.connect[1]}, {args.delay_ms} ms each way",
          flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.delay_proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", type=_address, required=True, metavar="HOST:PORT")
    p.add_argument("--connect", type=_address, required=True, metavar="HOST:PORT")
    p.add_argument("--delay-ms", type=float, default=0.0, help="added one-way delay in milliseconds")
    args = p.parse_args(argv)
    if args.delay_ms < 0:
        p.error("--delay-ms must be ≥ 0")
    try:
        asyncio.run(_main(args))
    except OSError as exc:
        print(f"delay proxy: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
