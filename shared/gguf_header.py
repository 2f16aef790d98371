"""A bounded reader of a GGUF file's header, run before llama.cpp sees the file.

A GGUF file is parsed like code: llama.cpp's loader (C++, with many memory-safety fixes in its history) trusts
counts and lengths the file declares. :func:`check_gguf_header` reads the header in Python first and refuses a file
whose declarations are out of bounds, with the reason:

* the magic and version (2 or 3: version 1's 32-bit counts are refused, as llama.cpp does);
* the key-value and tensor counts (:data:`MAX_KV`, :data:`MAX_TENSORS`), each key's and string's length, each
  array's length (:data:`MAX_ARRAY`; nested arrays and unknown value types refused) — every length also against the
  bytes the file really has, so nothing is read or allocated for what is not there;
* ``{arch}.block_count`` (:data:`MAX_BLOCKS`; no ``blk.N`` tensor past it), the vocabulary (the per-token
  :data:`VOCAB_ARRAYS` no longer than ``max_vocab``), ``general.alignment`` (a power of two);
* each tensor's name, rank (1-4), dimensions, type (a ggml type, from the ``gguf`` package's constants) and data
  (its bytes aligned and inside the file).

Why not the ``gguf`` package's ``GGUFReader``: it memory-maps the whole file and builds a Python part list for every
array element as it goes, with no bound on any count (a header declaring 10⁹ token strings is walked, or fails with
whatever error numpy raises); it is a reader for files one trusts. This one stops at the first declaration past a
bound, reads at most :data:`MAX_HEADER_BYTES`, and keeps only what the checks need (scalars, array lengths).
It reads no tensor data and proves nothing about the weights; what it bounds is the header llama.cpp parses.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

#: Key-value pairs in one header (real files: 20-60).
MAX_KV = 4096
#: Tensors in one file (real files: a few hundred; large mixtures of experts a few thousand).
MAX_TENSORS = 65_536
#: Elements of one metadata array (a vocabulary's tokens, scores, merges).
MAX_ARRAY = 1 << 22
#: Tokens in a vocabulary when no target's is given (the largest common vocabularies: 262,144).
MAX_VOCAB = 1 << 19
#: Extra tokens a drafter's vocabulary may have over its target's (a head padded for alignment).
VOCAB_SLACK = 1024
#: Layers (``{arch}.block_count``; the deepest released models have under 200).
MAX_BLOCKS = 512
#: Bytes of a key (GGUF keys are short dotted names).
MAX_KEY_BYTES = 256
#: Bytes of one string value (a chat template, a tokenizer's JSON) and of one string in an array (a token).
MAX_STRING_BYTES = 32 << 20
MAX_ELEMENT_BYTES = 1 << 16
#: Bytes of the whole header (key-values and tensor infos), read in chunks; real headers: a few MiB.
MAX_HEADER_BYTES = 256 << 20
#: ggml's longest tensor name (GGML_MAX_NAME, with its terminating zero) and most dimensions (GGML_MAX_DIMS).
MAX_TENSOR_NAME = 63
MAX_DIMS = 4
#: Elements of one tensor (2^42: far past any model, and the product cannot overflow int64 in llama.cpp).
MAX_TENSOR_ELEMENTS = 1 << 42

_SCALARS: dict[int, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"), GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"), GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"), GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"), GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"), GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
#: The arrays with one entry per token (merges and a T5 tokenizer's byte map are bounded by MAX_ARRAY alone).
VOCAB_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
_ARCH = re.compile(r"[a-z0-9_\-]{1,64}")
_BLOCK = re.compile(r"blk\.(\d+)\.")


class GGUFHeaderError(ValueError):
    """A GGUF header that declares something out of bounds (or is not a GGUF header at all)."""


@dataclass(frozen=True)
class ArrayInfo:
    """A metadata array's element type and length (its elements are skipped, not kept)."""

    kind: int
    length: int


@dataclass
class GGUFHeader:
    """What the checks read: the version, scalar values, arrays' lengths, tensors' names and where the data starts."""

    version: int
    values: dict[str, Any] = field(default_factory=dict)
    tensors: list[str] = field(default_factory=list)
    data_start: int = 0

    @property
    def architecture(self) -> str:
        return str(self.values.get("general.architecture", ""))

    @property
    def vocab_size(self) -> int | None:
        tokens = self.values.get("tokenizer.ggml.tokens")
        return tokens.length if isinstance(tokens, ArrayInfo) else None

    @property
    def block_count(self) -> int | None:
        value = self.values.get(f"{self.architecture}.block_count")
        return value if isinstance(value, int) else None


class _Reader:
    """The file read forward in chunks, never past :data:`MAX_HEADER_BYTES` nor past its end."""

    def __init__(self, fh: Any, size: int):
        self.fh, self.size = fh, size
        self.buf = bytearray()
        self.pos = 0

    def need(self, n: int, what: str) -> None:
        end = self.pos + n
        if end > self.size:
            raise GGUFHeaderError(f"{what} runs past the end of the file ({n:,} bytes declared at offset "
                                  f"{self.pos:,} of {self.size:,})")
        if end > MAX_HEADER_BYTES:
            raise GGUFHeaderError(f"the header is larger than {MAX_HEADER_BYTES >> 20} MiB (at {what})")
        if end > len(self.buf):
            want = min(max(end - len(self.buf), len(self.buf), 1 << 20), MAX_HEADER_BYTES - len(self.buf))
            self.buf += self.fh.read(want)
            if end > len(self.buf):
                raise GGUFHeaderError(f"{what}: the file ended early")

    def scalar(self, fmt: struct.Struct, what: str) -> Any:
        self.need(fmt.size, what)
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n

    def string(self, limit: int, what: str) -> str:
        length = self.scalar(_U64, what)
        if length > limit:
            raise GGUFHeaderError(f"{what} declares a string of {length:,} bytes (at most {limit:,})")
        self.need(length, what)
        raw = bytes(self.buf[self.pos:self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFHeaderError(f"{what} is not UTF-8") from None


def _value(r: _Reader, kind: int, key: str) -> Any:
    """One key's value: a scalar, a string, or an array's :class:`ArrayInfo` (its elements skipped with bounds)."""
    if kind in _SCALARS:
        return r.scalar(_SCALARS[kind], f"the value of {key!r}")
    if kind == GGUFValueType.STRING:
        return r.string(MAX_STRING_BYTES, f"the value of {key!r}")
    if kind != GGUFValueType.ARRAY:
        raise GGUFHeaderError(f"{key!r} has an unknown value type {kind}")
    elem = r.scalar(_U32, f"the array type of {key!r}")
    length = r.scalar(_U64, f"the array length of {key!r}")
    if length > MAX_ARRAY:
        raise GGUFHeaderError(f"{key!r} declares an array of {length:,} elements (at most {MAX_ARRAY:,})")
    if elem in _SCALARS:
        r.skip(length * _SCALARS[elem].size, f"the array {key!r}")
    elif elem == GGUFValueType.STRING:
        if length * 8 > r.size - r.pos:  # every string has its 8-byte length: cheap to refuse before walking
            raise GGUFHeaderError(f"{key!r} declares {length:,} strings, more than the file can hold")
        _skip_strings(r, length, key)
    else:
        raise GGUFHeaderError(f"{key!r} is an array of type {elem} (nested or unknown arrays are refused)")
    return ArrayInfo(elem, length)


def _skip_strings(r: _Reader, count: int, key: str) -> None:
    """Skip ``count`` strings of the array ``key`` (each at most :data:`MAX_ELEMENT_BYTES`): the hot loop of a
    vocabulary's hundreds of thousands of tokens and merges, so with local names and no call per element."""
    buf, pos, unpack, what = r.buf, r.pos, _U64.unpack_from, f"an element of {key!r}"
    for _ in range(count):
        if pos + 8 > len(buf):
            r.pos = pos
            r.need(8, what)  # reads on into the same bytearray, or raises at the file's or the bound's end
        (n,) = unpack(buf, pos)
        if n > MAX_ELEMENT_BYTES:
            raise GGUFHeaderError(f"{what} declares a string of {n:,} bytes (at most {MAX_ELEMENT_BYTES:,})")
        if pos + 8 + n > len(buf):
            r.pos = pos
            r.need(8 + n, what)
        pos += 8 + n
    r.pos = pos


def _tensor(r: _Reader, index: int) -> tuple[str, int, int, int]:
    """One tensor's info: (name, ggml type, its data's size in bytes, its offset in the data section)."""
    name = r.string(MAX_TENSOR_NAME, f"the name of tensor {index}")
    n_dims = r.scalar(_U32, f"the rank of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFHeaderError(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
    dims = [r.scalar(_U64, f"a dimension of tensor {name!r}") for _ in range(n_dims)]
    count = 1
    for d in dims:
        if d < 1 or d > MAX_TENSOR_ELEMENTS:
            raise GGUFHeaderError(f"tensor {name!r} has a dimension of {d:,}")
        count *= d
        if count > MAX_TENSOR_ELEMENTS:
            raise GGUFHeaderError(f"tensor {name!r} declares {count:,} or more elements")
    kind = r.scalar(_U32, f"the type of tensor {name!r}")
    if kind not in GGMLQuantizationType._value2member_map_ or GGMLQuantizationType(kind) not in GGML_QUANT_SIZES:
        raise GGUFHeaderError(f"tensor {name!r} has an unknown ggml type {kind}")
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    if dims[0] % block:
        raise GGUFHeaderError(f"tensor {name!r}: its first dimension {dims[0]} is not a multiple of its type's "
                              f"block of {block}")
    offset = r.scalar(_U64, f"the offset of tensor {name!r}")
    return name, kind, count // block * type_size, offset


def _read(r: _Reader) -> tuple[GGUFHeader, list[tuple[str, int, int, int]]]:
    r.need(4, "the magic")
    if bytes(r.buf[:4]) != b"GGUF":
        raise GGUFHeaderError("it is not a GGUF file (it does not start with 'GGUF')")
    r.pos = 4
    version = r.scalar(_U32, "the version")
    if version not in (2, 3):
        raise GGUFHeaderError(f"GGUF version {version} (2 and 3 are read)")
    n_tensors = r.scalar(_U64, "the tensor count")
    n_kv = r.scalar(_U64, "the key-value count")
    if n_tensors > MAX_TENSORS:
        raise GGUFHeaderError(f"it declares {n_tensors:,} tensors (at most {MAX_TENSORS:,})")
    if n_kv > MAX_KV:
        raise GGUFHeaderError(f"it declares {n_kv:,} key-value pairs (at most {MAX_KV:,})")
    header = GGUFHeader(version)
    for i in range(n_kv):
        key = r.string(MAX_KEY_BYTES, f"key {i}")
        if not key or key in header.values:
            raise GGUFHeaderError(f"key {i} is {'empty' if not key else f'a repeat of {key!r}'}")
        header.values[key] = _value(r, r.scalar(_U32, f"the type of {key!r}"), key)
    tensors = [_tensor(r, i) for i in range(n_tensors)]
    header.tensors = [t[0] for t in tensors]
    return header, tensors


def _check(header: GGUFHeader, tensors: list[tuple[str, int, int, int]], end: int, size: int,
           max_vocab: int) -> None:
    """The checks over what was read: architecture, depth, vocabulary, alignment, tensor names and data."""
    arch = header.values.get("general.architecture")
    if not isinstance(arch, str) or not _ARCH.fullmatch(arch):
        raise GGUFHeaderError(f"general.architecture is missing or not a short name ({str(arch)[:80]!r})")
    blocks = header.values.get(f"{arch}.block_count")
    if blocks is not None and (not isinstance(blocks, int) or isinstance(blocks, bool)
                               or not 1 <= blocks <= MAX_BLOCKS):
        raise GGUFHeaderError(f"{arch}.block_count is {blocks!r} (1 to {MAX_BLOCKS})")
    for key in VOCAB_ARRAYS:
        value = header.values.get(key)
        if isinstance(value, ArrayInfo) and value.length > max_vocab:
            raise GGUFHeaderError(f"{key} has {value.length:,} entries: a vocabulary larger than the "
                                  f"{max_vocab:,} tokens allowed here")
    align = header.values.get("general.alignment", 32)
    if not isinstance(align, int) or isinstance(align, bool) or not 1 <= align <= 1 << 16 or align & (align - 1):
        raise GGUFHeaderError(f"general.alignment is {align!r} (a power of two up to 65536)")
    header.data_start = -(-end // align) * align
    data = size - header.data_start
    seen: set[str] = set()
    for name, _, nbytes, offset in tensors:
        if name in seen:
            raise GGUFHeaderError(f"tensor {name!r} is declared twice")
        seen.add(name)
        layer = _BLOCK.match(name)
        if layer and blocks is not None and int(layer.group(1)) >= blocks:
            raise GGUFHeaderError(f"tensor {name!r} is past {arch}.block_count = {blocks}")
        if offset % align or offset + nbytes > data:
            raise GGUFHeaderError(f"tensor {name!r}: {nbytes:,} bytes at offset {offset:,} are not aligned to "
                                  f"{align} or not inside the file's {max(data, 0):,} bytes of tensor data")


def check_gguf_header(path: str | os.PathLike[str], max_vocab: int | None = None) -> GGUFHeader:
    """Read ``path``'s GGUF header with the bounds of this module (``max_vocab``: the most tokens its vocabulary
    may have, default :data:`MAX_VOCAB`), or raise :class:`GGUFHeaderError` saying which declaration is out of
    bounds. Reads the header only (at most :data:`MAX_HEADER_BYTES`), never the tensor data."""
    limit = MAX_VOCAB if max_vocab is None else max_vocab
    try:
        with open(Path(path).expanduser(), "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            r = _Reader(fh, size)
            header, tensors = _read(r)
    except OSError as exc:
        raise GGUFHeaderError(f"it is not a readable file: {exc.strerror}") from None
    _check(header, tensors, r.pos, size, limit)
    return header
