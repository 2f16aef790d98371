"""The docs check, running part: every ``<!-- docs-check: run -->`` block of README.md and docs/*.md runs as written
on tiny models (docs/development.md, "Docs", says how): ``pipespec generate`` and ``models`` as real subprocesses,
``pipespec serve`` in the background for the blocks after it, ``curl`` and python blocks against that server."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from docs_check import (
    CHAT_JSON,
    DOC_CLIENT_ADDRESS,
    DOC_PORT,
    ROOT,
    SHELL_LANGS,
    Block,
    chdir,
    checked_blocks,
    commands,
    parse_pipespec,
    program,
    substitute_models,
)

pytestmark = pytest.mark.ci  # run by CI beside make test (make test-ci): minutes of interpreter starts

RUN_BLOCKS = [b for b in checked_blocks() if b.kind == "run"]
#: how `pipespec` runs: the console script pyproject.toml declares, from the checkout
PIPESPEC = [sys.executable, "-c", "import sys; from runtime.cli import main; sys.exit(main())"]
COMMAND_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The `pipespec serve` the blocks after it talk to."""

    def __init__(self, proc: subprocess.Popen, port: int, address: str):
        self.proc, self.port, self.address = proc, port, address

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Session:
    """Runs the blocks in order, in one temporary folder, with one server at a time."""

    def __init__(self, folder: Path, models: dict[str, Path]):
        self.folder, self.models = folder, models
        self.server: Server | None = None
        (folder / "chat.json").write_text(json.dumps(CHAT_JSON), encoding="utf-8")
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}

    def substitute(self, text: str) -> str:
        text = text.replace("/tmp/pipespec-keys", str(self.folder / "keys"))
        if self.server is not None:
            text = text.replace(f"127.0.0.1:{DOC_PORT}", f"127.0.0.1:{self.server.port}")
            text = text.replace(DOC_CLIENT_ADDRESS, self.server.address)
        return text

    def tiny_argv(self, argv: list[str], block: Block) -> list[str]:
        """The command with tiny models, float32, one thread a node and no start-up profile."""
        from drafter_node.types import drafter_spec

        argv = substitute_models(argv, self.models)
        if argv[0] in ("keys", "models"):  # no config, no models
            return argv
        with chdir(self.folder):
            config = parse_pipespec(argv, block)
        assert config is not None, f"{block.where}: pipespec {argv[0]} built no config"
        extra = {"verifier.model": self.models["target"], "verifier.dtype": "float32", "verifier.threads": 1,
                 "verifier.profile_s": 0, "drafter.dtype": "float32", "drafter.threads": 1, "drafter.profile_s": 0}
        spec = drafter_spec(config["drafter"]["type"])
        if spec.needs_model and not spec.model_defaults_to_target:
            extra["drafter.model"] = self.models["drafter"]
        if argv[0] == "serve":
            extra["http.model_name"] = config["http"]["model_name"] or config["verifier"]["model"]
        return [*argv, *(a for k, v in extra.items() for a in ("--set", f"{k}={v}"))]

    def run_pipespec(self, argv: list[str], block: Block) -> None:
        argv = self.tiny_argv(argv, block)
        if argv[0] == "serve":
            self.serve(argv, block)
            return
        r = subprocess.run([*PIPESPEC, *argv], cwd=self.folder, env=self.env, capture_output=True, text=True,
                           timeout=COMMAND_TIMEOUT_S)
        assert r.returncode == 0, f"{block.where}: pipespec {shlex.join(argv)}: exit {r.returncode}\n{r.stderr[-3000:]}"
        if argv[0] == "generate":
            assert r.stdout.strip(), f"{block.where}: pipespec generate printed nothing"
            if "--json" in argv:
                out = json.loads(r.stdout)
                assert out["token_ids"] and "metrics" in out

    def serve(self, argv: list[str], block: Block) -> None:
        if self.server is not None:
            self.server.stop()
        port = free_port()
        if "--port" in argv:
            argv[argv.index("--port") + 1] = str(port)
        else:
            argv += ["--port", str(port)]
        proc = subprocess.Popen([*PIPESPEC, *argv], cwd=self.folder, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        address, seen = None, []
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while address is None:
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, \
                f"{block.where}: pipespec serve ended before it served:\n{''.join(seen)[-3000:]}"
            seen.append(line)
            m = re.match(r"client address: (\S+)", line)
            address = m.group(1) if m else None
        self.server = Server(proc, port, address)
        while True:  # the HTTP API comes up after the client address is printed
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, f"{block.where}: no /health on {port}"
            time.sleep(0.2)

    def run_curl(self, argv: list[str], block: Block) -> None:
        assert self.server is not None, f"{block.where}: curl with no `pipespec serve` block before it"
        r = subprocess.run(["curl", "--fail-with-body", *argv], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{block.where}: curl {shlex.join(argv)}: exit {r.returncode}: {r.stdout} {r.stderr}"
        if "-N" in argv or '"stream": true' in " ".join(argv):
            events = [line for line in r.stdout.splitlines() if line.startswith("data: ")]
            assert events and events[-1] == "data: [DONE]", r.stdout
        else:
            assert "choices" in json.loads(r.stdout), r.stdout

    def run_shell(self, block: Block) -> None:
        for tokens in commands(self.substitute(block.text)):
            prog, argv = program(tokens)
            if prog == "pipespec":
                self.run_pipespec(argv, block)
            elif prog == "curl":
                self.run_curl(argv, block)
            else:
                raise AssertionError(f"{block.where}: a run block runs pipespec and curl only, not {prog!r}")

    def run_python(self, block: Block) -> None:
        code = self.substitute(block.text)
        if DOC_CLIENT_ADDRESS in block.text or f":{DOC_PORT}" in block.text:
            assert self.server is not None, f"{block.where}: talks to a server, but no `pipespec serve` ran before it"
        script = self.folder / "block.py"
        script.write_text(code, encoding="utf-8")
        r = subprocess.run([sys.executable, str(script)], cwd=self.folder, env=self.env, capture_output=True,
                           text=True, timeout=COMMAND_TIMEOUT_S)
        assert r.returncode == 0, f"{block.where}: exit {r.returncode}\n{r.stderr[-3000:]}"

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


@pytest.fixture(scope="module")
def session(tiny, tmp_path_factory):
    s = Session(tmp_path_factory.mktemp("docs-run"), {"target": tiny("llama"), "drafter": tiny("llama", "random")})
    yield s
    s.close()


def test_there_are_blocks_to_run() -> None:
    assert len(RUN_BLOCKS) >= 5 and any(b.path.name == "README.md" for b in RUN_BLOCKS)


# One test per block, in document order (README first): a serve block's server stays up for the blocks after it.
@pytest.mark.parametrize("block", RUN_BLOCKS, ids=lambda b: b.where)
def test_run_block(block: Block, session: Session) -> None:
    if block.lang in SHELL_LANGS:
        session.run_shell(block)
    else:
        session.run_python(block)
