"""The target seam (shared/target.py): nothing outside a backend module reads a cache tensor or a private field of a
sequence handle, the torch handles satisfy the handle protocol, the loader registry picks and refuses backends, and
admission reads a backend's ``capacity_tokens``."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared import target as target_mod
from shared.backend import DynamicBackend, StaticBackend, torch_target
from shared.kv import CachedLM
from shared.target import SequenceHandle, Target, TargetOptions, load_target, register_target_backend
from verifier_node.admission import DEFAULT_KV_TOKENS, MemoryAdmission

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
#: The runtime packages (what the nodes run).
RUNTIME = ("shared", "verifier_node", "drafter_node", "runtime", "http_server")
#: What only a backend may read: cache tensors, the model behind a handle, a handle's private fields.
PRIVATE = re.compile(
    r"\._sliding\b|\._device\b|\._keeps_logits\b|\.cache\.layers\b|\.cache\.crop\(|\blm\.model\b|\blm\.cache\b"
    r"|\blm\._[a-z]\w*|\bCachedLM\(")
#: Classes whose subclasses make a module a backend module (it owns the memory it reads).
BACKEND_BASES = {"TargetBackend", "TorchBackend", "StaticBackend", "SequenceCache", "CachedLM", "StaticHandle"}
#: The torch backends' batched forward (stacks the rows' caches): part of the dynamic backend.
BACKEND_HELPERS = {"shared/batch.py"}


def is_backend_module(text: str) -> bool:
    """A module that defines a backend or a handle class (``class X(TargetBackend)``, ``class Y(SequenceCache)``)."""
    bases = re.findall(r"^class \w+\(([^)]*)\)", text, flags=re.MULTILINE)
    return any(name.strip().split(".")[-1] in BACKEND_BASES for group in bases for name in group.split(","))


def private_reads(root: Path, packages: tuple[str, ...] = RUNTIME) -> list[str]:
    """``path:line: text`` of every read of a private cache field outside the backend modules under ``root``."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            text = path.read_text(encoding="utf-8")
            if relative in BACKEND_HELPERS or is_backend_module(text):
                continue
            for number, line in enumerate(text.splitlines(), 1):
                code = line.split("#", 1)[0]
                if PRIVATE.search(code) and not code.lstrip().startswith(('"', "'", "``")):
                    found.append(f"{relative}:{number}: {line.strip()}")
    return found


def test_no_private_cache_field_is_read_outside_a_backend_module():
    found = private_reads(ROOT)
    assert not found, "read a handle's memory only through shared.target's protocol:\n" + "\n".join(found)


def test_the_checker_finds_a_private_read(tmp_path):
    """The check above can fail: a caller that reaches into a handle is found, a backend module is not."""
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "caller.py").write_text(
        "def tree(lm):\n    out = lm.model(cache=lm.cache)\n    return lm.cache.layers[0].keys, lm._sliding\n")
    (tmp_path / "shared" / "mine.py").write_text(
        "class MyHandle(SequenceCache):\n    def feed(self):\n        return self.cache.layers, self._device\n")
    found = private_reads(tmp_path, ("shared",))
    assert [f.split(":")[1] for f in found] == ["2", "3"] and all(f.startswith("shared/caller.py") for f in found)


def test_torch_handles_satisfy_the_protocol(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny("llama"), dtype=torch.float32).eval()
    static = StaticBackend(model, slots=2, slot_tokens=32)
    handles = [DynamicBackend(model).open(), static.open(), static.open(), static.open()]  # the last: dynamic
    for lm in handles:
        assert isinstance(lm, SequenceHandle), type(lm)
        assert lm.batchable and lm.trees and not lm.recurrent and lm.batch_key is model
    assert [lm.room for lm in handles] == [None, 32, 32, None]
    assert static.capacity_tokens() == 64 and DynamicBackend(model).capacity_tokens() is None
    for lm in handles:
        lm.close()
    assert len(static.free) == 2


def test_a_tree_forward_and_keep_positions_leave_what_a_chain_would(tiny):
    """Siblings 8 and 9 at position 2 and 9's child 10 at position 3, fed in place; keeping 9 and 10 leaves the
    cache a chain forward of ``[5, 6, 9, 10]`` would; a position before the prefix is refused."""
    model = AutoModelForCausalLM.from_pretrained(tiny("llama"), dtype=torch.float32).eval()
    backend = DynamicBackend(model)
    lm = backend.open()
    lm.feed([5, 6])
    visible = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]], dtype=torch.bool)
    logits, _ = backend.feed_tree(lm, [8, 9, 10], [2, 2, 3], visible)
    chain = CachedLM(model)
    expected, _ = chain.feed([5, 6, 9, 10])
    assert lm.length == 5 and torch.allclose(logits[2], expected[3], atol=1e-5)
    with pytest.raises(ValueError, match="cannot keep"):
        backend.keep_positions(lm, 2, [1, 4])  # before the prefix
    backend.keep_positions(lm, 2, [3, 4])
    assert lm.length == 4
    assert torch.allclose(lm.feed([11])[0], chain.feed([11])[0], atol=1e-5)


def test_the_registry_loads_refuses_and_takes_new_backends(tiny, monkeypatch):
    path = tiny("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    section = SimpleNamespace(model=str(path), device="cpu", dtype="float32", max_memory=None, backend="static",
                              kv_slots=2, max_sessions=4, max_batch_sessions=2, kv_slot_tokens=48,
                              compiled_max_tokens=4)
    target = load_target(section, TargetOptions([1], None, model=model, tokenizer=tokenizer))
    assert isinstance(target, Target) and isinstance(target.backend, StaticBackend)
    assert target.backend.capacity_tokens() == 2 * 48 and target.vocab_size == model.config.vocab_size
    assert target.dtype == "float32" and target.device == "cpu" and target.profile is None
    assert target.max_positions == model.config.max_position_embeddings and not target.rollback_refeeds
    with pytest.raises(ValueError, match=r"verifier\.backend must be one of .*dynamic.*got 'paged'"):
        load_target(SimpleNamespace(**{**vars(section), "backend": "paged"}), TargetOptions([1]))
    monkeypatch.setattr(target_mod, "_LOADERS", dict(target_mod._LOADERS))
    made = torch_target(model, tokenizer)
    register_target_backend("paged")(lambda verifier, options: made)
    assert load_target(SimpleNamespace(backend="paged"), TargetOptions([1])) is made


def test_admission_takes_the_backends_capacity(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny("llama"), dtype=torch.float32).eval()
    target = torch_target(model, None, StaticBackend(model, slots=3, slot_tokens=40))
    a = MemoryAdmission.resolve(None, None, target.max_positions, target.backend.capacity_tokens())
    assert a.max_kv_tokens == 120
    dynamic = torch_target(model)
    assert MemoryAdmission.resolve(None, None, None, dynamic.backend.capacity_tokens()).max_kv_tokens == \
        DEFAULT_KV_TOKENS
