"""Models: one Llama-family implementation (`llama.py`) and the loader (`loader.py`); quantized
variants of its linear layers in `quantization/` (fp8)."""
from minipaged.models.config import ModelConfig
from minipaged.models.llama import LlamaForCausalLM

__all__ = ["ModelConfig", "LlamaForCausalLM"]
