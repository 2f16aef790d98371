"""Token-tree verification (:mod:`verifier_node.tree`) and tree planning (:mod:`drafter_node.tree_plan`).

Tree rounds run as the verifier would (one tree forward, acceptance, cache compaction, crop) and must give exactly
transformers' greedy ``generate`` on the target alone, and under sampling the target's own joint distribution (with
a negative control that the same bound catches). The kept path's cache must equal a fresh forward of the committed
sequence."""

from __future__ import annotations

import copy
import random
import time

import pytest
import torch
from sampling_check import PROMPT, TV_BOUND, VOCAB, exact_joint, tv
from transformers import AutoModelForCausalLM

from drafter_node.cost_model import Acceptance
from drafter_node.tree_plan import TreePlan, expected_tokens, plan_from_acceptance, plan_tree, survival
from shared.backend import DynamicBackend
from shared.batch import feed_rows
from shared.kv import CachedLM
from shared.sampling import GenerationParams, make_generator, process_block, sample
from testkit.tiny_models import reference_greedy
from verifier_node.acceptance import accept_greedy
from verifier_node.tree import (
    DraftTree,
    TreeOutcome,
    accept_tree_greedy,
    accept_tree_sampling,
    keep_path,
    kept_rows,
    process_tree,
    tree_forward,
    tree_row,
)

pytestmark = pytest.mark.unit

torch.set_num_threads(1)

# A fixed tree with branches at several depths: node 8 hangs on a second branch (root → 1 → 4 → 8).
PARENTS = [-1, -1, 0, 0, 1, 2, 4, 4, 6]


def load(folder, attn: str = "sdpa"):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn).eval()


def scratch_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def distinct_tokens(parents: list[int], seed: int, vocab: int = 150) -> list[int]:
    """Random tokens with distinct siblings."""
    rng = random.Random(seed)
    tokens: list[int] = []
    for i, parent in enumerate(parents):
        taken = {tokens[j] for j in range(i) if parents[j] == parent}
        tokens.append(rng.choice([t for t in range(2, vocab) if t not in taken]))
    return tokens


def run_round(lm: CachedLM, tokens: list[int], prompt_len: int, tree: DraftTree, params: GenerationParams,
              rule) -> TreeOutcome:
    """One verifier round on ``tokens`` (the cache holds all but the last): forward, accept, compact, commit."""
    base_len = len(tokens)
    backend = DynamicBackend(lm.batch_key)  # the model the handle runs on
    logits, _ = tree_forward(backend, lm, tokens[-1], tree)
    scores = process_tree(logits, torch.tensor(tokens), tree, params, base_len - prompt_len)
    out = rule(scores, tree, base_len)
    keep_path(backend, lm, len(tree), out.nodes)
    tokens.extend(out.tokens)
    lm.crop(len(tokens) - 1)
    return out


# ---------------------------------------------------------------- DraftTree


@pytest.mark.parametrize(("tokens", "parents", "message"), [
    ([5, 6], [-1], "2 tokens but 1 parents"),
    ([5, 6, 7], [-1, 0, 5], "bad parent index 5"),
    ([5, 6], [-1, -2], "bad parent index -2"),
    ([5, 6, 7], [-1, 2, 0], "does not come before it"),
    ([5, 6], [-1, 1], "does not come before it"),
    ([5, 6, 5], [-1, 0, -1], "token 5 appears twice among the children of -1"),
    ([5, 6, 6], [-1, 0, 0], "token 6 appears twice among the children of 0"),
    ([1, 2, 3, 4, 5], [-1, 0, 1, 2, 3], "more than the 4 allowed"),
    ([5, -3], [-1, 0], "not a non-negative integer"),
])
def test_validate_errors(tokens, parents, message):
    with pytest.raises(ValueError, match=message):
        DraftTree(tokens, parents).validate(max_nodes=4)


def test_tree_helpers():
    tree = DraftTree(distinct_tokens(PARENTS, 0), PARENTS)
    tree.validate(max_nodes=9)
    DraftTree([5, 5], [-1, 0]).validate(4)  # the same token under different parents is fine
    assert tree.depths() == [1, 1, 2, 2, 2, 3, 3, 3, 4]
    assert tree.depth(8) == 4
    assert tree.children(-1) == [0, 1] and tree.children(4) == [6, 7] and tree.children(8) == []
    assert tree.path(8) == [1, 4, 6, 8] and tree.path(-1) == []
    chain = DraftTree.from_chain([9, 8, 7])
    assert chain.parents == [-1, 0, 1] and chain.path(2) == [0, 1, 2]
    cut = tree.truncate(2)
    assert cut.parents == [-1, -1, 0, 0, 1] and cut.tokens == tree.tokens[:5]
    assert tree.truncate(0).tokens == []


# ---------------------------------------------------------------- forward and cache compaction


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_tree_logits_and_kept_path_equal_fresh_forwards(tiny, arch, attn):
    """Every node's logits are a chain forward's of its path (directly on the cache and as a ``feed_rows`` row);
    after ``keep_path`` the next logits equal a fresh forward of the committed sequence, for paths on the first
    branch, on side branches and of length 0, after either route."""
    model = load(tiny(arch), attn)
    prefix = torch.randint(2, 150, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    pending = 77
    tree = DraftTree(distinct_tokens(PARENTS, 1), PARENTS)
    for index, path in enumerate(([], [], [0], tree.path(5), tree.path(8), tree.path(7))):
        lm = CachedLM(model)
        lm.feed(prefix)
        if index % 2 == 0:
            logits, hidden = tree_forward(DynamicBackend(model), lm, pending, tree, want_hidden=True)
        else:  # the same round as a row of a batched forward
            out = feed_rows(model, [tree_row(lm, pending, tree)], want_hidden=True)[0]
            logits, hidden = out.logits, out.hidden
        assert lm.length == len(prefix) + 1 + len(tree)
        if index < 2:  # check every node's logits once per route
            assert torch.allclose(logits[0], scratch_logits(model, [*prefix, pending]), atol=1e-4)
            for i in range(len(tree)):
                ids = [*prefix, pending, *(tree.tokens[j] for j in tree.path(i))]
                assert torch.allclose(logits[1 + i], scratch_logits(model, ids), atol=1e-4), i
            if index == 0:
                direct = logits, hidden
            assert torch.allclose(direct[0], logits, atol=1e-4) and torch.allclose(direct[1], hidden, atol=1e-4)
        keep_path(DynamicBackend(model), lm, len(tree), path)
        committed = [*prefix, pending, *(tree.tokens[i] for i in path)]
        assert lm.length == len(committed) == lm.cache.layers[0].keys.shape[-2]
        nxt = 31
        after, _ = lm.feed([nxt])
        assert torch.allclose(after[-1], scratch_logits(model, [*committed, nxt]), atol=1e-4), path


def test_tree_round_on_an_empty_cache(tiny):
    """A one-token prompt: the round's forward is the first one (nothing cached under the pending token)."""
    model = load(tiny("llama"))
    tree = DraftTree(distinct_tokens(PARENTS, 2), PARENTS)
    lm = CachedLM(model)
    logits, _ = tree_forward(DynamicBackend(model), lm, 9, tree)
    for i in range(len(tree)):
        ids = [9, *(tree.tokens[j] for j in tree.path(i))]
        assert torch.allclose(logits[1 + i], scratch_logits(model, ids), atol=1e-4), i
    path = tree.path(8)
    keep_path(DynamicBackend(model), lm, len(tree), path)
    assert kept_rows(path) == [0, *(1 + i for i in path)]
    after, _ = lm.feed([4])
    assert torch.allclose(after[-1], scratch_logits(model, [9, *(tree.tokens[i] for i in path), 4]), atol=1e-4)


# ---------------------------------------------------------------- greedy


def test_chain_tree_gives_the_chain_rule():
    """A chain as a tree: the same committed tokens as ``accept_greedy`` and the same processed scores as
    ``process_block`` (repetition penalty and min_new_tokens read the path)."""
    gen = torch.Generator().manual_seed(0)
    params = GenerationParams(repetition_penalty=1.3, min_new_tokens=3, eos_token_ids=[0])
    for case in range(200):
        k = case % 6
        logits = torch.randn(k + 1, 20, generator=gen)
        prefix = torch.randint(0, 20, (5,), generator=gen)
        target = logits.argmax(-1).tolist()
        draft = [target[i] if torch.rand((), generator=gen) < 0.7 else int(torch.randint(0, 20, (), generator=gen))
                 for i in range(k)]
        tree = DraftTree.from_chain(draft)
        scores = process_tree(logits, prefix, tree, params, case % 4)
        assert torch.equal(scores, process_block(logits, prefix, torch.tensor(draft, dtype=torch.long), params,
                                                 case % 4))
        out = accept_tree_greedy(scores, tree)
        assert out.tokens == accept_greedy(scores, draft)
        assert out.nodes == list(range(len(out.tokens) - 1))


def oracle_tree(model, context: list[int], rng: random.Random, max_nodes: int = 10, max_depth: int = 4) -> DraftTree:
    """A drafted tree that mixes the target's own argmax (in a random child slot, so accepted paths run through first
    and later children) with random tokens (rejections). Breadth first, so parents come first."""
    tokens, parents = [], []
    frontier = [(-1, 0, list(context))]
    while frontier and len(tokens) < max_nodes:
        parent, depth, ctx = frontier.pop(0)
        top = int(scratch_logits(model, ctx).argmax())
        width = rng.choice([1, 2, 2, 3])
        kids = rng.sample([t for t in range(2, 150) if t != top], width)
        if rng.random() < 0.7:
            kids[rng.randrange(width)] = top
        for token in kids[: max_nodes - len(tokens)]:
            tokens.append(token)
            parents.append(parent)
            if depth + 1 < max_depth:
                frontier.append((len(tokens) - 1, depth + 1, [*ctx, token]))
    return DraftTree(tokens, parents)


@pytest.mark.parametrize(("arch", "attn"), [("qwen2", "sdpa"), ("llama", "eager"), ("gpt2", "eager")])
def test_greedy_tree_generation_equals_generate(tiny, arch, attn):
    """Round after round of tree forward, greedy acceptance, kept path and crop: token-identical to ``generate``."""
    folder = tiny(arch)
    model = load(folder, attn)
    prompt = [5, 17, 33, 2, 60, 7, 41, 9]
    max_new = 48
    params = GenerationParams(max_new_tokens=max_new)
    rng = random.Random(7)
    lm = CachedLM(model)
    lm.feed(prompt[:-1])
    tokens = list(prompt)
    side, rejected, accepted, rounds = 0, 0, 0, 0
    while len(tokens) - len(prompt) < max_new:
        remaining = max_new - (len(tokens) - len(prompt))
        tree = oracle_tree(model, tokens, rng).truncate(remaining - 1)
        tree.validate(max_nodes=16)
        out = run_round(lm, tokens, len(prompt), tree, params, lambda scores, tree, _: accept_tree_greedy(scores, tree))
        assert len(tokens) - len(prompt) <= max_new  # the truncated tree keeps the round within the budget
        rounds += 1
        accepted += len(out.nodes)
        side += any(tree.children(tree.parents[i])[0] != i for i in out.nodes)
        last = out.nodes[-1] if out.nodes else -1
        rejected += bool(tree.children(last))  # the target's token matched none of the node's children
    print(f"{rounds} rounds, {accepted} drafts accepted, {side} rounds on a later branch, {rejected} rejections")
    assert tokens[len(prompt) :] == reference_greedy(folder, prompt, max_new)
    assert side > 0, "no round accepted a draft on a later branch: the test would not exercise trees"
    assert rejected > 0, "no round rejected: the test would not exercise corrections"
    assert accepted > rounds / 2, (accepted, rounds)


# ---------------------------------------------------------------- sampling


def top2_tree(drafter, context: list[int], memo: dict, depth: int = 2) -> DraftTree:
    """The drafter's top-2 at every node, ``depth`` levels (deterministic children: no draws)."""
    tokens, parents = [], []
    frontier = [(-1, list(context))]
    for _ in range(depth):
        nxt = []
        for parent, ctx in frontier:
            key = tuple(ctx)
            if key not in memo:
                memo[key] = scratch_logits(drafter, ctx).topk(2).indices.tolist()
            for token in memo[key]:
                tokens.append(token)
                parents.append(parent)
                nxt.append((len(tokens) - 1, [*ctx, token]))
        frontier = nxt
    return DraftTree(tokens, parents)


def accept_first_if_likely(scores: torch.Tensor, tree: DraftTree, generator: torch.Generator) -> TreeOutcome:
    """NEGATIVE CONTROL: takes a node's first child without a draw whenever the target gives it p ≥ 0.2 (biased
    towards the drafter's top-1), otherwise draws as the lossless rule does."""
    p = scores.softmax(-1)
    node, tokens, nodes = -1, [], []
    while True:
        kids = tree.children(node)
        if kids and float(p[node + 1, tree.tokens[kids[0]]]) >= 0.2:
            token = tree.tokens[kids[0]]
        else:
            token = sample(p[node + 1], generator)
        tokens.append(token)
        child = next((c for c in kids if tree.tokens[c] == token), None)
        if child is None:
            return TreeOutcome(tokens, nodes)
        nodes.append(child)
        node = child


N_SAMPLES = 800  # sampling_check's N, so its measured bound applies


def sampled_joint(target, drafter, rule) -> tuple[torch.Tensor, int, int]:
    """Empirical joint of the first two tokens from N seeded requests, each run as tree rounds; also how many
    requests accepted a node on a second branch, and how many got both tokens from one round (the second drawn
    from a node's row of the tree forward)."""
    params = GenerationParams(max_new_tokens=2, do_sample=True)
    counts = torch.zeros(VOCAB, VOCAB)
    memo: dict = {}
    side = one_round = 0
    for seed in range(N_SAMPLES):
        lm = CachedLM(target)
        lm.feed(PROMPT[:-1])
        tokens = list(PROMPT)
        hit, rounds = False, 0
        while len(tokens) < len(PROMPT) + 2:
            remaining = len(PROMPT) + 2 - len(tokens)
            tree = top2_tree(drafter, tokens, memo).truncate(remaining - 1)
            out = run_round(lm, tokens, len(PROMPT), tree, params,
                            lambda scores, tree, base_len, seed=seed: rule(
                                scores, tree, make_generator(seed, base_len, stream=0)))
            hit |= any(tree.children(tree.parents[i])[0] != i for i in out.nodes)
            rounds += 1
        side += hit
        one_round += rounds == 1
        counts[tokens[len(PROMPT)], tokens[len(PROMPT) + 1]] += 1
    return counts / N_SAMPLES, side, one_round


def noisy_copy(model, scale: float, seed: int):
    """A second tiny model close to ``model``: its LM head plus Gaussian noise of ``scale`` times the head's spread
    (an unrelated random drafter's top-2 almost never holds the peaked target's sample, so no branch would be
    tested)."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        head = other.get_output_embeddings().weight
        head += torch.randn(head.shape, generator=torch.Generator().manual_seed(seed)) * head.std() * scale
    return other


@pytest.mark.statistical
def test_sampling_tree_is_lossless_and_the_control_is_caught(sharp_pair):
    target = load(sharp_pair[0])
    drafter = noisy_copy(target, 1.0, seed=5)
    exact = exact_joint(target)
    t0 = time.monotonic()
    empirical, side, one_round = sampled_joint(target, drafter, accept_tree_sampling)
    lossless = tv(empirical, exact)
    control = tv(sampled_joint(target, drafter, accept_first_if_likely)[0], exact)
    print(f"tree sampling TV {lossless:.3f} (bound {TV_BOUND}), control {control:.3f}, "
          f"{side} of {N_SAMPLES} requests accepted a second branch, {one_round} took one round, "
          f"{time.monotonic() - t0:.1f} s")
    assert side > N_SAMPLES // 20, "second branches were (almost) never accepted: the test would not exercise trees"
    assert one_round > N_SAMPLES // 4, "too few second tokens came from the tree forward's node rows"
    assert lossless < TV_BOUND
    assert control > TV_BOUND, "the biased control must fail the same bound, or the check tests nothing"


# ---------------------------------------------------------------- tree planning


def flat(seconds: float):
    return lambda n: seconds


def steep(base: float, per_token: float):
    return lambda n: base + per_token * n


def test_expected_tokens_is_exact_for_the_model():
    """The closed form against a simulation of the model's assumptions (α by position, g for a second choice)."""
    alphas, g = [0.8, 0.6, 0.5, 0.4], 0.35
    parents, ranks = [-1, -1, 0, 0, 2, 2, 3, 4], [0, 1, 0, 1, 0, 1, 0, 0]
    depths = _depths(parents)
    rng = random.Random(0)
    total, trials = 0, 40000
    for _ in range(trials):
        node, committed = -1, 1
        while True:
            kids = [i for i, p in enumerate(parents) if p == node]
            d = 0 if node < 0 else depths[node] + 1  # the position of the children's tokens
            first = next((c for c in kids if ranks[c] == 0), None)
            second = next((c for c in kids if ranks[c] == 1), None)
            if first is not None and rng.random() < alphas[d]:
                node = first
            elif second is not None and rng.random() < g:
                node = second
            else:
                break
            committed += 1
        total += committed
    exact = expected_tokens(parents, ranks, alphas, g)
    assert abs(total / trials - exact) < 0.02, (total / trials, exact)
    chain = expected_tokens([-1, 0, 1], [0, 0, 0], alphas, g)
    assert chain == pytest.approx(sum(survival(alphas, 3)))


def _depths(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def test_plan_shape_and_expected_tokens_agree():
    plan = plan_tree([0.7, 0.5, 0.5, 0.3], 0.4, flat(0.02), 0.002)
    parents, ranks = plan.shape()
    assert len(parents) == plan.nodes
    assert plan.expected == pytest.approx(expected_tokens(parents, ranks, [0.7, 0.5, 0.5, 0.3], 0.4))
    assert TreePlan(2, [1], 0.0, 0.0).shape() == ([-1, 0, 0], [0, 0, 1])


def test_flat_curve_and_mid_acceptance_branch():
    plan = plan_tree([0.5] * 6, 0.3, flat(0.02), 0.002)
    assert plan.k > 0 and plan.width == 2 and plan.sides


def test_curve_flat_to_eight_tokens_spends_them_on_the_least_sure_positions():
    """A GPU-like curve (flat up to 8 tokens, then steep): the free tokens go to side leaves where a rejection is
    likeliest (position 2 first), the positions with the largest gain s_i·(1 − α_i)·g."""
    alphas, g = [0.9, 0.9, 0.3, 0.9, 0.9, 0.3, 0.9, 0.9], 0.4
    plan = plan_tree(alphas, g, lambda n: 0.02 if n <= 8 else 0.02 + 0.01 * (n - 8), 0.001)
    assert plan.width == 2 and 1 + plan.nodes <= 8 and 2 in plan.sides, plan
    s = survival(alphas, plan.k)
    gain = [s[i] * (1 - alphas[i]) * g for i in range(plan.k)]
    assert min(gain[i] for i in plan.sides) >= max((gain[i] for i in range(plan.k) if i not in plan.sides), default=0)


def test_steep_curve_gives_a_chain():
    plan = plan_tree([0.8] * 6, 0.3, steep(0.01, 0.005), 0.001)
    assert plan.k > 0 and plan.sides == [] and plan.width == 1


def test_plan_from_a_cost_models_acceptance():
    acc = Acceptance(4)  # its priors: α = 0.6 everywhere, correction guess 0.3
    assert plan_from_acceptance(acc, 4, flat(0.02), 0.002) == plan_tree([0.6] * 4, 0.3, flat(0.02), 0.002)


def test_low_acceptance_and_steep_curve_gives_no_draft():
    plan = plan_tree([0.05] * 6, 0.3, steep(0.01, 0.01), 0.001)
    assert plan.k == 0 and plan.nodes == 0
