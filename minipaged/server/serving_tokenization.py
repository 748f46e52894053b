"""`POST /tokenize` and `POST /detokenize` (vLLM's extensions): the server's own tokenizer, so a
client can count tokens or read ids exactly as the engine will. Lesson 07 mentions them."""
from __future__ import annotations

from minipaged.engine.llm_engine import RequestError
from minipaged.server.request_stream import TextPrompt
from minipaged.server.protocol import (ChatCompletionRequest, DetokenizeRequest,
                                       DetokenizeResponse, TokenizeRequest, TokenizeResponse)
from minipaged.server.serving_chat import OpenAIServingChat
from minipaged.server.serving_engine import OpenAIError, check_text


class OpenAIServingTokenization(OpenAIServingChat):
    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise OpenAIError("this model has no tokenizer (dummy weights?)", param="model")

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.model_name(req.model)
        self._need_tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError("give exactly one of `prompt` (text) and `messages` (chat)",
                              param="prompt")
        if req.messages is not None:
            chat = ChatCompletionRequest(messages=req.messages, chat_template=req.chat_template,
                                         chat_template_kwargs=req.chat_template_kwargs,
                                         add_generation_prompt=req.add_generation_prompt)
            prompt = TextPrompt(await self.render_chat(chat), add_special_tokens=False)
        else:
            check_text(req.prompt, "prompt")
            prompt = TextPrompt(req.prompt, add_special_tokens=req.add_special_tokens)
        try:
            ids = await self.llm.tokenize(prompt)
        except RequestError as e:
            raise OpenAIError(str(e), param="prompt") from None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.model_name(req.model)
        self._need_tokenizer()
        vocab = self.llm.info["vocab_size"]
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})",
                              param="tokens")
        tok = self.tokenizer
        text = await self.llm.run_off_loop(lambda: tok.decode(req.tokens), "detokenizing")
        return DetokenizeResponse(prompt=text)
