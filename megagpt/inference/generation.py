"""Generate completions with either engine, timed: what tools/generate.py and the bench call.

Engines:
  ``megatron``  megatron.core.inference's static engine (``megatron_engine``)
  ``kv``        the KV decoder over the same weights (``kv_decoder``): one CUDA graph per
                step on a GPU, eager on the CPU
  ``auto``      ``kv`` on a GPU when it covers the model, else ``megatron`` (on the CPU the
                graphs that make ``kv`` fast do not exist, and megatron's engine serves)
Both choose the next token by ``megagpt.inference.sampling``; with greedy decoding in fp32
they give the same tokens (tests/test_generation.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megagpt.errors import UserError
from megagpt.inference import kv_decoder, megatron_engine
from megagpt.inference.sampling import Sampling

ENGINES = ("auto", "megatron", "kv")


class EngineError(UserError, ValueError):
    """The engine asked for cannot run this model."""


def prompt_ids(tokenizer, text: str) -> list[int]:
    """The prompt's ids; an empty prompt starts from the end-of-document token."""
    return [int(t) for t in tokenizer.tokenize(text)] if text else [int(tokenizer.eod)]


@dataclass(frozen=True)
class Completion:
    prompt: str
    prompt_tokens: list[int]
    tokens: list[int]  # new tokens; ends with the end-of-document token where it stopped there
    text: str  # the new tokens as text, without that final end-of-document token

    def as_json(self) -> dict:
        return {"prompt": self.prompt, "completion": self.text,
                "completion_tokens": self.tokens, "prompt_tokens": self.prompt_tokens}


@dataclass(frozen=True)
class Report:
    completions: list[Completion]
    seconds: float  # prefill + decode of every batch, after the model is loaded
    engine: str  # what ran, in words

    @property
    def new_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.completions)

    def summary(self) -> str:
        rate = self.new_tokens / self.seconds if self.seconds > 0 else float("inf")
        return (f"{len(self.completions)} prompt(s), {self.new_tokens} new tokens in "
                f"{self.seconds:.2f} s: {rate:.1f} tokens/s ({self.engine})")


def choose_engine(requested: str, model, device: torch.device) -> tuple[str, str]:
    """(engine, why) for ``requested`` in ENGINES."""
    reason = kv_decoder.unsupported_reason(model)
    if requested == "kv":
        if reason is not None:
            raise EngineError(f"--engine kv: the KV decoder does not cover {reason}")
        return "kv", "asked for"
    if requested == "megatron":
        return "megatron", "asked for"
    if device.type != "cuda":
        return "megatron", "on the CPU megatron's engine serves"
    if reason is not None:
        return "megatron", f"the KV decoder does not cover {reason}"
    return "kv", "on a GPU the KV decoder's CUDA graphs"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Generator:
    """One loaded model and tokenizer, ready to complete prompts with one engine."""

    def __init__(self, model, tokenizer, vocab_size: int, device: torch.device,
                 engine: str = "auto", batch_size: int = 16, compile_step: bool = False):
        """``compile_step``: the KV decoder's step through ``torch.compile`` (``--compile``)."""
        self.model, self.tokenizer, self.vocab_size = model, tokenizer, vocab_size
        self.device, self.batch_size = device, batch_size
        self.engine, self.engine_reason = choose_engine(engine, model, device)
        if compile_step and device.type != "cuda":
            raise EngineError("--compile: the KV decoder's step is compiled on a GPU only "
                              "(on the CPU it runs eagerly)")
        if compile_step and self.engine != "kv":
            raise EngineError(f"--compile compiles the KV decoder's step; the engine here is "
                              f"{self.engine} ({self.engine_reason})")
        self.compile_step = compile_step
        self._decoder = None
        self.eod = int(tokenizer.eod)

    def describe(self) -> str:
        dtype = str(self.model.embedding.word_embeddings.weight.dtype).replace("torch.", "")
        where = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "CPU"
        name = {"kv": "KV decoder" + (", CUDA graphs" if self.device.type == "cuda" else "")
                + (", compiled step" if self.compile_step else ""),
                "megatron": "megatron.core.inference static engine"}[self.engine]
        return f"{name}, {dtype}, {where}"

    def _decoder_for(self, batch: int, max_length: int) -> kv_decoder.KVDecoder:
        """The decoder, kept across calls (its CUDA graphs with it) while it is big enough."""
        d = self._decoder
        if d is None or d.max_batch < batch or d.max_length < max_length:
            self._decoder = kv_decoder.KVDecoder(self.model, batch, max_length,
                                                 compile_step=self.compile_step)
        return self._decoder

    def token_ids(self, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling,
                  stop_at_eod: bool = True) -> list[list[int]]:
        """New ids for each prompt, in batches of ``batch_size``."""
        if self.engine == "megatron":
            return megatron_engine.generate(
                self.model, self.tokenizer, prompts, max_new_tokens, sampling,
                self.vocab_size, self.eod, stop_at_eod,
                min(self.batch_size, len(prompts)), self.device)
        decoder = self._decoder_for(min(self.batch_size, len(prompts)),
                                    max(len(p) for p in prompts) + max_new_tokens)
        out: list[list[int]] = []
        for start in range(0, len(prompts), self.batch_size):
            out.extend(decoder.generate(prompts[start:start + self.batch_size], max_new_tokens,
                                        sampling, self.vocab_size, self.eod, stop_at_eod))
        return out

    def complete(self, texts: list[str], max_new_tokens: int, sampling: Sampling,
                 stop_at_eod: bool = True) -> Report:
        prompts = [prompt_ids(self.tokenizer, t) for t in texts]
        _synchronize(self.device)
        start = time.perf_counter()
        new = self.token_ids(prompts, max_new_tokens, sampling, stop_at_eod)
        _synchronize(self.device)
        seconds = time.perf_counter() - start
        completions = []
        for text, prompt, tokens in zip(texts, prompts, new):
            shown = tokens[:-1] if tokens and tokens[-1] == self.eod and stop_at_eod else tokens
            completions.append(Completion(text, prompt, tokens,
                                          self.tokenizer.detokenize(shown) if shown else ""))
        return Report(completions, seconds, self.describe())
