"""`minipaged chat MODEL`: talk to a model in the terminal, through the offline engine.

    minipaged chat stories260K                          each line you type is continued
    minipaged chat stories260K -q "Once upon a time"    one message, one reply, exit (vLLM's -q)
    minipaged chat Qwen/Qwen3-0.6B --system-prompt "Be brief." --max-tokens 256
    minipaged chat stories260K --enable-lora --lora-modules sql=/adapters/sql --lora sql

With a chat template (the tokenizer's, or `--chat-template FILE_OR_JINJA` as in `serve`) the
conversation is kept and rendered through it every turn, `--system-prompt` first. Without one
(stories260K is a base model: it only continues text) every line is a fresh prompt and the reply
is its continuation. Ctrl-D or /exit ends the chat. (vLLM's `vllm chat` is a client of a running
server; this one runs the engine in the terminal's process, like `minipaged generate`.)
`--lora NAME` answers with that `--lora-modules` adapter (lora_args.py, as `serve`).
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Optional

from minipaged.cli.args import (FlexibleArgumentParser, add_common_args, add_engine_args,
                                engine_config_from_args, int_at_least)
from minipaged.cli.errors import run_command
from minipaged.cli.lora_args import add_lora_pick_arg, picked_lora


def make_parser() -> FlexibleArgumentParser:
    ap = FlexibleArgumentParser(prog="minipaged chat", description=__doc__)
    c = ap.add_argument_group("chat")
    c.add_argument("-q", "--quick", metavar="MESSAGE", default=None,
                   help="send MESSAGE, print the reply and exit")
    c.add_argument("--system-prompt", default=None,
                   help="the conversation's first (system) message; needs a chat template")
    c.add_argument("--chat-template", default=None,
                   help="a Jinja chat template: a file path, or the template itself; "
                        "default: the tokenizer's")
    c.add_argument("--max-tokens", type=int_at_least(1), default=128,
                   help="most new tokens per reply")
    c.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    add_lora_pick_arg(ap.add_argument_group("LoRA adapters"))
    add_engine_args(ap)
    add_common_args(ap)
    return ap


class Conversation:
    """The turns so far, and how one more message becomes a prompt (token ids)."""

    def __init__(self, tokenizer, template: Optional[str], system_prompt: Optional[str]):
        self.tokenizer, self.template = tokenizer, template
        self.messages = [{"role": "system", "content": system_prompt}] if system_prompt else []

    def prompt(self, text: str) -> list[int]:
        if not self.template:
            return self.tokenizer(text).input_ids  # a base model: continue the text
        self.messages.append({"role": "user", "content": text})
        rendered = self.tokenizer.apply_chat_template(
            self.messages, chat_template=self.template, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(rendered, add_special_tokens=False).input_ids

    def add_reply(self, text: str) -> None:
        if self.template:
            self.messages.append({"role": "assistant", "content": text})


def chat(argv: list[str]) -> int:
    a = make_parser().parse_args(argv)
    config = engine_config_from_args(a)
    lora = picked_lora(a, config)
    from minipaged.cli.serve import load_chat_template
    template = load_chat_template(a.chat_template)
    from minipaged import LLM, SamplingParams
    params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens)
    llm = LLM(**dataclasses.asdict(config))
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        raise ValueError(f"model {config.model!r} has no tokenizer (dummy weights): chat needs "
                         "text; use `minipaged generate` with token ids, or a model folder")
    template = template or getattr(tokenizer, "chat_template", None)
    if a.system_prompt and not template:
        raise ValueError("--system-prompt needs a chat template: this model has none (a base "
                         "model); give one with --chat-template, or drop --system-prompt")
    conversation = Conversation(tokenizer, template, a.system_prompt)

    def reply(text: str) -> str:
        out = llm.generate([conversation.prompt(text)], params, use_tqdm=False,
                           lora_request=lora)[0]
        conversation.add_reply(out.outputs[0].text)
        return out.outputs[0].text

    if a.quick is not None:
        print(reply(a.quick))
        return 0
    kind = ("chat template: the conversation is kept" if template else
            "no chat template: each line is continued on its own")
    adapter = f", LoRA adapter {lora.lora_name}" if lora else ""
    print(f"minipaged chat: {a.model_arg or a.model}{adapter} ({kind}). Ctrl-D or /exit ends it.",
          file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip():
            print(reply(line), flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    return run_command(chat, argv)


if __name__ == "__main__":
    raise SystemExit(main())
