"""Helpers that both the tests and the benchmarks use, importable as one package: tiny random models and a
tokenizer (:mod:`testkit.tiny_models`, :mod:`testkit.tiny_mtp`) and two network namespaces as two hosts
(:mod:`testkit.netns`). Nothing in the runtime imports it."""
