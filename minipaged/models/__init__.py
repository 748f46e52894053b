"""Models: one Llama-family implementation (`llama.py`), where a model's files are (`source.py`)
and the loader that builds it (`loader.py`); quantized variants of its linear layers in
`quantization/` (fp8)."""
from minipaged.models.config import ModelConfig
from minipaged.models.llama import LlamaForCausalLM

__all__ = ["ModelConfig", "LlamaForCausalLM"]
