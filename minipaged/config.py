"""`EngineConfig`: every knob of the engine in one place, checked before anything is allocated.

vLLM's names, vLLM's defaults where they make sense on a laptop, and errors that teach: each one
says what is wrong, the numbers involved, and which knob to turn (lesson 00 triggers them on
purpose).

This dataclass is the one declaration of the engine's knobs: `LLM(**kwargs)` takes its fields,
and `minipaged generate | bench | serve` build their engine flags from it (`cli/args.py`), so a
field added here is a keyword and a flag everywhere. Each field's `help` is its flag's help.

`resolve(model_config)` returns a copy in which every "auto" and every `None` default is decided,
once, for the device the engine runs on: the rest of the engine reads concrete values only.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Optional

from minipaged.utils import cdiv
from minipaged.validation import (SEED_MAX, SEED_MIN, check_bool, check_choice, check_float,
                                  check_int, check_str)

GiB = 1024 ** 3
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
DTYPES = ("auto", "float32", "float", "bfloat16", "float16", "half", "float64")  # models.config._DTYPES
ATTENTION_BACKENDS = ("torch_ref", "cpu", "triton")
USAGE_CONTEXTS = ("offline", "server")

# `max_num_batched_tokens` when unset, by device and use (vLLM's EngineArgs.get_batch_defaults):
# a larger step budget prefills more prompts per forward where the GPU has the room for it.
#                                           offline (LLM, bench)   server (minipaged serve)
DEFAULT_BATCHED_TOKENS = {"cpu":            (2048, 2048),  # the CPU's measured best
                          "large_gpu":      (16384, 8192),  # >= 70 GiB, not an A100 (H100, H200)
                          "gpu":            (8192, 2048)}
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy (minipaged/priority/)
QUANTIZATION_METHODS = ("fp8",)  # models/quantization/


def _knob(default, help: str, **flag):
    """A field with its command-line help (and argparse extras such as `choices`)."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass
class EngineConfig:
    model: str = _knob("stories260K", "stories260K, an HF folder or hub id, or dummy:<preset>")
    tokenizer: Optional[str] = _knob(None, "tokenizer folder or hub id; auto: the model's")
    dtype: str = _knob("auto", "weights and activations; auto: the model's config.json",
                       choices=DTYPES)
    max_model_len: Optional[int] = _knob(
        None, "longest prompt + output in tokens; auto: the model's max_position_embeddings")
    max_num_seqs: int = _knob(256, "most sequences in one batch; more requests wait in the queue")
    max_num_batched_tokens: Optional[int] = _knob(
        None, "token budget of one step (prefill chunks + decodes); auto: by device and "
              "usage_context (CPU 2048; H100/H200-class GPUs 16384 offline, 8192 served; other "
              "GPUs 8192 / 2048), at least max_model_len without chunked prefill")
    usage_context: str = _knob(
        "offline", "what the automatic defaults are chosen for: offline (LLM, bench) or server "
                   "(minipaged serve's default)", choices=USAGE_CONTEXTS)
    block_size: int = _knob(16, "tokens per KV-cache block (a power of two)")
    gpu_memory_utilization: float = _knob(
        0.9, "share of GPU memory for weights + activations + KV cache (CUDA)")
    num_blocks: Optional[int] = _knob(
        None, "KV-cache size in blocks (wins over the memory knobs)")
    kv_cache_memory: Optional[int] = _knob(
        None, "KV-cache size in bytes; auto: on the CPU max_num_seqs full-length sequences, at "
              "most 4 GiB; on a GPU what gpu_memory_utilization leaves")
    enable_prefix_caching: bool = _knob(True, "reuse the KV blocks of identical prompt prefixes")
    enable_chunked_prefill: bool = _knob(
        True, "split long prompts into chunks that share steps with decodes")
    preemption_mode: str = _knob(
        "recompute", "recompute: free a preempted sequence's blocks and prefill it again later; "
                     "swap: copy them to a CPU pool and back", choices=PREEMPTION_MODES)
    scheduling_policy: str = _knob(
        "fcfs", "fcfs: first come, first served; priority: requests carry a priority (lower runs "
                "first, ties by arrival) and a more urgent waiting request preempts less urgent "
                "running ones (minipaged/priority/, lesson 13)", choices=SCHEDULING_POLICIES)
    swap_space: Optional[float] = _knob(
        None, "GiB of CPU pool for preemption_mode=swap; auto: as large as the KV cache")
    num_cpu_blocks: Optional[int] = _knob(
        None, "CPU pool size in blocks (wins over swap_space)")
    seed: int = _knob(0, "seed of the weights' dummy init and of unseeded sampling")
    device: str = _knob("auto", "auto: cuda if torch sees a GPU, else cpu")
    cpu_threads: Optional[int] = _knob(
        None, "torch intra-op threads (process-wide: torch.set_num_threads, applied when the "
              "engine is built; not a vLLM knob). Default on the CPU: keep the caller's choice "
              "(OMP_NUM_THREADS / MKL_NUM_THREADS, or torch.set_num_threads called before), "
              "else 1 thread for models narrower than 1024 (stories260K: 64) and one per "
              "physical core for wider ones; on CUDA torch's threads are left alone "
              "(worker/cpu_threads.py)")
    attention_backend: Optional[str] = _knob(
        None, "auto: triton on CUDA, cpu elsewhere (attention/cpu_backend.py: torch_ref with a "
              "paged decode path); torch_ref: the readable reference", choices=ATTENTION_BACKENDS)
    fused_ops: Optional[bool] = _knob(
        None, "fused Triton kernels for norm + residual add, SiLU-and-multiply and q/k norm + "
              "RoPE + K/V store (models/fused_layers.py); auto: on for CUDA with the triton "
              "backend. On the CPU they need TRITON_INTERPRET=1 set before minipaged is "
              "imported (slow, for tests)")
    max_trace_len: Optional[int] = _knob(
        None, "keep only the newest N StepRecords in engine.trace (`serve` keeps 10000: a "
              "server runs for days); auto: every step")
    record_block_tables: bool = _knob(
        False, "snapshot every block table into the trace (lessons' plots)")
    enforce_eager: bool = _knob(False, "never replay decode steps from CUDA graphs")
    async_scheduling: Optional[bool] = _knob(
        None, "plan and launch step t+1 while the GPU still runs step t, reading step t's tokens "
              "one step late (async_sched/step_loop.py); auto: on for CUDA, off on the CPU and "
              "with speculative_config (a verify step needs its tokens at once)")
    kv_cache_dtype: str = _knob(
        "auto", "what the KV cache stores. auto: the model's dtype; fp8 (fp8_e4m3): float8 e4m3, "
                "one byte per element, unscaled and clamped to +-448: twice the tokens per GiB, "
                "half the bytes each decode step reads, at 3 mantissa bits",
        choices=KV_CACHE_DTYPES)
    quantization: Optional[str] = _knob(
        None, "quantize the weights at load. fp8: the decoder layers' linear weights as float8 "
              "e4m3 with one scale per output channel, activations quantized per token at run "
              "time, torch._scaled_mm on CUDA (Hopper's fp8 tensor cores), a dequantizing path "
              "elsewhere (models/quantization/fp8.py); None: the weights stay in dtype",
        choices=QUANTIZATION_METHODS)
    max_logprobs: int = _knob(
        20, "most log-probabilities a request may ask for per token (SamplingParams.logprobs); "
            "-1: no limit (up to the vocabulary)")
    tensor_parallel_size: int = _knob(
        1, "split every layer's weights and the KV heads across N processes (Megatron-style "
           "tensor parallelism on torch.distributed: gloo on the CPU, NCCL on GPUs; "
           "minipaged/distributed/)")
    enable_lora: bool = _knob(
        False, "serve LoRA adapters (PEFT folders) beside the base model: requests pick one "
               "with a LoRARequest (server: the request's `model`) and different adapters share "
               "a batch (minipaged/lora/)")
    max_loras: int = _knob(
        1, "adapters held on the device at once (weight slots, least recently used evicted) "
           "and the most distinct adapters in one step; more wait (enable_lora)")
    max_lora_rank: int = _knob(16, "largest adapter rank r the slots hold (enable_lora)")
    max_cpu_loras: Optional[int] = _knob(
        None, "adapters kept in CPU memory once read from their folders, least recently used "
              "dropped (read again when a request needs it); >= max_loras; auto: max_loras "
              "(enable_lora)")
    speculative_config: Optional[dict] = _knob(
        None, "speculative decoding (vLLM's dict; on the command line as JSON): "
              "{\"method\": \"ngram\", \"num_speculative_tokens\": K, \"prompt_lookup_max\": M, "
              "\"prompt_lookup_min\": 1} or {\"method\": \"draft_model\", \"model\": "
              "PATH_OR_PRESET, \"num_speculative_tokens\": K}. Turns async scheduling off; "
              "refuses n > 1 and beam search (minipaged/spec_decode/, lesson 10)")

    def validate(self) -> None:
        """Every field's type and range (validation.py): a ValueError that starts with the
        field's name, says what is allowed and shows the value."""
        check_str("model", self.model)
        check_str("tokenizer", self.tokenizer, optional=True)
        check_choice("dtype", self.dtype, DTYPES)
        check_int("max_model_len", self.max_model_len, lo=1, optional=True,
                  note=" (None: the model's max_position_embeddings)")
        check_int("max_num_seqs", self.max_num_seqs, lo=1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, lo=1, optional=True)
        check_choice("usage_context", self.usage_context, USAGE_CONTEXTS)
        check_int("block_size", self.block_size, lo=1)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        check_float("gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, lo_open=True)
        check_int("num_blocks", self.num_blocks, lo=1, optional=True)
        check_int("kv_cache_memory", self.kv_cache_memory, lo=1, optional=True, note=" (bytes)")
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES,
                     note=" (recompute: free the blocks, prefill again later; swap: copy the "
                          "blocks to CPU memory and back)")
        check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        if self.scheduling_policy == "priority" and self.preemption_mode == "swap":
            raise ValueError("scheduling_policy='priority' needs preemption_mode='recompute', got "
                             "'swap': a swapped-out request comes back before any waiting one, "
                             "so it would undo the preemptions the priorities ask for")
        check_float("swap_space", self.swap_space, lo=0, optional=True, note=" (GiB)")
        check_int("num_cpu_blocks", self.num_cpu_blocks, lo=0, optional=True)
        check_int("seed", self.seed, SEED_MIN, SEED_MAX)
        check_str("device", self.device)
        check_int("cpu_threads", self.cpu_threads, lo=1, optional=True,
                  note=" (None: decided for the model and device)")
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS,
                     optional=True, note=" (None: the device's default)")
        check_bool("fused_ops", self.fused_ops, optional=True)
        check_int("max_trace_len", self.max_trace_len, lo=0, optional=True)
        check_bool("record_block_tables", self.record_block_tables)
        check_bool("enforce_eager", self.enforce_eager)
        check_bool("async_scheduling", self.async_scheduling, optional=True)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_choice("quantization", self.quantization, QUANTIZATION_METHODS, optional=True,
                     note=" (None: weights in dtype; fp8: float8 e4m3 weights with per-channel "
                          "scales. The KV cache's float8 is kv_cache_dtype='fp8')")
        check_int("max_logprobs", self.max_logprobs, lo=-1, note=" (-1: no limit)")
        check_int("tensor_parallel_size", self.tensor_parallel_size, lo=1)
        check_bool("enable_lora", self.enable_lora)
        check_int("max_loras", self.max_loras, lo=1)
        check_int("max_lora_rank", self.max_lora_rank, lo=1, hi=512)
        check_int("max_cpu_loras", self.max_cpu_loras, lo=self.max_loras, optional=True,
                  note=f" (max_loras={self.max_loras}: the CPU keeps at least the adapters the "
                       "device holds; None: max_loras)")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError(f"enable_lora is not supported with tensor_parallel_size="
                             f"{self.tensor_parallel_size} yet; use tensor_parallel_size=1")
        if self.speculative_config is not None:
            self.speculative.check_engine(self)

    # --- every "auto", decided once --------------------------------------------------------
    def resolve(self, model_config) -> "EngineConfig":
        """A validated copy with every "auto" / `None` decided for this model and device.

        `model_config` (models.config.ModelConfig) gives the default dtype, the longest
        `max_model_len` and the width that decides `cpu_threads`. The fast paths are all chosen
        here: the engine, the worker and the model read the answers (`device`,
        `attention_backend`, `fused_ops`, `async_scheduling`, `cpu_threads` and the properties
        below) and never decide again.
        """
        import torch

        self.validate()
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        cuda = device.startswith("cuda")
        if cuda and not torch.cuda.is_available():
            raise ValueError(f"device={device!r}, but this torch ({torch.__version__}) sees no CUDA "
                             "GPU. Use device='cpu' (or 'auto').")
        dtype = self.dtype
        if dtype == "auto":
            dtype = str(model_config.torch_dtype).removeprefix("torch.")
        from minipaged.attention.selector import default_backend_name
        backend = self.attention_backend or default_backend_name(device)
        fused = self.fused_ops
        if fused is None:
            fused = cuda and backend == "triton"
        from minipaged.worker.cpu_threads import resolve_cpu_threads
        threads = resolve_cpu_threads(self.cpu_threads, device, model_config.hidden_size)
        async_scheduling = self.async_scheduling
        if async_scheduling is None:  # speculation needs each step's tokens before the next
            async_scheduling = cuda and self.speculative_config is None
        out = replace(self, device=device, dtype=dtype, attention_backend=backend, fused_ops=fused,
                      cpu_threads=threads, async_scheduling=async_scheduling,
                      max_cpu_loras=self.max_cpu_loras or self.max_loras)
        out._resolve_lengths(model_config.max_position_embeddings,
                             default_batched_tokens(device, self.usage_context))
        if out.tensor_parallel_size > 1:  # heads, vocabulary and devices must split N ways
            from minipaged.distributed.parallel_state import check_tensor_parallel
            check_tensor_parallel(out, model_config)
        spec = out.speculative
        if spec is not None and spec.method == "draft_model":  # its vocabulary and length
            from minipaged.spec_decode.config import check_draft_model, draft_model_config
            check_draft_model(draft_model_config(spec.model), model_config, out.max_model_len)
        return out

    def _resolve_lengths(self, max_position_embeddings: int, default_budget: int = 2048) -> None:
        if self.max_model_len is None:
            self.max_model_len = max_position_embeddings
        elif self.max_model_len > max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} is larger than the model's "
                f"max_position_embeddings={max_position_embeddings}: positions beyond the trained "
                f"context give garbage. Use max_model_len <= {max_position_embeddings}.")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = (default_budget if self.enable_chunked_prefill
                                           else max(self.max_model_len, default_budget))
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len}; without chunked prefill a prompt that long "
                f"could never be scheduled. Raise max_num_batched_tokens, lower max_model_len, "
                f"or set enable_chunked_prefill=True.")

    # Derived choices of a resolved config: not knobs of their own.
    @property
    def speculative(self):
        """`speculative_config` checked and typed (spec_decode/config.py), or None."""
        if self.speculative_config is None:
            return None
        from minipaged.spec_decode.config import SpeculativeConfig
        return SpeculativeConfig.from_dict(self.speculative_config)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def use_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs: CUDA, the Triton backend, not enforce_eager."""
        return self.is_cuda and self.attention_backend == "triton" and not self.enforce_eager

    @property
    def kv_head_major(self) -> bool:
        """K/V stored head-major (worker/kv_cache.py): CUDA with the Triton backend."""
        return self.is_cuda and self.attention_backend == "triton"

    @property
    def gpu_tuned_inputs(self) -> bool:
        """The worker builds its steps for a GPU (worker/gpu_model_runner.py: ordered, packed,
        padded): on CUDA, and wherever async scheduling gathers input tokens on the device. The
        lessons print the CPU's batches in scheduler order."""
        return self.is_cuda or bool(self.async_scheduling)

    @property
    def sampler_kernel(self) -> bool:
        """Plain temperature rows sample with the Triton kernels (sampling/kernels.py): CUDA."""
        return self.is_cuda


def device_class(device: str) -> str:
    """"cpu", "large_gpu" (at least 70 GiB and not an A100: H100, H200, MI300) or "gpu"."""
    if not device.startswith("cuda"):
        return "cpu"
    import torch
    try:
        props = torch.cuda.get_device_properties(torch.device(device))
    except Exception:  # (no device to ask: vLLM takes the smaller defaults then too)
        return "gpu"
    large = props.total_memory >= 70 * GiB and "a100" not in props.name.lower()
    return "large_gpu" if large else "gpu"


def default_batched_tokens(device: str, usage_context: str) -> int:
    """`max_num_batched_tokens` for an unset knob (DEFAULT_BATCHED_TOKENS)."""
    offline, server = DEFAULT_BATCHED_TOKENS[device_class(device)]
    return server if usage_context == "server" else offline


def engine_fields() -> list:
    """The knobs, in declaration order (what the command line turns into flags)."""
    return list(fields(EngineConfig))


def format_bytes(n: int) -> str:
    """Bytes as people read them: 1000 bytes, 20.0 KiB, 640.0 MiB, 7.00 GiB."""
    for unit, scale in (("GiB", GiB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


def kv_cache_too_small_error(*, max_model_len: int, bytes_per_token: int, available_bytes: int,
                             block_size: int, source: str) -> ValueError:
    """vLLM-style message: needed vs available memory, the largest max_model_len that fits, and
    the values of the knobs that would make it fit."""
    per_block = bytes_per_token * block_size
    blocks_needed = cdiv(max_model_len, block_size)
    needed = blocks_needed * per_block
    blocks = available_bytes // per_block
    fits = blocks * block_size
    fit = (f"The largest max_model_len that fits is {fits}. " if fits else
           "Not even one block fits, so no max_model_len does. ")
    return ValueError(
        f"To serve at least one request with max_model_len={max_model_len}, the KV cache needs "
        f"{blocks_needed} blocks of {block_size} tokens = {format_bytes(needed)} "
        f"({bytes_per_token} bytes per token, {format_bytes(per_block)} per block), but only "
        f"{format_bytes(available_bytes)} is available for it ({source}): {blocks} blocks. {fit}"
        f"Fix: {f'lower max_model_len to {fits} or less, or ' if fits else ''}give the cache "
        f"more memory: num_blocks >= {blocks_needed}, kv_cache_memory >= {needed} (bytes; "
        f"{needed / GiB:.3g} GiB), or a higher gpu_memory_utilization (on a GPU).")


def knob_docs(indent: str = "    ") -> str:
    """Every knob as a user reads it in `help()`: name, default, meaning (from the one
    declaration above, so the docs cannot drift from the fields)."""
    lines = []
    for f in engine_fields():
        choices = f.metadata.get("choices")
        extra = f"; one of {', '.join(map(str, choices))}" if choices else ""
        lines.append(f"{indent}{f.name} = {f.default!r}: {f.metadata.get('help', '')}{extra}")
    return "\n".join(lines)


EngineConfig.__doc__ = ("Every knob of the engine, checked at construction (`validate`); "
                        "`resolve(model_config)` decides the automatic ones.\n\nKnobs:\n"
                        + knob_docs())
