"""The exactness reference of the llama.cpp target: llama.cpp's own greedy decoding of a GGUF, one token per forward.

:func:`llama_greedy` loads the GGUF in a fresh llama.cpp context (llama-cpp-python's low-level API, nothing of
pipespec's engine), feeds the prompt one token per ``llama_decode`` and then each token llama.cpp's own greedy
sampler (``llama_sampler_init_greedy``) picks, one per ``llama_decode``: what ``llama-cli --temp 0`` would emit.
With each token it records the logit margin of that step (best minus second best).

:func:`greedy_agrees` is the contract the tests check: pipespec's tokens equal the reference's, except that the two
may part at a step whose reference margin is below ``tie``: there batched and one-token forwards sum in different
orders (llama.cpp's matrix kernels tile a batch differently), so logits differ in their last bits and two near-equal
candidates may swap. Past such a step the sequences are different texts and are not compared further.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Default near-tie margin (logits) for a float32 GGUF, whose batched and one-token logits differ by ~1e-5. A
#: quantized one differs far more: the 1.5B's Q4_K_M by up to 0.76 on the AVX2 host (llama.cpp runs a batch through
#: repacked q4_K_8x8 matrix kernels, one token through its vector kernels); take its bound from
#: :func:`batch_noise`.
DEFAULT_TIE = 1e-3


@dataclass
class Reference:
    tokens: list[int]
    margins: list[float]  # per generated token: best logit minus the second best at that step


def llama_greedy(path: str | Path, prompt: list[int], max_new_tokens: int, stop: tuple[int, ...] = (),
                 threads: int = 1) -> Reference:
    """llama.cpp's greedy continuation of ``prompt`` (at most ``max_new_tokens``, ending after a ``stop`` token),
    each token a ``llama_decode`` of its own."""
    import llama_cpp as lib

    from shared.llama_engine import _quiet_logs

    lib.llama_backend_init()
    _quiet_logs(lib)  # its chatter to the debug log, not stderr
    mparams = lib.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = lib.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    cparams = lib.llama_context_default_params()
    cparams.n_ctx = len(prompt) + max_new_tokens + 8
    cparams.n_batch = cparams.n_ubatch = 1  # one token per forward, the prompt's too
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = lib.llama_init_from_model(model, cparams)
    n_vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model)))
    sampler = lib.llama_sampler_init_greedy()
    tokens, margins = [], []
    try:
        fed = list(prompt)
        for pos in range(len(prompt) + max_new_tokens):
            token = fed[pos]
            ids = (lib.llama_token * 1)(token)  # kept alive: the batch points into it
            batch = lib.llama_batch_get_one(ids, 1)
            if lib.llama_decode(ctx, batch) != 0:
                raise RuntimeError(f"llama.cpp failed a forward at position {pos}")
            if pos < len(prompt) - 1:
                continue
            logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            best, second = np.partition(logits, -2)[-2:][::-1]
            chosen = int(lib.llama_sampler_sample(sampler, ctx, -1))
            tokens.append(chosen)
            margins.append(float(best - second))
            if chosen in stop or len(tokens) == max_new_tokens:
                break
            fed.append(chosen)
    finally:
        lib.llama_sampler_free(sampler)
        lib.llama_free(ctx)
        lib.llama_model_free(model)
    return Reference(tokens, margins)


def batch_noise(path: str | Path, ids: list[int], threads: int = 1) -> float:
    """The largest logit difference between llama.cpp's one-token forwards of ``ids`` and one batched forward of
    them (the same context, position by position): the size of the near-ties batched verification can swap."""
    from shared.llama_engine import LlamaEngine

    engine = LlamaEngine(Path(path), n_ctx=2 * len(ids) + 8, n_seq=2, threads=threads)
    try:
        single = [engine.decode([(0, i, [t])])[0] for i, t in enumerate(ids)]
        batched = engine.decode([(1, 0, list(ids))], all_logits=True)[0]
    finally:
        engine.close()
    return float(max(np.abs(a - b).max() for a, b in zip(single, batched)))


def greedy_agrees(got: list[int], ref: Reference, tie: float = DEFAULT_TIE) -> tuple[bool, str]:
    """(True, how) when ``got`` is the reference's tokens, or equal up to a step whose reference margin is below
    ``tie`` (a near-tie of batched arithmetic: the rest is not comparable); else (False, where they part)."""
    for i, (a, b) in enumerate(zip(got, ref.tokens)):
        if a != b:
            if ref.margins[i] < tie:
                return True, f"parted at token {i} on a near-tie (margin {ref.margins[i]:.2e} < {tie})"
            return False, f"token {i}: {a} != llama.cpp's {b} (margin {ref.margins[i]:.3f})"
    if len(got) != len(ref.tokens):
        return False, f"{len(got)} tokens, llama.cpp's greedy gave {len(ref.tokens)}"
    return True, "identical"
