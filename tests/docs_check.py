"""The docs check's machinery: the fenced blocks of README.md and docs/*.md, their markers, and how each command is
parsed (unit tier, tests/test_docs.py) or run on tiny models (ci tier, tests/test_docs_run.py).

A ``bash``/``python``/``yaml`` block is preceded by ``<!-- docs-check: KIND[: REASON] -->`` (docs/development.md,
"Docs"): ``run``, ``parse-only: REASON``, ``compile-only: REASON`` (python) or ``config`` (yaml).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import urllib.parse
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CHECKED_LANGS = {"bash", "sh", "shell", "console", "python", "yaml"}
SHELL_LANGS = {"bash", "sh", "shell", "console"}
KINDS = {"run", "parse-only", "compile-only", "config", "ray"}
#: kinds that must say why the block is not run
NEEDS_REASON = {"parse-only", "compile-only"}
MARKER = re.compile(r"<!--\s*docs-check:\s*([\w-]+)\s*(?::\s*(.*?))?\s*-->\s*$")
#: model values that stand for "your model": replaced by tiny models in every check
PLACEHOLDER_MODELS = ("/path/to/", "./my-")
#: the served model's port in the docs; a run replaces it with a free one
DOC_PORT = "8000"
#: the client address a python block writes for "the address `pipespec serve` printed"
DOC_CLIENT_ADDRESS = "ipc:///tmp/pipespec-XXXX/client.ipc"
CHAT_JSON = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
HTTP_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence
    lang: str
    kind: str | None  # None: no marker
    reason: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def needs_gpu(self) -> bool:
        return "GPU" in self.reason


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a markdown file, with the marker on the nearest non-blank line above it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^```([\w-]*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and not re.match(r"^```\s*$", lines[j]):
            j += 1
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.match(lines[k].strip()) if k >= 0 else None
        kind, reason = (marker.group(1), marker.group(2) or "") if marker else (None, "")
        out.append(Block(path, start + 1, lang, kind, reason, "\n".join(lines[start + 1:j]) + "\n"))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for path in DOC_FILES for b in blocks(path)]


def checked_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.lang in CHECKED_LANGS]


def commands(text: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, quotes spanning lines kept, comments dropped, and
    leading ``VAR=value`` assignments removed."""
    out: list[list[str]] = []
    pending = ""
    for line in text.splitlines():
        pending += line + "\n"
        if line.endswith("\\"):
            continue
        try:
            tokens = shlex.split(pending.replace("\\\n", " "), comments=True)
        except ValueError:  # an open quote: the command goes on on the next line
            continue
        pending = ""
        while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
            tokens.pop(0)
        if tokens:
            out.append(tokens)
    if pending.strip():
        raise ValueError(f"unterminated command: {pending!r}")
    return out


def program(tokens: list[str]) -> tuple[str, list[str]]:
    """(what runs, its arguments): ``pipespec``, ``python -m MOD``, ``python SCRIPT``, ``pip``, ``make``, ``curl``…
    with any venv prefix (``.venv/bin/``) dropped."""
    name = Path(tokens[0]).name
    if re.fullmatch(r"python3?(\.\d+)?", name):
        if tokens[1] == "-m":
            return f"python -m {tokens[2]}", tokens[3:]
        return f"python {tokens[1]}", tokens[2:]
    return name, tokens[1:]


# ------------------------------------------------------------------------------------------------ parse-only


class Parsed(BaseException):
    """Raised right after a real argparse parser accepted the arguments (so nothing after the parse runs)."""

    def __init__(self, namespace: argparse.Namespace):
        self.namespace = namespace


@contextlib.contextmanager
def stop_after_parse() -> Iterator[None]:
    """Every ``ArgumentParser.parse_args`` raises :class:`Parsed` once it has parsed; a process started before
    that fails the check (the command did work before its arguments were parsed)."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    def no_popen(*args: Any, **kwargs: Any):
        raise AssertionError(f"the command started a process before it parsed its arguments: {args[:1]}")

    saved = argparse.ArgumentParser.parse_args, subprocess.Popen.__init__
    argparse.ArgumentParser.parse_args = parse_args  # type: ignore[method-assign]
    subprocess.Popen.__init__ = no_popen  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args, subprocess.Popen.__init__ = saved  # type: ignore[method-assign]


@contextlib.contextmanager
def chdir(path: Path) -> Iterator[None]:
    old = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def substitute_models(argv: list[str], models: dict[str, Path]) -> list[str]:
    """Placeholder model paths (``/path/to/…``, ``./my-…``) replaced by tiny models: ``models["target"]`` for
    ``--model``, ``models["drafter"]`` for a draft model, ``models["mtp"]`` for a placeholder naming ``mtp``."""
    out = list(argv)
    for i, tok in enumerate(out[:-1]):
        value = out[i + 1]
        if tok in ("--model", "--draft-model", "--assistant-model") and value.startswith(PLACEHOLDER_MODELS):
            role = "mtp" if "mtp" in value else "target" if tok == "--model" else "drafter"
            out[i + 1] = str(models[role])
    return out


def gpu_overrides() -> list[str]:
    return ["--set", "verifier.device=cpu", "--set", "drafter.device=cpu"]


def expect_exit_0(exc: SystemExit, what: str) -> None:
    assert exc.code in (0, None), f"{what}: the parser refused it (exit {exc.code})"


def parse_pipespec(argv: list[str], block: Block) -> dict[str, Any] | None:
    """Parse a ``pipespec`` command with the real CLI and, where it takes a config, build and validate it (nothing
    starts). ``pipespec keys`` runs for real (in the current directory). Returns the config, if any."""
    from runtime import cli
    from runtime.config import load_config
    from shared.named_models import NAMED_MODELS

    if block.needs_gpu:
        argv = [*argv, *gpu_overrides()]
    if argv and argv[0] == "keys":
        assert cli.main(argv) == 0, f"pipespec {shlex.join(argv)} failed"
        return None
    if argv and argv[0] in ("profile", "bench"):
        try:
            with stop_after_parse():
                cli.main(argv)
        except Parsed as p:
            ns = p.namespace
            if getattr(ns, "config", None) is not None:
                return load_config(ns.config, getattr(ns, "set", None))
            return None
        except SystemExit as exc:
            expect_exit_0(exc, f"pipespec {shlex.join(argv)}")
            return None
        raise AssertionError(f"pipespec {argv[0]} never parsed its arguments")
    try:
        args = cli.parser().parse_args(argv)
    except SystemExit as exc:
        expect_exit_0(exc, f"pipespec {shlex.join(argv)}")
        return None
    if args.command == "scale":
        return None  # its flags parsed; it takes no config
    if args.command == "models":
        for name in getattr(args, "names", None) or []:
            assert name in NAMED_MODELS, f"pipespec models install {name}: not a named model"
        return None
    return cli.build_config(args, serve=args.command == "serve")


def parse_python(prog: str, argv: list[str]) -> None:
    """``python -m MOD ARGS`` or ``python SCRIPT ARGS`` up to and including its argument parser."""
    if prog == "python -m pytest":
        for arg in argv:
            if arg.startswith("tests/"):
                assert (ROOT / arg.split("::")[0]).exists(), f"pytest: no such test file {arg}"
        if "-m" in argv:
            expr = argv[argv.index("-m") + 1]
            markers = _pytest_markers()
            for word in re.findall(r"\w+", expr):
                assert word in markers | {"and", "or", "not"}, f"pytest -m: unknown marker {word!r}"
        return
    if prog == "python -m pip":
        parse_pip(argv)
        return
    module = prog.removeprefix("python -m ") if prog.startswith("python -m ") else None
    script = None if module else ROOT / prog.removeprefix("python ")
    if script is not None:
        assert script.exists(), f"{prog}: no such script"
    saved = sys.argv
    sys.argv = [str(script or module), *argv]
    try:
        with stop_after_parse(), warnings.catch_warnings():
            # a module the check imported already is run afresh as __main__, which is what `python -m` does
            warnings.filterwarnings("ignore", message=".*found in sys.modules", category=RuntimeWarning)
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(script), run_name="__main__")
    except Parsed:
        return
    except SystemExit as exc:
        expect_exit_0(exc, prog)
        return
    finally:
        sys.argv = saved
    raise AssertionError(f"{prog} ran to its end without parsing arguments")


def _pytest_markers() -> set[str]:
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return {m.split(":")[0].strip() for m in pyproject["tool"]["pytest"]["ini_options"]["markers"]}


def torch_pin() -> str:
    """The torch version the Makefile installs first (the one the docs must name)."""
    m = re.search(r"pip install -q (torch==[\w.]+)", (ROOT / "Makefile").read_text(encoding="utf-8"))
    assert m, "the Makefile installs no pinned torch"
    return m.group(1)


def parse_pip(argv: list[str]) -> None:
    """pip's own parser for the subcommand; torch pinned as the Makefile pins it; ``.[EXTRA]`` extras declared."""
    import tomllib
    from pip._internal.commands import create_command

    command, rest = argv[0], argv[1:]
    _options, args = create_command(command).parse_args(rest)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    for arg in args:
        if arg.startswith("torch"):
            assert arg == torch_pin(), f"pip {command} {arg}: the Makefile installs {torch_pin()}"
        m = re.fullmatch(r"\.(?:\[([\w,]+)\])?", arg)
        if m and m.group(1):
            for extra in m.group(1).split(","):
                assert extra in extras, f"pip install {arg}: no extra {extra!r} in pyproject.toml"


def parse_curl(argv: list[str]) -> None:
    """The URL names an endpoint of the HTTP API and a ``-d`` body is JSON."""
    urls = [a for a in argv if a.startswith("http")]
    assert len(urls) == 1, f"curl: one URL expected, got {urls}"
    path = urllib.parse.urlparse(urls[0]).path
    assert path in HTTP_ROUTES, f"curl: {path} is not an endpoint of the HTTP API"
    if "-d" in argv:
        json.loads(argv[argv.index("-d") + 1])


def parse_make(argv: list[str]) -> None:
    for target in argv:
        r = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"make -n {target}: {r.stderr.strip()}"


#: The ``ray start`` flags the docs may use, and whether each takes a value.
RAY_START_FLAGS = {"--head": False, "--address": True, "--port": True, "--num-cpus": True, "--num-gpus": True,
                   "--resources": True, "--labels": True, "--node-ip-address": True}
#: The head's address in the docs' Ray recipe (docs/ray.md); the Ray tier puts its cluster's address there.
RAY_HEAD = "HEAD:6379"


def parse_ray_start(argv: list[str]) -> dict[str, Any]:
    """``ray start FLAGS`` as the docs write it (Ray's own CLI is an optional extra, so it is not imported here):
    ``{"head": bool, "num_cpus": int | None, "num_gpus": int | None, "resources": {...}, "labels": {...}}``."""
    assert argv and argv[0] == "start", f"ray {shlex.join(argv)}: only `ray start` is documented"
    out: dict[str, Any] = {"head": False, "num_cpus": None, "num_gpus": None, "resources": {}, "labels": {}}
    for arg in argv[1:]:
        flag, eq, value = arg.partition("=")
        assert flag in RAY_START_FLAGS, f"ray start: unknown flag {flag}"
        assert bool(eq) == RAY_START_FLAGS[flag], f"ray start {arg}: write --flag=value for flags with a value"
        if flag == "--head":
            out["head"] = True
        elif flag in ("--num-cpus", "--num-gpus"):
            out[flag[2:].replace("-", "_")] = int(value)
        elif flag == "--resources":
            resources = json.loads(value)
            assert isinstance(resources, dict) and all(isinstance(v, (int, float)) for v in resources.values())
            out["resources"] = resources
        elif flag == "--labels":
            out["labels"] = dict(pair.split("=", 1) for pair in value.split(","))
        elif flag == "--address":
            assert value == RAY_HEAD, f"ray start --address: write {RAY_HEAD} (the docs' placeholder)"
    return out


def ray_blocks(path: Path) -> list[Block]:
    """A doc's ``<!-- docs-check: ray -->`` blocks in order: the recipe the Ray tier runs (tests/test_ray.py)."""
    return [b for b in blocks(path) if b.kind == "ray"]


def parse_command(tokens: list[str], block: Block, models: dict[str, Path]) -> dict[str, Any] | None:
    """Check one command without running it (``pipespec keys`` excepted); the config it would run with, if any."""
    if tokens and tokens[-1] == "&":  # started in the background
        tokens = tokens[:-1]
    prog, argv = program(tokens)
    if prog == "ray":
        if argv[:1] == ["get-auth-token"]:  # Ray's token for its token authentication (docs/ray.md)
            assert argv[1:] in ([], ["--generate"]), f"ray {shlex.join(argv)}: only --generate is documented"
        else:
            parse_ray_start(argv)
        return None
    if prog == "pipespec":
        return parse_pipespec(substitute_models(argv, models), block)
    if prog.startswith("python"):
        parse_python(prog, argv)
    elif prog == "pip":
        parse_pip(argv)
    elif prog == "make":
        parse_make(argv)
    elif prog == "curl":
        parse_curl(argv)
    else:
        raise AssertionError(f"{block.where}: no parser for {prog!r} in the docs check (tests/docs_check.py)")
    return None


def compile_python(block: Block) -> None:
    compile(block.text, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


# ------------------------------------------------------------------------------------------------------ links


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def links(path: Path) -> list[tuple[str, Path, str]]:
    """(link as written, file it names, anchor) for every relative link outside code."""
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    out = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        link = m.group(1)
        if re.match(r"^[a-z]+:", link):
            continue
        file, _, anchor = link.partition("#")
        out.append((link, (path.parent / file).resolve() if file else path, anchor))
    return out
