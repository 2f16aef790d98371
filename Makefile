# The two commands for a fresh machine (see README): `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Write a Python function is_prime(n) that returns True when n is a prime number.

.PHONY: setup setup-gguf models run test test-fast test-ci lint bench test-slow test-ray help

setup: $(VENV)/.installed $(VENV)/.gguf-installed

# torch is pinned explicitly: an unpinned torch would pull a multi-GB CUDA build. xgrammar (structured output) is
# installed without its dependencies: its wheel requires triton on Linux x86-64, a large GPU compiler it never uses
# on CPU; the rest of what it needs (pydantic, numpy, torch, transformers) is already there.
XGRAMMAR := xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m pip install -q --no-deps $(XGRAMMAR)
	touch $@

# llama-cpp-python for the gguf drafter type (docs/drafter-types.md): a source build of llama.cpp, 9-25 minutes on
# two cores the first time, with CPU flags chosen for this machine (no -march=native, no AMX: see the script); the
# wheel is cached in ~/.cache/pipespec/wheels/ per CPU kind, so a later set-up installs it in seconds. The probe
# then runs one forward in a child process, so a build this CPU cannot run fails here and not in a drafter node.
setup-gguf: $(VENV)/.gguf-installed

# A failed build or probe does not stop the set-up: the default config's drafter.type auto then drafts with the torch
# assistant and says why at start-up (drafter_node/type_choice.py). `rm .venv/.gguf-installed && make setup-gguf`
# tries again.
$(VENV)/.gguf-installed: $(VENV)/.installed scripts/build_llama_cpp.py
	$(PY) scripts/build_llama_cpp.py --probe || echo "[pipespec] llama.cpp was not built or cannot run here (see above): drafter.type auto drafts with the torch assistant"
	touch $@

# The default config's models, installed once into ~/.cache/pipespec: the target converted for torch, the drafter's
# GGUF file as it is (the gguf drafter reads it; the torch assistant, the fallback, converts it when it starts).
models: $(VENV)/.installed
	$(PY) -m weights qwen2.5-coder-1.5b-instruct
	$(PY) -m weights --gguf qwen2.5-coder-0.5b-instruct

# The llama.cpp build (CPU) and the model downloads (network) run side by side.
run: $(VENV)/.installed
	$(MAKE) --no-print-directory -j2 $(VENV)/.gguf-installed models
	$(VENV)/bin/pipespec generate --config cpu.yaml --max-new-tokens 64 --chat --prompt "$(PROMPT)"

# The tiers (docs/development.md, "Tests"): unit, process, compile, cluster, statistical, netns in `make test`
# (pyproject.toml's addopts: every tier but ci, slow and ray); the aim is under 10 minutes on 2 cores.
# pytest-xdist runs them on TEST_WORKERS processes (auto: one per core); work stealing evens out the long tests.
TEST_WORKERS ?= auto
XDIST = -n $(TEST_WORKERS) --dist worksteal
test: setup
	$(PY) -m pytest -q $(XDIST)

# The unit tier: one process, no nodes, no child interpreters, no torch.compile.
test-fast: setup
	$(PY) -m pytest -q $(XDIST) -m unit

# What CI runs (.ci/run): `make test` and the ci tier (the docs' run blocks, the installed wheel, the sampling check
# of every drafter type and target path beside make test's one per kind of draft) in one session.
test-ci: setup
	$(PY) -m pytest -q $(XDIST) -m 'not slow and not ray'

test-slow: setup
	$(PY) -m pytest -q -m slow

# The Ray tier: a multi-node Ray cluster on this machine (docs/ray.md); installs the ray extra first.
test-ray: setup
	$(PY) -m pip install -q -e '.[ray]'
	$(PY) -m pytest -q -m ray

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) scripts/bench.py

help:
	@echo "make run        one generation on the default config (sets up, builds llama.cpp, installs the models)"
	@echo "make test       the suite on tiny models: tiers unit, process, compile, cluster, statistical, netns"
	@echo "make test-fast  the unit tier: one process, no nodes, no child interpreters, no torch.compile"
	@echo "make test-ci    what CI runs: make test and the ci tier (docs run blocks, installed wheel, sampling)"
	@echo "make test-slow  the real Qwen pair (slow tier)"
	@echo "make test-ray   a multi-node Ray cluster on this machine (ray tier; installs pipespec[ray])"
	@echo "make lint       ruff"
	@echo "make bench      the benchmark (scripts/bench.py)"
	@echo "tiers: docs/development.md, Tests"
