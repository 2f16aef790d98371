"""The benchmark harness behind ``scripts/bench*.py``, in modules with one job each.

- :mod:`benchmarks.machine`: what the machine is (CPU, flags, cores, memory, GPU, versions) and its budgets.
- :mod:`benchmarks.models`: a random target/assistant pair built on the spot; model sizes for planning.
- :mod:`benchmarks.passes`: setups, rows, and the passes that fit in memory.
- :mod:`benchmarks.workers`: the processes transformers rows run in.
- :mod:`benchmarks.runner`: the interleaved run of a plan's passes.
- :mod:`benchmarks.summary`, :mod:`benchmarks.tables`, :mod:`benchmarks.plots`: what reports compute and show.
- :mod:`benchmarks.results`: result files, each recording the git revision, a dirty flag and the machine.
- one module per benchmark (:mod:`benchmarks.bench`, :mod:`benchmarks.concurrency`, ...), whose ``main`` the
  script of the same name in ``scripts/`` calls.
"""
