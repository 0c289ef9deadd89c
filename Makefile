# Detour: `make run` starts the service on the embedded memory store; `make test` runs every test.
# Both set up what they need first: `make run` only what the service needs at run time
# (requirements.lock), `make test` everything (requirements-dev.lock) and redis-server.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Every Python these targets start (the service, pytest and its workers, the service
# processes and client programs the tests start, Spark's Python workers) keeps its compiled
# modules in one cache inside the virtualenv: each module is compiled once, by the first
# process that imports it, and the tree stays free of __pycache__. A shell that sets
# PYTHONDONTWRITEBYTECODE would otherwise make every process compile the project's modules
# from source, and pytest rewrite every test module's asserts, every time (tests/README.md
# has the cost).
unexport PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX := $(CURDIR)/$(VENV)/pycache
# The stamps change whenever their pins or the project metadata do, so `make` reinstalls then.
RUN_STAMP := $(VENV)/.run-$(shell cat requirements.lock 2>/dev/null | sha1sum | cut -c1-12)
DEV_STAMP := $(VENV)/.dev-$(shell cat requirements.lock requirements-dev.lock pyproject.toml \
	2>/dev/null | sha1sum | cut -c1-12)
# Wheels of the producer SDK's dependencies, and of its build backend: its offline build and
# install test (a fresh virtualenv, --no-index) takes them from here.
SDK_WHEELS := $(VENV)/wheels/detour-client
BUILD_WHEELS := $(VENV)/wheels/build
SITE := $(VENV)/lib/python3.11/site-packages
PYTEST_ARGS ?=
# Test workers (pytest-xdist, one file at a time each, each with its own redis-server); 0 runs
# the suite in this process. Four on two cores: much of the suite waits on other processes
# (JVMs, redis-servers, client programs), and with service processes forked rather than
# exec'd (tests/forkserver.py) a fourth worker fills those waits; tests/README.md has the times.
PYTEST_WORKERS ?= 4
ARGS ?=

.PHONY: help setup setup-run run test pytest lint fmt typecheck system-deps bench bench-overload \
	openapi sdk vectors clean

help:
	@echo "make run     start Detour on 127.0.0.1:8080 with the memory store (ARGS='--redis-url ...')"
	@echo "make test    lint, type-check, check the layers and run every test (installs redis-server when missing)"
	@echo "make sdk     build the detour-client wheel (package detour: the SDK and its core) into dist/"
	@echo "make bench   throughput/latency and propagation benchmarks -> docs/BENCHMARKS.md"
	@echo "make bench-overload  5x capacity: do answers stay fast and refusals come at once?"
	@echo "make openapi regenerate openapi.yaml from the app"
	@echo "make vectors regenerate docs/vectors/select.json (the select decision vectors)"

# The virtualenv and its installer, uv (pinned, from PyPI): it resolves, fetches and installs
# in parallel, where pip walks the indexes one package at a time (about 30 s of `make test`'s
# set-up on a fresh clone; tests/README.md has the figures). The virtualenv starts without
# pip; the dev install below adds it.
UV_PIN := uv==0.13.8
UV_INSTALL := $(BIN)/uv pip install -q --python $(BIN)/python

$(BIN)/uv:
	$(PYTHON) -m venv --without-pip $(VENV)
	$(PYTHON) -m pip --python $(BIN)/python install -q --no-compile $(UV_PIN)

# The service's run-time dependencies and nothing else: `python -m service` runs from the
# repository root, so it needs no install of the project itself. Nothing is byte-compiled at
# install (uv's default): PYTHONPYCACHEPREFIX (above) keeps what is imported, compiled once.
$(RUN_STAMP): requirements.lock | $(BIN)/uv
	$(UV_INSTALL) -r requirements.lock
	@rm -f $(VENV)/.run-*
	@touch $@

# Everything `make test` needs on top: the dev, test, lint and Spark packages, and pip; this
# tree on the virtualenv's path (detour, service and pipeline importable from any directory,
# as spark-submit's workers need); the wheels of the SDK's dependencies and build backend.
# Both locks in one run, which stands for the run-time install too.
# pyspark is published as a source distribution only: pip keeps the wheel it builds from it
# in its cache, where uv rebuilt it on every install here (about 25 s), so pip installs it.
BY_PIP := ^(pyspark|py4j)==
$(DEV_STAMP): requirements.lock requirements-dev.lock pyproject.toml | $(BIN)/uv
	$(UV_INSTALL) pip -r requirements.lock \
		-r <(grep -vE '^-r |$(BY_PIP)' requirements-dev.lock)
	$(BIN)/python -m pip install -q --no-compile --no-deps \
		$$(grep -E '$(BY_PIP)' requirements-dev.lock)
	@rm -f $(VENV)/.run-* && touch $(RUN_STAMP)
	echo "$(CURDIR)" > $(SITE)/detour-tree.pth
	rm -rf $(SDK_WHEELS) $(BUILD_WHEELS) && mkdir -p $(SDK_WHEELS) $(BUILD_WHEELS)
	$(BIN)/python -m pip download -q --only-binary=:all: --dest $(SDK_WHEELS) \
		--constraint requirements.lock $$($(BIN)/python -c 'import tomllib; \
		print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
	$(BIN)/python -m pip download -q --only-binary=:all: --no-deps --dest $(BUILD_WHEELS) \
		$$(grep '^setuptools==' requirements-dev.lock)
	@rm -f $(VENV)/.dev-*
	@touch $@

setup-run: $(RUN_STAMP)

setup: $(DEV_STAMP)

# Debian packages the tests run for real, installed only when missing (needs root, as in CI):
# redis-server (the store and the stand-in brokers), prometheus (promtool and a real server),
# prometheus-alertmanager (amtool and a real Alertmanager for the inhibit rules),
# chromium + chromium-driver (the status page test), a JRE for Spark, wrk (benchmarks),
# kubectl (its built-in kustomize renders deploy/ for the manifest tests), gcc (the fleet
# bench's subscription reader, bench/receiver.c). Waits for the
# package lock when another install (an unattended upgrade, a second make) holds it.
SYSTEM_DEPS := redis-server:redis-server prometheus:prometheus promtool:prometheus \
	amtool:prometheus-alertmanager chromium:chromium chromedriver:chromium-driver \
	java:openjdk-17-jre-headless wrk:wrk kubectl:kubectl gcc:gcc

system-deps:
	@missing=""; for pair in $(SYSTEM_DEPS); do \
	  bin=$${pair%%:*}; pkg=$${pair##*:}; \
	  command -v $$bin >/dev/null 2>&1 || missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  apt-get -o DPkg::Lock::Timeout=600 update -q && DEBIAN_FRONTEND=noninteractive \
	    apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends $$(echo $$missing | tr ' ' '\n' | sort -u); \
	fi

run: setup-run
	$(BIN)/python -m service $(ARGS)

lint: setup
	$(BIN)/ruff check detour service tests bench pipeline
	$(BIN)/ruff format --check detour service
	$(BIN)/mypy
	$(BIN)/lint-imports

# With workers, one collection first: it compiles what the suite imports and rewrites the
# test modules' asserts into the cache once, which every worker would otherwise do for
# itself, all at the same time (tests/README.md has the figures). A collection that fails
# fails the run after it the same way, with its report.
pytest: setup system-deps
	$(if $(filter 0,$(PYTEST_WORKERS)),,-$(BIN)/python -m pytest --collect-only -q \
		-p no:cacheprovider > /dev/null 2>&1)
	$(BIN)/python -m pytest $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) \
		--dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

# Lint beside the tests rather than before them (mypy alone takes ~30 s on a fresh clone):
# its report follows the tests', and either failing fails `make test`.
test: setup system-deps
	@$(MAKE) --no-print-directory lint > $(VENV)/lint.log 2>&1 & linting=$$!; \
	$(MAKE) --no-print-directory pytest; tested=$$?; \
	wait $$linting; linted=$$?; cat $(VENV)/lint.log; \
	if [ $$linted -ne 0 ]; then echo "make test: lint failed"; fi; \
	[ $$linted -eq 0 ] && [ $$tested -eq 0 ]

fmt: setup
	$(BIN)/ruff check --fix detour service tests bench pipeline
	$(BIN)/ruff format detour service

bench: setup system-deps
	$(BIN)/python -m bench.run $(ARGS)

# 5x the service's capacity, open loop (Node generator): answered p99 and refusal times.
bench-overload: setup system-deps
	$(BIN)/python -m bench.overload $(ARGS)

openapi: setup
	$(BIN)/python -m service.openapi > openapi.yaml

# The decision vectors from the pure core (tests/test_vectors.py checks they are current).
vectors: setup-run
	PYTHONPATH=$(CURDIR) $(BIN)/python docs/vectors/generate.py

# The detour-client wheel from pyproject.toml, with standard tooling (the build backend from
# the wheels `make setup` keeps, so nothing is fetched here).
sdk: setup
	$(BIN)/python -m pip wheel -q --no-deps --no-index --find-links $(BUILD_WHEELS) \
		--wheel-dir dist .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .import_linter_cache bench/out \
		dist build *.egg-info
