"""A request's own suffix trie is built a budget at a time (drafter_node/suffix_tree.py ``SuffixCache.build``): the
pieces add up to the trie and the proposals of a one-shot build, commits that arrive meanwhile queue behind the
prompt, no call takes more than its budget, and the drafter node's loop turn stays bounded with a 32k-token prompt
(counted in tokens put into tries, not timed) while it keeps sending drafts for its sessions."""

from __future__ import annotations

import random

import pytest
import zmq
from conftest import tiny_config
from test_suffix_tree import paths  # every path of a trie with its count

from drafter_node.node import DrafterNode
from drafter_node.suffix_tree import BUILD_BUDGET, SuffixCache, SuffixTrie, speculate
from runtime.config import load_config, typed
from runtime.security import drafter_links
from shared.protocol import Draft, SessionStart, decode, encode
from shared.sampling import GenerationParams

pytestmark = pytest.mark.unit

DEPTH = 6


def one_shot(tokens: list[int]) -> SuffixTrie:
    trie = SuffixTrie(DEPTH)
    trie.new_sequence(tokens)
    return trie


@pytest.fixture
def counted(monkeypatch):
    """A list whose one element counts the tokens appended to any SuffixTrie."""
    count = [0]
    append = SuffixTrie.append

    def counting(self, sid, token):
        count[0] += 1
        append(self, sid, token)

    monkeypatch.setattr(SuffixTrie, "append", counting)
    return count


@pytest.mark.parametrize("seed", range(6))
def test_pieces_with_commits_between_equal_a_one_shot_build(seed, counted):
    rng = random.Random(seed)
    budget = rng.randint(1, 40)
    prompt = [rng.randrange(5) for _ in range(rng.randint(BUILD_BUDGET + 1, BUILD_BUDGET + 300))]
    cache = SuffixCache(DEPTH, max_requests=0, max_tokens=0)  # the request's own trie alone
    counted[0] = 0
    req = cache.start(prompt[:-7], prompt[-7:])  # (moved from another drafter: the last 7 are response already)
    assert counted[0] == BUILD_BUDGET  # start takes one budget (all of a short prompt), the rest waits
    local = cache._local[req][0]
    assert paths(local) == paths(one_shot(prompt[:BUILD_BUDGET]))
    everything = list(prompt)
    while cache.unbuilt(req):
        if rng.random() < 0.3:  # commits arrive while the prompt is being built: they queue behind it
            commit = [rng.randrange(5) for _ in range(rng.randint(1, 5))]
            cache.append(req, commit)
            everything += commit
        before, waiting = counted[0], cache.unbuilt(req)
        left = cache.build(req, budget)
        assert counted[0] - before == min(budget, waiting)  # one call: at most its budget
        assert left == cache.unbuilt(req) == waiting - (counted[0] - before)
        # what is built so far is exactly a trie over the first tokens: drafts from it are sound
        assert local.tokens == len(everything) - left
    assert paths(local) == paths(one_shot(everything))
    cache.append(req, [1, 2])  # built: commits go straight in
    everything += [1, 2]
    reference = one_shot(everything)
    assert paths(local) == paths(reference) and local.nodes == reference.nodes
    for _ in range(50):
        context = [rng.randrange(5) for _ in range(rng.randint(1, 10))]
        got = cache.speculate(req, context, 8, 2.0, 0.05)
        want = speculate(reference, context, 8, 2.0, 0.05)
        assert (got.tokens, got.probs, got.match_len) == (want.tokens, want.probs, want.match_len)


def test_a_short_prompt_is_built_at_start_and_stop_drops_the_backlog():
    cache = SuffixCache(DEPTH, max_requests=0, max_tokens=0)
    short = cache.start([1, 2, 3, 1, 2], [])
    assert cache.unbuilt(short) == 0 and cache.speculate(short, [1, 2], 1, 1.0, 0.1).tokens == [3]
    long = cache.start(list(range(BUILD_BUDGET + 10)))
    assert cache.unbuilt(long) == 10
    cache.stop(long)
    assert cache.unbuilt(long) == 0 and cache.build(long) == 0


# ------------------------------------------------------------------------------------------------- the node's loop
LONG = 32 * 1024


@pytest.fixture
def node_and_verifier(tmp_path):
    """A suffix drafter node (its loop turned by hand) and a ROUTER socket playing its verifier."""
    endpoint = f"ipc://{tmp_path}/verifier.ipc"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    (tmp_path / "config.json").write_text("{}")  # the target's folder: the suffix drafter never loads it
    config = tiny_config(tmp_path, None, type="suffix")
    del config["drafter"]["model"]
    config = load_config(config)
    config["verifier"]["endpoint"] = endpoint
    node = DrafterNode.from_config(typed(config), links=drafter_links(config))
    yield node, router
    node.connection.close()
    router.close(linger=0)


def drafts(router) -> list[Draft]:
    out = []
    while router.poll(0):
        msg = decode(router.recv_multipart()[1:])
        if isinstance(msg, Draft):
            out.append(msg)
    return out


def test_the_node_turn_stays_bounded_with_a_32k_token_prompt(node_and_verifier, counted):
    node, router = node_and_verifier
    node.turn()  # hello
    assert router.poll(10_000)
    identity = router.recv_multipart()[0]
    rng = random.Random(0)
    params = GenerationParams(max_new_tokens=16, eos_token_ids=[]).to_dict()
    router.send_multipart([identity, *encode(SessionStart(session=0, token_ids=[rng.randrange(150) for _ in
                                                                                range(LONG)], params=params))])
    router.send_multipart([identity, *encode(SessionStart(session=1, token_ids=[5, 6, 7, 5, 6], params=params))])
    per_turn, first_draft = [], {}  # tokens put into tries per turn; session → the turn its first block went out
    for turn in range(20_000):
        counted[0] = 0
        node.turn()
        per_turn.append(counted[0])
        for d in drafts(router):
            first_draft.setdefault(d.session, turn)
        if not node.drafter.cache._backlog and {0, 1} <= set(node.picker.sessions) and len(first_draft) == 2:
            break
    assert not node.drafter.cache._backlog, "the long prompt's trie was never finished"
    # The turn that opens the sessions builds one budget at start and at most one more in a step; every other turn
    # at most one budget (before the change: all 32k tokens in the turn that read the session start).
    assert max(per_turn) <= 2 * BUILD_BUDGET + 5
    assert sum(per_turn) == LONG + 5  # every token once
    finished_at = max(i for i, n in enumerate(per_turn) if n)
    assert finished_at >= LONG // (2 * BUILD_BUDGET)
    # both sessions' first blocks went out while the long prompt was still being built
    assert max(first_draft.values()) < finished_at
