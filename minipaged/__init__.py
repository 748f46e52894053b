"""minipaged: a small, readable vLLM-style serving engine.

Read it top-down: llm.py -> engine.py -> scheduler.py -> block_manager.py -> model_runner.py ->
models/llama.py -> attention/ -> sampling.py. The lessons in notebooks/ walk through each file.
"""
from minipaged.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from minipaged.config import EngineConfig
from minipaged.engine.llm_engine import LLMEngine, RequestError
from minipaged.llm import LLM
from minipaged.engine.output import CompletionOutput, RequestOutput
from minipaged.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput", "RequestError", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence"]
