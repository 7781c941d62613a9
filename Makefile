# The two set-up commands of the README: `make serve` and `make test`.
# Both bootstrap their own virtual environment in .venv from a clean clone.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test stress venv lint typecheck clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The vision extra (mlx-vlm) and the embeddings extra (mlx-embeddings, which rides on it)
	# are part of the suite: if they do not install, this fails, unless MLXD_SKIP_VISION=1
	# (then mlxd installs without them and the vision and embedding tests skip). The fleet
	# extra (LiteLLM, for `mlxd route` and tests/fleet) is part of the suite too.
	if [ "$$MLXD_SKIP_VISION" = 1 ]; then \
	  $(BIN)/pip install --quiet -e '.[test,vlm,embeddings,fleet]' || $(BIN)/pip install --quiet -e '.[test,fleet]'; \
	else \
	  $(BIN)/pip install --quiet -e '.[test,vlm,embeddings,fleet]'; \
	fi
	# byte-compile mlxd as installing a wheel would (an editable install does not, and with
	# PYTHONDONTWRITEBYTECODE set every start recompiled it: ~0.3 s of the daemon's cold start)
	$(BIN)/python -m compileall -q mlxd
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(BIN)/mlxd serve

test: lint
	$(BIN)/python -m pytest -q

stress: $(STAMP)
	$(BIN)/python -m pytest -q --stress

# ruff (style, bugs, Trio rules), mypy (strict on residency, journal and config),
# lint-imports (the layer contracts in pyproject.toml). `make test` runs it first.
lint: $(STAMP)
	$(BIN)/ruff check mlxd tests bench
	$(BIN)/mypy mlxd
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis dist build
