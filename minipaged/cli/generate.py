"""`minipaged generate MODEL [--prompt TEXT ...]`: one-off generation with the offline `LLM`.

    minipaged generate stories260K --max-tokens 40          the prompt "Once upon a time", greedy
    minipaged generate stories260K --prompt "Tom had" --prompt "Lily saw" --temperature 0.8
    minipaged generate dummy:qwen3-0.6b --device cpu --max-model-len 256 --max-tokens 8
    minipaged generate stories260K --enable-lora --lora-modules sql=/adapters/sql --lora sql

Each prompt is printed with its continuation, then its token count and finish reason. The
sampling flags are `SamplingParams` fields; every engine flag is an `EngineConfig` field.
`--lora NAME` runs every prompt with that `--lora-modules` adapter (lora_args.py, as `serve`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from minipaged.cli.args import (FlexibleArgumentParser, add_common_args, add_engine_args,
                                engine_config_from_args, int_at_least)
from minipaged.cli.errors import run_command
from minipaged.cli.lora_args import add_lora_pick_arg, picked_lora

DEFAULT_PROMPT = "Once upon a time"


def make_parser() -> FlexibleArgumentParser:
    ap = FlexibleArgumentParser(prog="minipaged generate", description=__doc__)
    s = ap.add_argument_group("sampling (SamplingParams)")
    s.add_argument("--prompt", action="append", default=None,
                   help=f"a prompt; repeat it for several (default: {DEFAULT_PROMPT!r})")
    s.add_argument("--max-tokens", type=int_at_least(1), default=64,
                   help="most new tokens per prompt")
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    s.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of tokens whose probability reaches top_p")
    s.add_argument("--top-k", type=int, default=0,
                   help="sample from the k most likely tokens; 0: all")
    add_lora_pick_arg(ap.add_argument_group("LoRA adapters"))
    add_engine_args(ap)
    add_common_args(ap)
    return ap


def generate(argv: list[str]) -> int:
    a = make_parser().parse_args(argv)
    config = engine_config_from_args(a)  # checked (values, device) before anything loads
    lora = picked_lora(a, config)  # and the adapter folders
    from minipaged import LLM, SamplingParams
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            max_tokens=a.max_tokens)  # unseeded rows draw from --seed's stream
    llm = LLM(**dataclasses.asdict(config))
    for out in llm.generate(a.prompt or [DEFAULT_PROMPT], params, use_tqdm=False,
                            lora_request=lora):
        completion = out.outputs[0]
        print(f"{out.prompt}{completion.text}")
        adapter = f", lora={out.lora_request.lora_name}" if out.lora_request else ""
        print(f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}"
              f"{adapter}]")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    return run_command(generate, argv)


if __name__ == "__main__":
    raise SystemExit(main())
