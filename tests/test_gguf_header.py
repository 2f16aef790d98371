"""A GGUF file as untrusted input: hostile headers (written here byte by byte) refused before llama.cpp sees them.

The bounded header reader (shared/gguf_header.py) against the declarations a hostile file would make (a
``block_count`` of 1000, a 10⁹-element array, counts and lengths past the file, nested arrays, a vocabulary larger
than allowed, tensors outside the data), the engine refusing such a file without calling llama.cpp, the pinned
SHA-256, the probe child with its limits, the drafter's per-sequence cap on the shared KV pool, and the
vocabulary fingerprint's hostile claims.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from shared.gguf_header import MAX_BLOCKS, GGUFHeaderError, check_gguf_header

STRING, ARRAY, UINT32, F32_TENSOR = 8, 9, 4, 0


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv_str(key: str, value: str) -> bytes:
    return s(key) + struct.pack("<I", STRING) + s(value)


def kv_u32(key: str, value: int) -> bytes:
    return s(key) + struct.pack("<I", UINT32) + struct.pack("<I", value)


def kv_strings(key: str, items: list[str], declared: int | None = None) -> bytes:
    count = len(items) if declared is None else declared
    return s(key) + struct.pack("<II", ARRAY, STRING) + struct.pack("<Q", count) + b"".join(s(x) for x in items)


def tensor(name: str, dims: list[int], offset: int, kind: int = F32_TENSOR) -> bytes:
    return s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<IQ", kind, offset)


def write(path: Path, kvs: list[bytes], tensors: list[bytes], data: bytes = b"\0" * 64,
          counts: tuple[int, int] | None = None, version: int = 3) -> Path:
    """A GGUF file: header (``counts``: the declared tensor and key-value counts, default the real ones),
    padding to 32 bytes, then ``data``."""
    n_tensors, n_kv = counts or (len(tensors), len(kvs))
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + b"".join(kvs) + b"".join(tensors)
    path.write_bytes(head + b"\0" * (-len(head) % 32) + data)
    return path


def good_kvs(blocks: int = 2, vocab: int = 4) -> list[bytes]:
    return [kv_str("general.architecture", "llama"), kv_u32("llama.block_count", blocks),
            kv_strings("tokenizer.ggml.tokens", [f"t{i}" for i in range(vocab)])]


def good_tensors() -> list[bytes]:
    return [tensor("token_embd.weight", [4, 2], 0), tensor("blk.1.attn_norm.weight", [4], 32)]


@pytest.mark.unit
def test_a_well_formed_header_is_read(tmp_path):
    header = check_gguf_header(write(tmp_path / "ok.gguf", good_kvs(), good_tensors()))
    assert (header.architecture, header.block_count, header.vocab_size) == ("llama", 2, 4)
    assert header.tensors == ["token_embd.weight", "blk.1.attn_norm.weight"]


@pytest.mark.unit
@pytest.mark.parametrize("case, match", [
    ("block_count", "block_count is 1000"),
    ("huge_array", "1,000,000,000 elements"),
    ("huge_kv_count", "key-value pairs"),
    ("huge_tensor_count", "tensors"),
    ("string_past_end", "past the end of the file"),
    ("big_vocab", "vocabulary larger than"),
    ("nested_array", "nested or unknown"),
    ("unknown_type", "unknown value type"),
    ("tensor_past_data", "not inside the file"),
    ("layer_past_blocks", "past llama.block_count"),
    ("five_dims", "5 dimensions"),
    ("bad_alignment", "general.alignment"),
    ("repeated_key", "repeat"),
    ("version_1", "version 1"),
    ("not_gguf", "not a GGUF file"),
    ("truncated", "ended early|past the end"),
    ("no_architecture", "general.architecture"),
    ("unknown_ggml_type", "unknown ggml type"),
])
def test_a_hostile_header_is_refused_with_the_reason(tmp_path, case, match):
    """Each out-of-bounds declaration is refused with a message that names it, fast, reading only the header."""
    path = tmp_path / f"{case}.gguf"
    kvs, tensors = good_kvs(), good_tensors()
    if case == "block_count":
        write(path, good_kvs(blocks=1000), tensors)
    elif case == "huge_array":  # the 10⁹-element token array, in a file of a few hundred bytes
        write(path, [*kvs[:2], kv_strings("tokenizer.ggml.tokens", ["a"], declared=10**9)], tensors)
    elif case == "huge_kv_count":
        write(path, kvs, tensors, counts=(2, 10**12))
    elif case == "huge_tensor_count":
        write(path, kvs, tensors, counts=(10**9, 3))
    elif case == "string_past_end":
        write(path, [s("general.architecture") + struct.pack("<I", STRING) + struct.pack("<Q", 1 << 20)], [])
    elif case == "big_vocab":
        write(path, good_kvs(vocab=40), tensors)
    elif case == "nested_array":
        write(path, [*kvs, s("x.nested") + struct.pack("<II", ARRAY, ARRAY) + struct.pack("<Q", 1)], tensors)
    elif case == "unknown_type":
        write(path, [*kvs, s("x.odd") + struct.pack("<I", 99)], tensors)
    elif case == "tensor_past_data":
        write(path, kvs, [tensor("token_embd.weight", [1 << 30], 0)])
    elif case == "layer_past_blocks":
        write(path, kvs, [tensor("blk.7.attn_norm.weight", [4], 0)])
    elif case == "five_dims":
        write(path, kvs, [tensor("token_embd.weight", [1, 1, 1, 1, 1], 0)])
    elif case == "bad_alignment":
        write(path, [*kvs, kv_u32("general.alignment", 3)], tensors)
    elif case == "repeated_key":
        write(path, [*kvs, kv_u32("llama.block_count", 2)], tensors)
    elif case == "version_1":
        write(path, kvs, tensors, version=1)
    elif case == "not_gguf":
        path.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    elif case == "truncated":
        path.write_bytes(write(path, kvs, tensors).read_bytes()[:60])
    elif case == "no_architecture":
        write(path, kvs[1:], [])
    elif case == "unknown_ggml_type":
        write(path, kvs, [tensor("token_embd.weight", [4], 0, kind=9999)])
    started = time.perf_counter()
    with pytest.raises(GGUFHeaderError, match=match):
        check_gguf_header(path, max_vocab=32)
    assert time.perf_counter() - started < 5.0  # bounds checked before anything is walked (generous: busy host)


@pytest.mark.unit
def test_the_vocabulary_may_be_the_targets_plus_slack(tmp_path):
    """``max_vocab`` is the bound: at it passes, one past it is refused; block_count at the bound passes."""
    path = write(tmp_path / "v.gguf", good_kvs(blocks=MAX_BLOCKS, vocab=10), good_tensors())
    assert check_gguf_header(path, max_vocab=10).vocab_size == 10
    with pytest.raises(GGUFHeaderError, match="10 entries"):
        check_gguf_header(path, max_vocab=9)


@pytest.mark.unit
def test_the_engine_refuses_a_hostile_file_before_llama_cpp_sees_it(tmp_path, monkeypatch):
    """LlamaEngine reads the header first: a 10⁹-element array is a ModelLoadError and llama.cpp is never imported
    (its loader would be the only guard otherwise)."""
    import shared.llama_engine as engine_module
    from shared.models import ModelLoadError

    path = write(tmp_path / "h.gguf", [*good_kvs()[:2], kv_strings("tokenizer.ggml.tokens", [], declared=10**9)],
                 good_tensors())

    def no_llama(*_args):
        raise AssertionError("llama.cpp was reached")

    monkeypatch.setattr(engine_module, "import_llama_cpp", no_llama)
    with pytest.raises(ModelLoadError, match=r"refused before llama\.cpp read it.*1,000,000,000"):
        engine_module.LlamaEngine(path, n_ctx=64, n_seq=1, threads=1)


@pytest.fixture(scope="module")
def tiny_gguf(tiny, tmp_path_factory):
    from testkit.tiny_gguf import write_qwen2_gguf

    return write_qwen2_gguf(tiny("qwen2", "random"), tmp_path_factory.mktemp("gguf") / "d.gguf")


@pytest.mark.unit
def test_a_real_gguf_passes_and_the_header_matches_gguf_py(tiny_gguf):
    """The tiny Qwen2 GGUF (what llama.cpp's converter writes) passes; the data offset is the gguf package's."""
    import gguf

    header = check_gguf_header(tiny_gguf)
    reader = gguf.GGUFReader(tiny_gguf)
    assert header.data_start == reader.data_offset
    assert header.tensors == [t.name for t in reader.tensors]
    assert header.vocab_size == len(reader.fields["tokenizer.ggml.tokens"].data)


@pytest.mark.unit
def test_a_pinned_sha256_refuses_another_file(tiny_gguf, tmp_path):
    from shared.gguf_vet import GGUFRefused, check_sha256, file_sha256, sha256_problem

    check_sha256(tiny_gguf, file_sha256(tiny_gguf).upper())  # any case
    other = tmp_path / "other.gguf"
    other.write_bytes(tiny_gguf.read_bytes()[:-1] + b"\1")
    with pytest.raises(GGUFRefused, match="not the one the config names"):
        check_sha256(other, file_sha256(tiny_gguf))
    assert sha256_problem("ab" * 32) is None and sha256_problem("xyz") and sha256_problem(None)


@pytest.mark.unit
def test_a_drafter_with_a_wrong_sha256_is_refused_before_loading(tiny_gguf, monkeypatch):
    import drafter_node.gguf as gguf_module
    from drafter_node.gguf import GGUFDrafter
    from drafter_node.settings import DrafterConfig
    from shared.models import ModelLoadError

    monkeypatch.setattr(gguf_module, "LlamaEngine", lambda *a, **k: pytest.fail("llama.cpp was reached"))
    own = SimpleNamespace(gguf_sha256="0" * 64, gguf_sequence_tokens=None)
    with pytest.raises(ModelLoadError, match=r"drafter\.gguf_sha256"):
        GGUFDrafter(DrafterConfig(type="gguf", model=str(tiny_gguf), kv_slot_tokens=256, kv_slots=1), own)


@pytest.mark.process
def test_the_probe_runs_in_a_child_with_limits(tiny_gguf, tmp_path):
    """A good file passes the probe; one llama.cpp cannot load (a valid header, no tensors) and one that needs more
    address space than the child may have are refused with what happened, not a crash of this process."""
    from shared.gguf_vet import GGUFRefused, probe_gguf

    assert "forward ok" in probe_gguf(tiny_gguf)
    empty = write(tmp_path / "empty.gguf", good_kvs(), [])
    with pytest.raises(GGUFRefused, match="exit"):
        probe_gguf(empty)
    with pytest.raises(GGUFRefused, match="probe child"):
        probe_gguf(tiny_gguf, headroom=16 << 20)


@pytest.mark.unit
def test_the_probe_child_gets_no_secret(monkeypatch):
    from shared.gguf_vet import probe_env
    from shared.transport import SECRET_ENV

    monkeypatch.setenv(SECRET_ENV, "s3cret")
    assert SECRET_ENV not in probe_env() and "s3cret" not in probe_env().values()


@pytest.mark.unit
def test_one_sequence_cannot_take_the_drafters_whole_kv_pool(tiny_gguf):
    """The pool is shared with a per-sequence cap: a forward past it fails (the sequence as before), and a session
    that could outgrow it is opened idle (not drafted for) while a short one drafts."""
    from drafter_node.gguf import GGUFDrafter, GGUFDraftSession, IdleDraftSession, sequence_cap
    from drafter_node.settings import DrafterConfig
    from shared.llama_engine import LlamaDecodeError
    from shared.sampling import GenerationParams

    assert sequence_cap(8 * 4096, 4096, None) == 8192 and sequence_cap(1024, 4096, None) == 1024
    own = SimpleNamespace(gguf_sha256=None, gguf_sequence_tokens=64)
    drafter = GGUFDrafter(DrafterConfig(type="gguf", model=str(tiny_gguf), kv_slot_tokens=256, kv_slots=2), own)
    try:
        engine = drafter.engine
        assert engine.max_seq_tokens == 64 and engine.n_ctx >= 512
        seq = engine.acquire()
        engine.decode([(seq, 0, [5] * 60)])
        with pytest.raises(LlamaDecodeError, match="cap of 64"):
            engine.decode([(seq, 60, [5] * 10)])
        engine.decode([(seq, 60, [5] * 4)])  # still at 60: up to the cap fits
        engine.release(seq)
        long = drafter.open_session([5] * 40, 40, GenerationParams(max_new_tokens=30), {})
        assert isinstance(long, IdleDraftSession)
        short = drafter.open_session([5] * 10, 10, GenerationParams(max_new_tokens=8), {})
        assert isinstance(short, GGUFDraftSession) and short.propose(3) == 3
        short.close()
    finally:
        drafter.engine.close()


@pytest.mark.unit
def test_the_config_refuses_a_malformed_sha256(tiny_gguf):
    from runtime.config import load_config

    base = {"drafter.type": "gguf", "drafter.model": str(tiny_gguf)}
    with pytest.raises(ValueError, match=r"drafter\.gguf_sha256: 'abc' is not a SHA-256"):
        load_config(overrides={**base, "drafter.gguf_sha256": "abc"})
    assert load_config(overrides={**base, "drafter.gguf_sha256": "ab" * 32})["drafter"]["gguf_sha256"] == "ab" * 32


@pytest.mark.unit
def test_a_hostile_vocabulary_claim_is_a_mismatch_not_an_error():
    """A hello's fingerprint with a non-ASCII digit (``²`` passes str.isdigit, not int) is refused as a mismatch;
    a target's prefix fingerprints are computed once and remembered."""
    import shared.models as models
    from shared.models import VocabPrefixes, vocab_fingerprint, vocab_prefix_matches

    tokens = [f"t{i}" for i in range(50)]
    for hostile in ("vocab:²:" + "0" * 32, "vocab:٣:00", "vocab:-1:00", "vocab:1e3:00"):
        assert not vocab_prefix_matches(hostile, tokens)
        assert not vocab_prefix_matches(hostile, VocabPrefixes(tokens))
    prefixes = VocabPrefixes(tokens)
    assert prefixes.matches(vocab_fingerprint(tokens)) and prefixes.matches(vocab_fingerprint(tokens[:30]))
    calls = []
    real = models.vocab_fingerprint
    models.vocab_fingerprint = lambda t: calls.append(len(t)) or real(t)
    try:
        assert prefixes.matches(real(tokens[:30])) and prefixes.matches(real(tokens))
        assert not prefixes.matches(real(tokens[:29])[:-1] + "x")
    finally:
        models.vocab_fingerprint = real
    assert calls == [29]  # the whole list's and the 30-token prefix's were remembered


@pytest.mark.unit
def test_the_config_refuses_a_hostile_gguf_before_any_node_starts(tmp_path):
    """``drafter.type: gguf`` with a header declaring 1000 layers: the config loader names the declaration."""
    from runtime.config import load_config

    path = write(tmp_path / "deep.gguf", good_kvs(blocks=1000), good_tensors())
    with pytest.raises(ValueError, match=r"llama\.block_count is 1000"):
        load_config(overrides={"drafter.type": "gguf", "drafter.model": str(path)})


@pytest.mark.process
def test_a_drafter_process_refuses_a_hostile_gguf_with_the_reason(tmp_path):
    """A process building the gguf drafter (as a node does, the config check skipped, as on another host) from a
    GGUF with a 10⁹-element token array exits with the reason, and llama.cpp never loaded it."""
    import subprocess
    import sys

    path = write(tmp_path / "huge.gguf", [*good_kvs()[:2], kv_strings("tokenizer.ggml.tokens", [], 10**9)],
                 good_tensors())
    code = ("import sys; from drafter_node.gguf import GGUFDrafter; from drafter_node.settings import DrafterConfig;"
            f"GGUFDrafter(DrafterConfig(type='gguf', model={str(path)!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "1,000,000,000 elements" in done.stderr and "llama_model_load" not in done.stderr


@pytest.mark.unit
def test_the_config_refuses_a_vocabulary_larger_than_the_targets_plus_slack(tiny, tmp_path):
    """A target folder's config.json gives its vocabulary: a drafter GGUF up to it + VOCAB_SLACK passes, one past
    it is refused when the config loads, with both sizes named."""
    import json

    from runtime.config import load_config
    from shared.gguf_header import VOCAB_SLACK

    target = tiny("qwen2", "target")
    size = json.loads((target / "config.json").read_text())["vocab_size"]
    base = {"verifier.model": str(target), "drafter.type": "gguf"}
    fits = write(tmp_path / "fits.gguf", good_kvs(vocab=size + VOCAB_SLACK), good_tensors())
    assert load_config(overrides={**base, "drafter.model": str(fits)})["drafter"]["model"] == str(fits)
    wide = write(tmp_path / "wide.gguf", good_kvs(vocab=size + VOCAB_SLACK + 1), good_tensors())
    with pytest.raises(ValueError, match=rf"vocabulary larger than .*target's vocabulary: {size:,} tokens"):
        load_config(overrides={**base, "drafter.model": str(wide)})
