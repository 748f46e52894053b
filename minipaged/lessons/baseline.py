"""The naive Hugging Face baselines of lessons 00, 03 and 08: they live in
`minipaged/benchmark/hf_baselines.py` (`minipaged bench` and `demo` run them); the notebooks
import them from here."""
from minipaged.benchmark.hf_baselines import (BaselineResult, hf_continuous, hf_sequential,
                                              hf_static, load_hf_model, quiet_transformers)

__all__ = ["BaselineResult", "hf_continuous", "hf_sequential", "hf_static", "load_hf_model",
           "quiet_transformers"]
