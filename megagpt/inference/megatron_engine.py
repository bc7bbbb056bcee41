"""Generation through megatron.core.inference: its static engine and KV cache.

megatron-core 0.19's ``StaticInferenceEngine`` runs on its dynamic engine when it can; that
one's paged attention needs flash-attn (absent from a plain install), so the engine is asked
for its static batching loop (``legacy=True``): ``TextGenerationController`` prefills the
batch up to its shortest prompt, then decodes one token per step for every row, with the
KV cache of megatron's ``StaticInferenceContext`` inside megatron's attention. Prompts of
different lengths share a batch: the longer ones are fed their own next prompt token until
they run out.

Only the choice of the next token is ours (``megagpt.inference.sampling``, the same rule
as the KV decoder's): megatron's sampler may pick a padding row of the vocabulary and
refuses top-k with top-p.
"""

from __future__ import annotations

import contextlib
import io

import torch

from megagpt.inference.sampling import Sampling, generator_for, next_tokens


def _controller_class():
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    class SamplingController(TextGenerationController):
        """megatron's controller with ``sample_from_logits`` replaced by ``choose``."""

        def __init__(self, wrapped_model, tokenizer, choose):
            super().__init__(wrapped_model, tokenizer)
            self._choose = choose

        def sample_from_logits(self, last_token_logits, sampling_params=None, vocab_size=None,
                               generation_started=None, top_n_logprobs_dict=None, logits=None,
                               **kwargs):
            return self._choose(last_token_logits)

    return SamplingController


def generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int,
             sampling: Sampling, vocab_size: int, eod: int, stop_at_eod: bool,
             batch_size: int, device: torch.device,
             prompt_texts: list[str] | None = None) -> list[list[int]]:
    """The new token ids for each prompt; a completion that ends at the end-of-document
    token includes it (as transformers' generate returns it)."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.engines.static_engine import StaticInferenceEngine
    from megatron.core.inference.inference_request import InferenceRequest
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.utils import InferenceMode

    longest = max(len(p) for p in prompts)
    context = StaticInferenceContext(max_batch_size=batch_size,
                                     max_sequence_length=longest + max_new_tokens)
    wrapped = GPTInferenceWrapper(model, context)
    generator = generator_for(sampling, device)
    controller = _controller_class()(
        wrapped, tokenizer, lambda logits: next_tokens(logits, sampling, vocab_size, generator))
    params = SamplingParams(num_tokens_to_generate=max_new_tokens, termination_id=eod)
    if not stop_at_eod:
        params.add_attributes({"no_early_termination": True})
    texts = prompt_texts or [""] * len(prompts)
    requests = [InferenceRequest(request_id=str(i), prompt=text, prompt_tokens=list(tokens),
                                 sampling_params=params)
                for i, (tokens, text) in enumerate(zip(prompts, texts))]
    engine = StaticInferenceEngine(controller, max_batch_size=batch_size, legacy=True)
    try:
        # the engine draws a tqdm progress bar of requests on stderr: not this tool's output
        with contextlib.redirect_stderr(io.StringIO()):
            done = engine.generate(inference_requests=requests)
    finally:
        InferenceMode.unset_active()  # the engine sets it process-wide
    completions = []
    for request in done:
        tokens = [int(t) for t in request.generated_tokens.tolist()]
        # megatron leaves the end-of-document token out of what it returns: a completion
        # shorter than asked for stopped there
        if stop_at_eod and len(tokens) < max_new_tokens:
            tokens.append(eod)
        completions.append(tokens)
    return completions
