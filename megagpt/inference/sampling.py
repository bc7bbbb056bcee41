"""The next token from a batch of logits: greedy, or sampled with temperature, top-k, top-p.

Only the first ``vocab_size`` logits are tokens; the rows megatron adds to pad the
vocabulary are never chosen (an exported model does not have them either). Top-k and top-p
may be combined: top-k first, then the smallest set of the remaining tokens whose
probability reaches top-p, as transformers' generate does. Sampling draws from one
``torch.Generator`` seeded once per call of the caller, so a seed gives the same text on
the same device and batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megagpt.errors import UserError


class SamplingError(UserError, ValueError):
    """Sampling options that cannot be honoured together."""


@dataclass(frozen=True)
class Sampling:
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int = 1234

    def check(self, vocab_size: int) -> "Sampling":
        if self.temperature <= 0:
            raise SamplingError(f"--temperature {self.temperature}: must be > 0 "
                                "(--greedy picks the most likely token)")
        if not 0 <= self.top_k <= vocab_size:
            raise SamplingError(f"--top-k {self.top_k}: must be between 0 (off) and the "
                                f"vocabulary's {vocab_size} tokens")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"--top-p {self.top_p}: must be in (0, 1]")
        return self

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        parts = [f"temperature {self.temperature:g}"]
        if self.top_k:
            parts.append(f"top-k {self.top_k}")
        if self.top_p < 1:
            parts.append(f"top-p {self.top_p:g}")
        return "sampled (" + ", ".join(parts) + f", seed {self.seed})"


def generator_for(sampling: Sampling, device) -> torch.Generator | None:
    if sampling.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(sampling.seed)
    return generator


def next_tokens(logits: torch.Tensor, sampling: Sampling, vocab_size: int,
                generator: torch.Generator | None) -> torch.Tensor:
    """[batch, >= vocab_size] logits -> [batch] token ids (int64, on the logits' device)."""
    logits = logits[:, :vocab_size].float()
    if sampling.greedy:
        return torch.argmax(logits, dim=-1)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        # drop a token when the ones before it already reach top_p (the first always stays)
        drop_sorted = (cumulative - ordered.softmax(dim=-1)) >= sampling.top_p
        drop = drop_sorted.scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probabilities = logits.softmax(dim=-1)
    return torch.multinomial(probabilities, 1, generator=generator).view(-1)
