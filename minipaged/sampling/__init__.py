"""Sampling (lesson 04): `SamplingParams`, the batched `Sampler`, and its fused Triton kernels."""
from minipaged.sampling.params import Logprob, SamplerOutput, SamplingParams
from minipaged.sampling.penalties import apply_penalties
from minipaged.sampling.sampler import Sampler, apply_top_k_top_p_min_p

__all__ = ["SamplingParams", "Sampler", "SamplerOutput", "Logprob", "apply_penalties",
           "apply_top_k_top_p_min_p"]
