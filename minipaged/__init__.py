"""minipaged: a small, readable vLLM-style serving engine.

Read it top-down, one request's path: llm.py -> engine/llm_engine.py -> engine/scheduler.py ->
engine/block_manager.py -> worker/model_runner.py -> models/llama.py (+ layers.py) -> attention/
-> sampling/ -> engine/output.py. The lessons in notebooks/ walk through each file; every GPU fast
path is chosen once, in config.py's `EngineConfig.resolve`, and lives outside this path.
"""
from minipaged.groups.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from minipaged.config import EngineConfig
from minipaged.engine.llm_engine import LLMEngine, RequestError
from minipaged.llm import LLM
from minipaged.engine.output import CompletionOutput, RequestOutput
from minipaged.lora import LoRARequest
from minipaged.sampling import SamplingParams
from minipaged.sampling.structured_outputs import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput", "RequestError", "BeamSearchParams", "BeamSearchOutput",
           "BeamSearchSequence", "LoRARequest", "StructuredOutputsParams"]
