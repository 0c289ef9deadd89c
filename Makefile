# Detour: `make run` starts the service on the embedded memory store; `make test` runs every test.
# Both set up what they need first (virtualenv, pinned packages, redis-server).

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The stamp changes whenever the pins or the project metadata do, so `make` reinstalls then.
STAMP := $(VENV)/.installed-$(shell cat requirements.lock pyproject.toml 2>/dev/null | sha1sum | cut -c1-12)
PYTEST_ARGS ?=
ARGS ?=

.PHONY: help setup run test pytest lint fmt typecheck system-deps bench bench-overload openapi clean

help:
	@echo "make run     start Detour on 127.0.0.1:8080 with the memory store (ARGS='--redis-url ...')"
	@echo "make test    lint, type-check and run every test (installs redis-server when missing)"
	@echo "make bench   throughput/latency and propagation benchmarks -> docs/BENCHMARKS.md"
	@echo "make bench-overload  5x capacity: do answers stay fast and refusals come at once?"
	@echo "make openapi regenerate openapi.yaml from the app"

$(STAMP): requirements.lock pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e .
	@rm -f $(VENV)/.installed-*
	@touch $@

setup: $(STAMP)

# Debian packages the tests run for real, installed only when missing (needs root, as in CI):
# redis-server (the store and the stand-in brokers), prometheus (promtool and a real server),
# prometheus-alertmanager (amtool and a real Alertmanager for the inhibit rules),
# chromium + chromium-driver (the status page test), a JRE for Spark, wrk (benchmarks),
# kubectl (its built-in kustomize renders deploy/ for the manifest tests).
SYSTEM_DEPS := redis-server:redis-server prometheus:prometheus promtool:prometheus \
	amtool:prometheus-alertmanager chromium:chromium chromedriver:chromium-driver \
	java:openjdk-17-jre-headless wrk:wrk kubectl:kubectl

system-deps:
	@missing=""; for pair in $(SYSTEM_DEPS); do \
	  bin=$${pair%%:*}; pkg=$${pair##*:}; \
	  command -v $$bin >/dev/null 2>&1 || missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -q --no-install-recommends $$(echo $$missing | tr ' ' '\n' | sort -u); \
	fi

run: setup
	$(BIN)/python -m service $(ARGS)

lint: setup
	$(BIN)/ruff check service tests bench pipeline
	$(BIN)/ruff format --check service
	$(BIN)/mypy

pytest: setup system-deps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test: lint pytest

fmt: setup
	$(BIN)/ruff check --fix service tests bench pipeline
	$(BIN)/ruff format service

bench: setup system-deps
	$(BIN)/python -m bench.run $(ARGS)

# 5x the service's capacity, open loop (Node generator): answered p99 and refusal times.
bench-overload: setup system-deps
	$(BIN)/python -m bench.overload $(ARGS)

openapi: setup
	$(BIN)/python -m service.openapi > openapi.yaml

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis bench/out
