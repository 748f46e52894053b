"""Models: one Llama-family implementation (`llama.py`) and the loader (`loader.py`)."""
from minipaged.models.config import ModelConfig
from minipaged.models.llama import LlamaForCausalLM

__all__ = ["ModelConfig", "LlamaForCausalLM"]
