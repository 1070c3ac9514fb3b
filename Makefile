# The two commands a newcomer needs: `make demo` (the main job) and `make test` (the suite).
# Each builds .venv on first use; torch is pinned so pip takes the local CPU wheel. The hf extra
# (transformers, peft) is installed too: the suite runs Hugging Face models and LoRA adapters.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.geotrain-installed

.PHONY: demo test lint format bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,hf]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/geotrain run --workers 4 --bandwidth 100mbit --model mini --algo diloco --H 10 \
		--steps 60 --batch-size 8 --eval-every 20

# Two halves at once: the tests that launch clusters one after another, the rest beside them
# (tests/suite.py says why). `$(PY) -m pytest` runs the same tests one after another.
test: $(STAMP)
	$(PY) tests/suite.py

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

format: $(STAMP)
	$(VENV)/bin/ruff format src tests benchmarks examples
	$(VENV)/bin/ruff check --fix src tests benchmarks examples

bench: $(STAMP)
	$(VENV)/bin/geotrain bench

clean:
	rm -rf $(VENV) runs .pytest_cache
