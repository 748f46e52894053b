# Convenience targets. PY defaults to the checkout's virtual environment.
PY ?= .venv/bin/python

.PHONY: figures lessons book

# Regenerate every PNG in figures/: the lessons' experiments (python -m minipaged.lessons.figures, about
# a minute on 2 CPU cores), the attention-bandwidth and throughput charts from the stored H200
# benchmark JSON, and the sharing / preemption benchmarks of lesson 06 (a few minutes; they
# rewrite their JSON in benchmarks/results/ too).
figures:
	$(PY) -m minipaged.lessons.figures --out figures
	$(PY) benchmarks/plot_attention.py
	$(PY) benchmarks/plot_throughput_gpu.py
	$(PY) benchmarks/plot_decode_breakdown.py
	$(PY) benchmarks/sharing.py
	$(PY) benchmarks/preemption.py --micro --repeats 5

# Run every lesson notebook headless, as CI does.
lessons:
	$(PY) -m pytest -q --nbmake notebooks

# The course book: every lesson executed and rendered into a static site in site/ (mkdocs.yml).
book:
	OMP_NUM_THREADS=1 $(PY) -m mkdocs build --clean
