"""The suffix structure behind the ``suffix`` drafter (drafter_node/suffix_tree.py): counts, matching, the
proposal rules, incremental insertion, removal and the bounded cross-request cache, against brute force."""

from __future__ import annotations

import gc
import math
import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter_node.suffix_tree import SuffixCache, SuffixTrie, speculate
from runtime.config import ConfigError, load_config

pytestmark = pytest.mark.unit


def paths(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every path of the trie (the root excluded) with its count."""
    out: dict[tuple[int, ...], int] = {}
    stack = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for tok, child in node.children():
            out[(*path, tok)] = child.count
            stack.append(((*path, tok), child))
    return out


def brute_counts(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    """Occurrences of every substring of length ≤ depth, over all sequences."""
    out: dict[tuple[int, ...], int] = {}
    for seq in seqs:
        for i in range(len(seq)):
            for n in range(1, min(depth, len(seq) - i) + 1):
                key = tuple(seq[i : i + n])
                out[key] = out.get(key, 0) + 1
    return out


def brute_speculate(seqs, depth, context, max_tokens, factor, min_prob):
    """The proposal rule written out over brute-force counts: (score, match length, tokens) of the best one."""
    counts = brute_counts(seqs, depth)
    best = (0.0, 0, [])
    for m in range(1, min(depth, len(context)) + 1):
        path = tuple(context[len(context) - m :])
        if path not in counts:
            break
        tokens, probs, prob = [], [], 1.0
        while len(tokens) < min(max_tokens, math.ceil(factor * m)):
            kids = [(counts[(*path, t)], -t, t) for (*p, t) in map(tuple, counts) if len(p) == len(path)
                    and tuple(p) == path] if len(path) < depth else []
            if not kids:
                break
            c, _, t = max(kids)
            prob *= c / counts[path]
            if prob < min_prob:
                break
            tokens.append(t)
            probs.append(prob)
            path = (*path, t)
        if tokens and sum(probs) >= best[0]:
            best = (sum(probs), m, tokens)
    return best


def test_counts_are_occurrences_of_each_path():
    trie = SuffixTrie(3)
    trie.new_sequence([1, 2, 1, 2, 3])
    assert trie.root.count == 5  # one suffix per token
    assert paths(trie) == brute_counts([[1, 2, 1, 2, 3]], 3)
    assert trie.walk([1, 2]).count == 2 and trie.walk([1, 2, 1]).count == 1
    assert trie.walk([1, 2, 1, 2]) is None  # deeper than the trie
    assert trie.nodes == 1 + len(paths(trie))


def test_longest_match_wins_when_it_scores_best():
    trie = SuffixTrie(8)
    # after [7, 1] comes 5 (twice); after [1] alone 2 comes more often
    trie.new_sequence([7, 1, 5, 6, 0, 1, 2, 9, 1, 2, 9, 1, 2, 9, 7, 1, 5, 6])
    p = speculate(trie, [3, 7, 1], max_tokens=4, max_spec_factor=2.0, min_token_prob=0.1)
    assert p.match_len == 2 and p.tokens == [5, 6, 0, 1]
    assert p.probs[:2] == [1.0, 1.0]  # [7,1] → 5 always, [7,1,5] → 6 always
    assert speculate(trie, [8, 8], 4, 2.0, 0.1).tokens == []  # nothing matches


def test_probability_threshold_stops_the_chain():
    trie = SuffixTrie(6)
    trie.new_sequence([1, 2, 3, 1, 2, 4, 1, 2, 5])
    # [1, 2] is followed by 3, 4, 5 once each: the next token has probability 1/3 (node [1,2] counts 3)
    assert speculate(trie, [1, 2], 5, 4.0, min_token_prob=0.3).tokens == [3, 1, 2, 4]  # then the depth ends it
    assert speculate(trie, [1, 2], 5, 4.0, min_token_prob=0.34).tokens == []
    # the product is what is thresholded: 1/3 · 1 · 1 … stays 1/3
    p = speculate(trie, [1, 2], 5, 4.0, min_token_prob=0.0)
    assert p.probs == pytest.approx([1 / 3] * len(p.tokens))


def test_spec_factor_and_block_length_bound_the_proposal():
    trie = SuffixTrie(16)
    trie.new_sequence(list(range(10)) * 2)
    assert len(speculate(trie, [0], 20, 1.0, 0.1).tokens) == 1  # match 1 → at most ceil(1 · 1) tokens
    assert len(speculate(trie, [0], 20, 2.5, 0.1).tokens) == 3  # ceil(2.5 · 1)
    assert len(speculate(trie, [8, 9, 0], 20, 1.0, 0.1).tokens) == 3
    assert len(speculate(trie, [8, 9, 0], 2, 1.0, 0.1).tokens) == 2  # the block length asked for


def test_depth_caps_match_plus_proposal():
    trie = SuffixTrie(4)
    trie.new_sequence(list(range(10)) * 2)
    p = speculate(trie, [1, 2, 3], 20, 10.0, 0.0)
    assert p.match_len + len(p.tokens) <= 4
    assert max(len(k) for k in paths(trie)) == 4


def test_incremental_append_equals_a_rebuild():
    rng = random.Random(1)
    seq = [rng.randrange(5) for _ in range(200)]
    grown = SuffixTrie(5)
    sid = grown.new_sequence()
    for t in seq:
        grown.append(sid, t)
    built = SuffixTrie(5)
    built.new_sequence(seq)
    assert paths(grown) == paths(built) == brute_counts([seq], 5) and grown.nodes == built.nodes


def test_removal_takes_the_counts_back_and_frees_nodes():
    trie = SuffixTrie(6)
    a = trie.new_sequence([1, 2, 3, 4, 5, 6, 7])
    alone = trie.nodes
    b = trie.new_sequence([9, 8, 1, 2, 3, 0])
    assert trie.nodes > alone
    trie.remove(b)
    assert paths(trie) == brute_counts([[1, 2, 3, 4, 5, 6, 7]], 6) and trie.nodes == alone
    trie.remove(a)
    assert trie.nodes == 1 and trie.root.count == 0 and paths(trie) == {}


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 3), max_size=25), min_size=1, max_size=4),
       depth=st.integers(2, 6), drop=st.integers(0, 3), context=st.lists(st.integers(0, 3), max_size=8),
       max_tokens=st.integers(1, 6), factor=st.sampled_from([0.5, 1.0, 2.0, 5.0]),
       min_prob=st.sampled_from([0.0, 0.1, 0.3, 0.6]))
def test_trie_and_proposals_match_brute_force(seqs, depth, drop, context, max_tokens, factor, min_prob):
    trie = SuffixTrie(depth)
    ids = [trie.new_sequence(s) for s in seqs]
    if drop < len(seqs):
        trie.remove(ids[drop])
        seqs = seqs[:drop] + seqs[drop + 1 :]
    assert paths(trie) == brute_counts(seqs, depth)
    assert trie.nodes == 1 + len(paths(trie))
    got = speculate(trie, context, max_tokens, factor, min_prob)
    score, m, tokens = brute_speculate(seqs, depth, context, max_tokens, factor, min_prob)
    assert got.tokens == tokens and got.score == pytest.approx(score)
    if tokens:
        assert got.match_len == m


def test_a_pattern_from_an_earlier_response_is_proposed_to_a_new_request():
    cache = SuffixCache(max_depth=16, max_requests=10, max_tokens=1000)
    call = [40, 41, 42, 43, 44, 45, 46, 47]  # a tool-call pattern the first request answered with
    first = cache.start(prompt=[1, 2, 3], response=[])
    cache.append(first, [9, *call, 10])
    cache.stop(first)
    second = cache.start(prompt=[5, 6, 7], response=[])  # its prompt lacks the pattern
    assert cache.speculate(second, [5, 6, 7, 40, 41, 42], 8, 1.0, 0.1).tokens == [43, 44, 45]
    # with no cross-request cache nothing is proposed
    empty = SuffixCache(max_depth=16, max_requests=0, max_tokens=1000)
    r = empty.start([5, 6, 7], [])
    assert empty.speculate(r, [5, 6, 7, 40, 41, 42], 8, 1.0, 0.1).tokens == []


def test_the_active_response_is_shared_as_it_grows():
    cache = SuffixCache(16, 10, 1000)
    a = cache.start([1], [])
    b = cache.start([2], [])
    cache.append(a, [50, 51, 52, 53])  # a is still running
    assert cache.speculate(b, [2, 50, 51], 4, 1.0, 0.1).tokens == [52, 53]


def test_eviction_by_request_count_removes_the_oldest():
    cache = SuffixCache(8, max_requests=2, max_tokens=1000)
    for i in range(3):
        r = cache.start([0], [])
        cache.append(r, [100 + i, 200 + i, 300 + i])
        cache.stop(r)
    assert cache.cached_requests == 2 and cache.cached_tokens == 6
    cache.stop(cache.start([0], []))  # a request that generated nothing takes no place
    assert cache.cached_requests == 2 and cache.global_trie.walk([101]) is not None
    assert cache.global_trie.walk([100]) is None and cache.global_trie.walk([101, 201]) is not None
    assert paths(cache.global_trie) == brute_counts([[101, 201, 301], [102, 202, 302]], 8)


def test_eviction_by_tokens_shrinks_the_trie():
    cache = SuffixCache(8, max_requests=100, max_tokens=25)
    sizes = []
    for i in range(6):
        r = cache.start([0], [])
        cache.append(r, [1000 * i + j for j in range(10)])  # 10 distinct tokens each
        cache.stop(r)
        sizes.append(cache.global_trie.nodes)
        assert cache.cached_tokens <= 25
    assert cache.cached_requests == 2  # 3 × 10 > 25
    assert sizes[-1] == sizes[2] < sizes[2] + 10  # bounded: the node count stops growing
    kept = [[1000 * i + j for j in range(10)] for i in (4, 5)]
    assert paths(cache.global_trie) == brute_counts(kept, 8)


def test_eviction_gives_the_memory_back_and_a_token_costs_at_most_the_documented_bound():
    rng = random.Random(3)
    tokens = [rng.randrange(100_000) for _ in range(2000)]  # nothing shared: the worst case per token
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        cache = SuffixCache(24, max_requests=1, max_tokens=100_000)
        first = cache.start([0], [])
        cache.append(first, tokens)
        cache.stop(first)
        full = tracemalloc.get_traced_memory()[0] - base
        second = cache.start([0], [])
        cache.append(second, [7])  # one request cached at most: the first is evicted
        cache.stop(second)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert full / len(tokens) < 2000  # docs/drafter-types.md: about 1.6 kB per token at depth 24, worst case
    assert after < full / 20, (full, after)
    print(f"{full / len(tokens):.0f} bytes per token, {after} bytes after eviction")


def test_one_response_longer_than_the_cap_keeps_only_what_fits():
    cache = SuffixCache(4, max_requests=10, max_tokens=5)
    r = cache.start([0], [])
    cache.append(r, list(range(20)))
    assert cache.cached_tokens == 5 and cache.global_trie.tokens == 5
    assert cache.global_trie.walk([5]) is None
    assert cache.speculate(r, [7, 8], 2, 1.0, 0.1).tokens == [9, 10]  # its own trie has everything


def test_evicting_another_active_request_stops_its_global_additions():
    cache = SuffixCache(4, max_requests=1, max_tokens=100)
    a = cache.start([0], [])
    cache.append(a, [1, 2])
    b = cache.start([0], [])
    cache.append(a, [3, 4])
    cache.append(b, [5, 6])  # b's first tokens evict a (the oldest) from the global trie
    assert cache.cached_requests == 1 and cache.global_trie.walk([3]) is None
    cache.append(a, [5])
    assert cache.cached_tokens == 2  # a stays out
    assert cache.speculate(a, [2, 3], 1, 1.0, 0.1).tokens == [4]  # a drafts from its own trie


def test_an_older_active_request_that_grows_evicts_a_newer_one_over_the_token_cap():
    cache = SuffixCache(4, max_requests=10, max_tokens=6)
    old = cache.start([0], [])
    new = cache.start([0], [])
    cache.append(new, [7, 8, 9])
    cache.append(old, [1, 2, 3, 4])  # 7 tokens > 6: the other response goes, though it is the newer one
    assert cache.cached_tokens == 4 and cache.cached_requests == 1
    assert cache.global_trie.walk([7]) is None and cache.global_trie.walk([1, 2, 3, 4]) is not None
    cache.append(new, [10])  # evicted from the global trie: it stays out
    assert cache.cached_tokens == 4


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["start", "append", "stop"]), st.integers(0, 5),
                              st.lists(st.integers(0, 3), max_size=6)), max_size=30),
       max_requests=st.integers(0, 3), max_tokens=st.integers(0, 12), max_tenants=st.integers(1, 3))
def test_the_cache_stays_within_its_bounds_and_its_trie_matches_what_it_keeps(ops, max_requests, max_tokens,
                                                                               max_tenants):
    cache = SuffixCache(4, max_requests, max_tokens, max_tenants)
    tenants = [None, "a", "b", "c"]
    live: list[int] = []
    for op, pick, tokens in ops:
        if op == "start" or not live:
            live.append(cache.start([9], tokens, tenant=tenants[pick % len(tenants)]))
        elif op == "append":
            cache.append(live[pick % len(live)], tokens)
        else:
            cache.stop(live.pop(pick % len(live)))
        assert cache.cached_requests <= max_requests and cache.tenants <= max_tenants
        total = 0
        for tenant in tenants:  # each tenant's trie holds exactly its kept responses
            trie = cache.trie_of(tenant)
            kept = [list(trie.sequence(seq)) for t, seq in cache._order.values() if t == tenant]
            total += sum(map(len, kept))
            assert paths(trie) == brute_counts(kept, 4)
            assert trie.nodes == 1 + len(paths(trie))
        assert cache.cached_tokens == total <= max_tokens


def test_a_tenant_is_never_offered_another_tenants_response():
    """Tenant B's request whose context ends like tenant A's response gets nothing from the global part; A's next
    request does; requests without a tenant share one scope of their own."""
    response = [101, 7, 6, 42, 999, 1234, 55, 66]
    cache = SuffixCache(16, max_requests=10, max_tokens=1000)
    a = cache.start([1, 2, 3], [], tenant="A")
    cache.append(a, response)
    cache.stop(a)
    b = cache.start([8, 9, 101, 7, 6], [], tenant="B")
    assert cache.speculate(b, [8, 9, 101, 7, 6], 8, 1.0, 0.1).tokens == []
    anon = cache.start([8, 9, 101, 7, 6], [])
    assert cache.speculate(anon, [8, 9, 101, 7, 6], 8, 1.0, 0.1).tokens == []
    a2 = cache.start([8, 9, 101, 7, 6], [], tenant="A")
    assert cache.speculate(a2, [8, 9, 101, 7, 6], 3, 1.0, 0.1).tokens == [42, 999, 1234]
    # opted in: one scope for everyone, as before tenants
    shared = SuffixCache(16, 10, 1000, share_across_tenants=True)
    a = shared.start([1, 2, 3], [], tenant="A")
    shared.append(a, response)
    b = shared.start([8, 9, 101, 7, 6], [], tenant="B")
    assert shared.speculate(b, [8, 9, 101, 7, 6], 3, 1.0, 0.1).tokens == [42, 999, 1234]


def test_the_least_recently_used_tenant_is_dropped_over_the_tenant_bound():
    cache = SuffixCache(8, max_requests=100, max_tokens=1000, max_tenants=2)
    for tenant, token in (("A", 10), ("B", 20)):
        r = cache.start([0], [], tenant=tenant)
        cache.append(r, [token, token + 1, token + 2])
        cache.stop(r)
    probe = cache.start([0], [], tenant="A")  # A drafts: now B is the least recently used
    assert cache.speculate(probe, [10], 2, 1.0, 0.1).tokens == [11]
    c = cache.start([0], [], tenant="C")
    cache.append(c, [30, 31])
    assert cache.tenants == 2 and cache.trie_of("B").walk([20]) is None and cache.trie_of("A").walk([10]) is not None
    assert cache.cached_requests == 2 and cache.cached_tokens == 5


def test_suffix_config_needs_no_model_and_checks_its_keys():
    config = load_config("suffix.yaml")
    assert config["drafter"]["type"] == "suffix" and config["drafter"]["model"] is None
    with pytest.raises(ConfigError, match=r"drafter\.suffix_min_token_prob"):
        load_config("suffix.yaml", ["drafter.suffix_min_token_prob=2"])
    # one-hot drafts: no q to ensemble with
    with pytest.raises(ConfigError, match="not supported with suffix decoding"):
        load_config("suffix.yaml", {"verification.ensemble_weight": 0.7})
