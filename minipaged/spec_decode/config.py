"""`speculative_config`: vLLM's dict, checked with errors that teach (lesson 10).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
     "prompt_lookup_min": 1}
    {"method": "draft_model", "model": "PATH_OR_PRESET", "num_speculative_tokens": 4}

`EngineConfig.speculative_config` holds the dict (so `LLM(speculative_config={...})` and
`--speculative-config JSON` are the same thing); `SpeculativeConfig.from_dict` turns it into the
typed object the engine reads, refusing an unknown method or key, a k out of range, and the
combinations that do not work yet. The draft model's vocabulary is compared with the target's
in `check_draft_model`, once both configs are known (`EngineConfig.resolve`; the draft's is read
by `draft_model_config` without building it). `EngineConfig` imports this module, so it imports
no engine part; the per-request refusals are in request_checks.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from minipaged.validation import check_int, check_str

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # a verify step scores k + 1 positions; more is only waste here
_KEYS = {"ngram": {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"},
         "draft_model": {"method", "num_speculative_tokens", "model"}}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: Optional[str] = None  # the draft model (method "draft_model")

    @classmethod
    def from_dict(cls, value) -> "SpeculativeConfig":
        """The checked config of a `speculative_config` dict (see the module docstring)."""
        name = "speculative_config"
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be None or a dict such as {{\"method\": \"ngram\", "
                             f"\"num_speculative_tokens\": 4}}, got {value!r}")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"{name}['method'] must be one of {', '.join(METHODS)} (ngram: "
                             f"prompt lookup, no model; draft_model: a smaller model with the "
                             f"same vocabulary), got {method!r}")
        unknown = sorted(set(value) - _KEYS[method])
        if unknown:
            raise ValueError(f"{name}: unknown key(s) {unknown} for method {method!r}; its keys "
                             f"are {sorted(_KEYS[method])}")
        if "num_speculative_tokens" not in value:
            raise ValueError(f"{name}['num_speculative_tokens'] is required: how many tokens "
                             f"the proposer guesses per step (1..{MAX_SPECULATIVE_TOKENS})")
        k = check_int(f"{name}['num_speculative_tokens']", value["num_speculative_tokens"], 1,
                      MAX_SPECULATIVE_TOKENS)
        if method == "ngram":
            hi = check_int(f"{name}['prompt_lookup_max']", value.get("prompt_lookup_max", 4),
                           1, 64)
            lo = check_int(f"{name}['prompt_lookup_min']", value.get("prompt_lookup_min", 1),
                           1, hi, note=" (at most prompt_lookup_max)")
            return cls(method, k, prompt_lookup_max=hi, prompt_lookup_min=lo)
        if "model" not in value:
            raise ValueError(f"{name}['model'] is required for method 'draft_model': the draft "
                             f"model (a folder, hub id, 'stories260K' or dummy:<preset>)")
        return cls(method, k, model=check_str(f"{name}['model']", value["model"]))

    def check_engine(self, config) -> None:
        """The engine knobs speculation does not combine with yet (an `EngineConfig`)."""
        if config.tensor_parallel_size > 1:
            raise ValueError(f"speculative_config does not combine with tensor_parallel_size="
                             f"{config.tensor_parallel_size} yet; use tensor_parallel_size=1")
        if self.method == "draft_model" and config.preemption_mode == "swap":
            raise ValueError("speculative_config with method 'draft_model' does not combine with "
                             "preemption_mode='swap' yet (the draft's KV cache is not swapped); "
                             "use preemption_mode='recompute'")
        if config.async_scheduling:
            raise ValueError("speculative_config does not combine with async_scheduling=True: a "
                             "verify step needs its tokens before the next step is planned. Leave "
                             "async_scheduling unset (auto turns it off) or set it False")


def draft_model_config(model: str):
    """The draft's `ModelConfig`, found the way the target's is (a folder, hub id, preset): its
    config.json read through models/source.py, no model built."""
    from minipaged.models.config import ModelConfig
    from minipaged.models.source import resolve_model
    return ModelConfig.from_dict(resolve_model(model).config)


def check_draft_model(draft_config, target_config, max_model_len: int) -> None:
    """The draft must speak the target's vocabulary and reach max_model_len (ModelConfigs)."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative_config['model']: the draft model's vocab_size is "
                         f"{draft_config.vocab_size}, the target's {target_config.vocab_size}; "
                         f"its proposals must be token ids of the same vocabulary. Use a draft "
                         f"with the same tokenizer, or method 'ngram'")
    if draft_config.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config['model']: the draft model's "
                         f"max_position_embeddings={draft_config.max_position_embeddings} is "
                         f"below max_model_len={max_model_len}; lower max_model_len to "
                         f"{draft_config.max_position_embeddings} or use another draft")
