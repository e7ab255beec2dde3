# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# VENV=/path/to/env reuses an environment (and the torch already in it).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ddpkit-installed
# A CPU build of torch installs in under a minute; an unpinned `torch` would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test install clean soak bench lint gpu-check

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIN)
	# Keep whatever torch is there: pin it so resolving ddpkit's deps never replaces it.
	$(PY) -m pip install -q -e ".[dev]" "torch==$$($(PY) -c 'import torch; print(torch.__version__)')"
	touch $(STAMP)

demo: $(STAMP)
	rm -rf runs/digits
	$(VENV)/bin/ddpkit launch --nproc-per-node 2 examples/digits.py --logdir runs/digits

# ruff (pyflakes, pycodestyle, imports, pyupgrade, bugbear) and mypy, configured in pyproject.toml
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests gpu benchmarks soak examples
	$(VENV)/bin/mypy src/ddpkit

# Files in parallel on 3 workers (a file's module-scoped launch runs once); --durations: the 20 slowest, at the end
# (docs/architecture.md#the-test-suite)
test: lint
	$(PY) -m pytest -q -n 3 --dist loadfile --durations=20

# What only a GPU can prove (docs/gpu.md), <= 8 min on one GPU; every check is "skipped" (exit 0) without one.
# A python3 that already has a CUDA torch is used as it is (nothing is installed over it), with src/ on the path.
gpu-check:
	@if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		PYTHONPATH=$(CURDIR)/src python3 gpu/check.py --json-out docs/gpu-check.json; \
	else $(MAKE) -s install && $(PY) gpu/check.py; fi

# Repeated faults (kills, clean exits, exceptions, hangs) on real 2-process jobs; ~12 min, not part of CI.
soak: $(STAMP)
	$(PY) soak/run.py

# Side-by-side performance figures (not part of CI); peers and matplotlib go to benchmarks/.peers only.
PEER_PKGS = accelerate==1.15.0 lightning-fabric==2.6.6 psutil pyyaml huggingface_hub==1.33.0 safetensors \
	lightning-utilities fsspec filelock hf-xet httpx anyio certifi httpcore h11 idna sniffio typer-slim click \
	shellingham matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing python-dateutil six
bench: $(STAMP)
	test -d benchmarks/.peers || $(PY) -m pip install -q --no-deps --target benchmarks/.peers $(PEER_PKGS)
	$(PY) benchmarks/bench.py

clean:
	rm -rf $(VENV) runs build *.egg-info src/*.egg-info
