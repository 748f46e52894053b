# Convenience targets. PY defaults to the checkout's virtual environment.
PY ?= .venv/bin/python

.PHONY: figures lessons

# Regenerate every PNG in figures/: the lessons' experiments (python -m minipaged.figures, about
# a minute on 2 CPU cores) and the attention-bandwidth chart from the stored H200 benchmark JSON.
figures:
	$(PY) -m minipaged.figures --out figures
	$(PY) benchmarks/plot_attention.py

# Run every lesson notebook headless, as CI does.
lessons:
	$(PY) -m pytest -q --nbmake notebooks
