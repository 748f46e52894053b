# Convenience targets. PY defaults to the checkout's virtual environment.
PY ?= .venv/bin/python

.PHONY: figures lessons check-lessons book

# Regenerate every PNG in figures/: the lessons' experiments (python -m minipaged.lessons.figures, about
# a minute on 2 CPU cores), the attention-bandwidth and throughput charts from the stored H200
# benchmark JSON, and the sharing / preemption benchmarks of lesson 06 (a few minutes; they
# rewrite their JSON in benchmarks/results/ too).
figures:
	$(PY) -m minipaged.lessons.figures --out figures
	$(PY) benchmarks/plot.py attention
	$(PY) benchmarks/plot.py throughput
	$(PY) benchmarks/plot.py decode_breakdown
	$(PY) benchmarks/sharing.py
	$(PY) benchmarks/preemption.py --micro --repeats 5

# Execute every lesson in place and store its outputs (one torch thread, seed 0; a few minutes on
# 2 CPU cores): tools/execute_lessons.py. tests/test_lessons_outputs.py fails on a stale cell.
lessons:
	$(PY) tools/execute_lessons.py

# Run every lesson notebook headless from scratch, as CI does (nothing is written back).
check-lessons:
	$(PY) -m pytest -q --nbmake notebooks

# The course book in site/ (mkdocs.yml): the lessons with their stored outputs, the guides, the
# architecture and the benchmarks. MINIPAGED_BOOK_EXECUTE=true executes the lessons again instead.
book:
	OMP_NUM_THREADS=1 $(PY) -m mkdocs build --clean --strict
