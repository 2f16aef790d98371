"""Target backends (:mod:`shared.backend`): a static KV slot behaves exactly as a dynamic cache (feed, crop, logits,
K/V rows, tree rounds and kept paths, batched forwards over ragged rows), a verifier session on static slots is
token-identical to transformers' ``generate``, a running cluster with ``verifier.backend: static`` too; models the
static backend cannot serve fall back to dynamic caches, and a full pool or an over-long sequence gets a dynamic
cache, never a crash."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.backend import DynamicBackend, SlotOverflow, StaticBackend, StaticHandle, make_backend, static_problem
from shared.batch import Row
from shared.kv import CachedLM
from shared.sampling import GenerationParams
from testkit.tiny_models import reference_greedy
from verifier_node.session import Session
from verifier_node.tree import DraftTree, keep_path, tree_forward, tree_row

pytestmark = pytest.mark.unit

torch.set_num_threads(1)

ARCHS = ["llama", "qwen2", "gpt2"]
PARENTS = [-1, -1, 0, 0, 1, 2, 4, 4, 6]


def _load(folder, attn: str = "sdpa"):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn).eval()


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(2, 150, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _same_cache(a: CachedLM, b: CachedLM) -> None:
    assert a.length == b.length
    for la, lb in zip(a.cache.layers, b.cache.layers):
        assert la.keys.shape == lb.keys.shape
        assert torch.allclose(la.keys, lb.keys, atol=1e-5) and torch.allclose(la.values, lb.values, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_static_handle_feeds_and_rolls_back_like_a_dynamic_cache(tiny, arch):
    """Prefill, rounds with rollbacks (crop to a shorter length, crop to the same length), next_logits and K/V rows:
    the static handle's logits and cache equal the dynamic one's, and its cache layers are views of its slot."""
    model = _load(tiny(arch))
    backend = StaticBackend(model, slots=3, slot_tokens=64)
    static, dynamic = backend.open(), CachedLM(model)
    assert isinstance(static, StaticHandle) and static.capacity == 64 and dynamic.room is None
    prompt = _ids(1, 11)
    for lm in (static, dynamic):
        lm.feed(prompt, last_logits_only=True)
    _same_cache(static, dynamic)
    for step in range(4):
        fed = _ids(10 + step, 2 + step)
        a, _ = static.feed(fed)
        b, _ = dynamic.feed(fed)
        assert torch.allclose(a, b, atol=1e-4), (step, (a - b).abs().max())
        rows_a, rows_b = static.new_rows([0, 1], len(fed), 2), dynamic.new_rows([0, 1], len(fed), 2)
        assert all(torch.allclose(rows_a[k], rows_b[k], atol=1e-5) for k in rows_b)
        keep = static.length - len(fed) + 1 + step % 2
        static.crop(keep)
        dynamic.crop(keep)
        _same_cache(static, dynamic)
        assert static.room == 64 - keep
    held_a, held_b = static.held_rows([1]), dynamic.held_rows([1])
    assert torch.allclose(held_a["kv.1"], held_b["kv.1"], atol=1e-5)
    ids = [*prompt, *_ids(50, 3)]
    static.crop(5)
    dynamic.crop(5)
    assert torch.allclose(static.next_logits(ids), dynamic.next_logits(ids), atol=1e-4)
    layer = static.cache.layers[0]
    pool = backend.pool_keys[0]
    assert layer.keys.data_ptr() == pool[static.slot].data_ptr()  # a view of the pool, no copy
    static.check_kv_layers([0, 1])
    assert static.batchable


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_forward_over_slots_equals_one_forward_per_sequence(tiny, arch):
    """Ragged rows (prefixes of 0, 4, 16 and 8 tokens) in slots out of order (a gather) and in order (a view), three
    rounds with rollbacks: logits, hidden states and the slots left behind equal per-sequence dynamic forwards."""
    model = _load(tiny(arch))
    backend = StaticBackend(model, slots=6, slot_tokens=48)
    handles = [backend.open() for _ in range(6)]
    batched = [handles[4], handles[1], handles[5], handles[2]]  # slots 4, 1, 5, 2
    prefixes = [[], _ids(1, 4), _ids(2, 16), _ids(3, 8)]
    alone = [CachedLM(model) for _ in prefixes]
    for lms in (alone, batched):
        for lm, prefix in zip(lms, prefixes):
            if prefix:
                lm.feed(prefix)
    for step in range(3):
        rows = batched if step != 1 else sorted(batched, key=lambda h: h.slot)  # step 1: slots 1, 2, 4, 5
        order = [batched.index(h) for h in rows]
        counts = (3, 1, 6, 2)
        feeds = {i: _ids(10 * step + i, counts[i]) for i in range(4)}
        outs = backend.feed_rows([Row(h, feeds[i]) for h, i in zip(rows, order)], want_hidden=True)
        for out, i in zip(outs, order):
            logits, hidden = alone[i].feed(feeds[i], want_hidden=True)
            assert torch.allclose(out.logits, logits, atol=1e-4), (step, i, (out.logits - logits).abs().max())
            assert torch.allclose(out.hidden, hidden, atol=1e-4)
        for a, b, i in zip(alone, batched, range(4)):
            _same_cache(a, b)
            keep = a.length - len(feeds[i]) // 2
            a.crop(keep)
            b.crop(keep)
    # the prefill form: no logits, several prompts from empty slots
    for h in batched:
        h.crop(0)
    prompts = [_ids(30, 1), _ids(31, 7), _ids(32, 12), _ids(33, 3)]
    outs = backend.feed_rows([Row(h, p) for h, p in zip(batched, prompts)], want_hidden=True, logits=False)
    for h, p, out in zip(batched, prompts, outs):
        fresh = CachedLM(model)
        _, hidden = fresh.feed(p, want_hidden=True, last_logits_only=True)
        assert out.logits is None and torch.allclose(out.hidden, hidden, atol=1e-4)
        _same_cache(fresh, h)


@pytest.mark.parametrize(("arch", "attn"), [("llama", "sdpa"), ("qwen2", "eager"), ("gpt2", "sdpa")])
def test_tree_rounds_and_kept_paths_on_slots(tiny, arch, attn):
    """A token tree fed onto a slot (directly and as a row of a batched forward beside a chain row), then
    ``keep_path`` moves the accepted nodes inside the slot: logits and the kept cache equal the dynamic cache's."""
    model = _load(tiny(arch), attn)
    backend = StaticBackend(model, slots=4, slot_tokens=64)
    prefix, pending = _ids(3, 9), 77
    tree = DraftTree([20 + i for i in range(len(PARENTS))], PARENTS)
    for index, path in enumerate(([], [0], tree.path(5), tree.path(8), tree.path(7))):
        static, dynamic = backend.open(), CachedLM(model)
        other, other_alone = backend.open(), CachedLM(model)
        for lm in (static, dynamic):
            lm.feed(prefix)
        for lm in (other, other_alone):
            lm.feed(_ids(4, 5))
        expected, _ = tree_forward(DynamicBackend(model), dynamic, pending, tree)
        if index % 2 == 0:
            logits, _ = tree_forward(backend, static, pending, tree)
        else:
            outs = backend.feed_rows([Row(other, [9, 10]), tree_row(static, pending, tree)])
            logits = outs[1].logits
            assert torch.allclose(outs[0].logits, other_alone.feed([9, 10])[0], atol=1e-4)
        assert torch.allclose(logits, expected, atol=1e-4)
        keep_path(backend, static, len(tree), path)
        keep_path(DynamicBackend(model), dynamic, len(tree), path)
        _same_cache(static, dynamic)
        assert torch.allclose(static.feed([31])[0], dynamic.feed([31])[0], atol=1e-4)
        static.close()
        other.close()
    assert len(backend.free) == 4


def _session(model, tokenizer, backend, sid: int, prompt: list[int], **params) -> Session:
    s = Session(sid, backend or DynamicBackend(model), tokenizer, prompt,
                GenerationParams.from_dict({"eos_token_ids": [], **params}, 160), b"c", sid)
    s.prefill()
    return s


def test_verifier_sessions_on_slots_equal_generate(tiny):
    """Sessions on static slots, rounds alone and batched (right, half-right, wrong and no drafts; one session in a
    dynamic cache because the pool is full): every greedy output equals ``generate``; ending sessions frees slots."""
    folder = tiny("llama")
    model, tokenizer = _load(folder), AutoTokenizer.from_pretrained(folder)
    backend = StaticBackend(model, slots=3, slot_tokens=64)
    prompts = {1: _ids(20, 5), 2: _ids(21, 1), 3: _ids(22, 14), 4: _ids(23, 9)}
    truth = {sid: reference_greedy(folder, p, 30) for sid, p in prompts.items()}
    sessions = {sid: _session(model, tokenizer, backend, sid, p, max_new_tokens=30) for sid, p in prompts.items()}
    assert [isinstance(s.lm, StaticHandle) for s in sessions.values()] == [True, True, True, False]
    assert backend.fallbacks == 1
    rnd = 0
    while any(not s.finished for s in sessions.values()):
        live = [s for s in sessions.values() if not s.finished]
        plans = []
        for s in live:
            right = truth[s.sid][len(s.generated):]
            draft = [right[:4], [*right[:2], 3, 4, 5], [7, 7, 7, 7, 7, 7], []][(s.sid + rnd) % 4]
            plans.append(s.plan_round(draft, None))
        if rnd % 3 == 2:  # each alone
            for s, p in zip(live, plans):
                logits, _ = s.round_forward(p)
                s.finish_round(p, logits, None, 0.0)
        else:
            outs = backend.feed_rows([Row(s.lm, p.fed) for s, p in zip(live, plans)])
            for s, p, o in zip(live, plans, outs):
                s.finish_round(p, o.logits, None, 0.0, batch_sessions=len(live))
        rnd += 1
        assert rnd < 60
    for sid, s in sessions.items():
        assert s.generated == truth[sid], sid
        s.close()
        s.close()  # idempotent
    assert sorted(backend.free) == [0, 1, 2]


def test_a_full_pool_and_an_over_long_sequence_get_dynamic_caches(tiny):
    model = _load(tiny("llama"))
    backend = StaticBackend(model, slots=2, slot_tokens=16)
    a, b = backend.open(), backend.open()
    c = backend.open()  # the pool is full
    assert isinstance(a, StaticHandle) and isinstance(b, StaticHandle) and not isinstance(c, StaticHandle)
    assert isinstance(backend.open(tokens=17), CachedLM) and backend.fallbacks == 2  # longer than a slot
    a.close()
    d = backend.open(tokens=16)
    assert isinstance(d, StaticHandle) and d.slot == 0
    # A forward past the slot's end raises before it writes anything; the handle stays usable.
    d.feed(_ids(5, 12))
    before = d.cache.layers[0].keys.clone()
    with pytest.raises(SlotOverflow, match="more than its KV slot's 16"):
        d.feed(_ids(6, 5))
    with pytest.raises(SlotOverflow):
        backend.feed_rows([Row(d, _ids(6, 5)), Row(b, [3])])
    assert d.length == 12 and b.length == 0 and torch.equal(d.cache.layers[0].keys, before)
    alone = CachedLM(model)
    alone.feed(_ids(5, 12))
    assert torch.allclose(d.feed([4])[0], alone.feed([4])[0], atol=1e-4)
    # A mixed batch (a static and a dynamic handle) runs the copying path and stays exact.
    e = CachedLM(model)
    outs = backend.feed_rows([Row(b, [5, 6]), Row(e, [5, 6, 7])])
    assert torch.allclose(outs[0].logits, CachedLM(model).feed([5, 6])[0], atol=1e-4)
    assert b.length == 2 and e.length == 3
    d.close()
    with pytest.raises(ValueError, match="KV slot 0 is not taken"):
        backend.release(0)


def test_a_tree_that_would_overflow_the_slot_becomes_a_plain_step(tiny):
    folder = tiny("llama")
    model, tokenizer = _load(folder), AutoTokenizer.from_pretrained(folder)
    backend = StaticBackend(model, slots=1, slot_tokens=20)
    s = _session(model, tokenizer, backend, 1, _ids(40, 12), max_new_tokens=8)
    assert isinstance(s.lm, StaticHandle) and s.lm.length == 11
    plan = s.plan_round([20 + i for i in range(len(PARENTS))], None, PARENTS)  # 10 rows, room for 9
    assert plan.tree is None and plan.fed == [s.tokens[-1]]
    plan = s.plan_round([20, 21, 22], None, [-1, 0, 0])
    assert plan.tree is not None


def test_make_backend_sizes_slots_and_falls_back_where_static_cannot_serve(tiny, caplog, monkeypatch):
    model = _load(tiny("llama"))
    backend = make_backend(model, "auto", slots=2, slot_tokens=10**6)
    assert backend.name == "static" and backend.slot_tokens == model.config.max_position_embeddings
    assert make_backend(model, "dynamic", slots=2).name == "dynamic"
    with pytest.raises(ValueError, match="backend must be one of auto, dynamic, static, compiled"):
        make_backend(model, "jit", slots=2)
    monkeypatch.setattr(model.config, "_attn_implementation", "flash_attention_2")
    assert "ignores custom masks" in static_problem(model)
    with caplog.at_level(logging.INFO, logger="pipespec.backend"):
        assert isinstance(make_backend(model, "static", slots=2), DynamicBackend)
    assert "falls back to dynamic caches" in caplog.text


def test_hybrid_targets_fall_back_to_dynamic_caches(tmp_path, caplog):
    from testkit.tiny_hybrid import build_hybrid
    from testkit.tiny_models import build_tokenizer

    build_tokenizer(tmp_path / "tok")
    folder = build_hybrid(tmp_path / "qwen3_next", "qwen3_next", tmp_path / "tok", seed=3)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert "static slots hold plain attention layers only" in static_problem(model)
    for choice in ("auto", "static"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pipespec.backend"):
            backend = make_backend(model, choice, slots=2)
        assert isinstance(backend, DynamicBackend), choice
        assert f"KV backend {choice} falls back to dynamic caches" in caplog.text
    with pytest.raises(ValueError, match="cannot serve this model"):
        StaticBackend(model, 2, 16)

