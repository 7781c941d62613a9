# The two set-up commands of the README: `make serve` and `make test`.
# Both bootstrap their own virtual environment in .venv from a clean clone.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SERVE_STAMP := $(VENV)/.serve-installed

.PHONY: serve test stress venv lint typecheck clean blas

# What serving needs, and nothing of the test toolchain, with pip's progress shown: mlxd and
# its runtime extras. The image and embedding extras (mlx-vlm, mlx-embeddings) are tried on
# their own: if they cannot install here, text models still serve and one line says so.
$(SERVE_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e .
	$(BIN)/pip install -e '.[vlm,embeddings]' || \
	  echo "mlxd: mlx-vlm/mlx-embeddings did not install: text models serve; image (mllm: true) and embedding models will not load"
	# byte-compile mlxd as installing a wheel would (an editable install does not, and with
	# PYTHONDONTWRITEBYTECODE set every start recompiled it: ~0.3 s of the daemon's cold start)
	$(BIN)/python -m compileall -q mlxd
	touch $(SERVE_STAMP)

# The tests need the test toolchain too. The vision extra (mlx-vlm) and the embeddings extra
# (mlx-embeddings, which rides on it) are part of the suite: if they do not install, this
# fails, unless MLXD_SKIP_VISION=1 (then the vision and embedding tests skip, saying why). The
# fleet extra (LiteLLM, for `mlxd route` and tests/fleet) is part of the suite too.
$(STAMP): $(SERVE_STAMP)
	if [ "$$MLXD_SKIP_VISION" = 1 ]; then \
	  $(BIN)/pip install --quiet -e '.[test,vlm,embeddings,fleet]' || $(BIN)/pip install --quiet -e '.[test,fleet]'; \
	else \
	  $(BIN)/pip install --quiet -e '.[test,vlm,embeddings,fleet]'; \
	fi
	touch $(STAMP)

venv: $(STAMP)

# the JavaScript clients the suite drives (the `ollama` npm package), in tests/js/node_modules;
# without npm this does nothing and their test skips, saying so
JS_CLIENTS := tests/js/node_modules/.installed
$(JS_CLIENTS): tests/js/package.json
	if command -v npm >/dev/null 2>&1; then \
	  npm install --prefix tests/js --no-audit --no-fund --silent && touch $@; \
	fi

# MLX's Linux CPU wheel links the reference BLAS; Debian's OpenBLAS makes its prompts prefill
# about 10x faster (mlxd.blas: `mlxd serve` re-executes itself with it preloaded). Installed when
# missing and this user may (root, or password-less sudo); otherwise one line says what it costs.
blas:
	@if [ "$$(uname)" = Linux ] && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3 >/dev/null 2>&1; then \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO="sudo -n"; \
	  if command -v apt-get >/dev/null && $$SUDO true 2>/dev/null; then \
	    echo "installing Debian's libopenblas0-pthread (a fast BLAS for MLX's CPU backend)"; \
	    $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null; \
	  else \
	    echo "no libopenblas0-pthread and no way to install it: MLX runs on its reference BLAS (prefill about 10x slower)"; \
	  fi; \
	fi

# The tests run MLX in the test process too: preload the fast BLAS there (when present).
FAST_BLAS = $$(ls /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3 2>/dev/null | head -n 1)

serve: $(SERVE_STAMP) blas
	$(BIN)/mlxd serve

test: lint blas $(JS_CLIENTS)
	LD_PRELOAD="$(FAST_BLAS) $$LD_PRELOAD" $(BIN)/python -m pytest -q

stress: $(STAMP) blas $(JS_CLIENTS)
	LD_PRELOAD="$(FAST_BLAS) $$LD_PRELOAD" $(BIN)/python -m pytest -q --stress

# ruff (style, bugs, Trio rules), mypy (strict on residency, journal and config),
# lint-imports (the layer contracts in pyproject.toml). `make test` runs it first.
lint: $(STAMP)
	$(BIN)/ruff check mlxd tests bench
	$(BIN)/mypy mlxd
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis dist build
