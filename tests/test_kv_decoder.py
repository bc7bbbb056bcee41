"""The KV decoder against megatron's own forward pass, and both generation engines against
each other, on small real GPTModels of every architecture the decoder covers (CPU, fp32)."""

import pytest
import torch

from megatron_parts import GPT_VARIANTS, cpu_megatron, tiny_gpt
from megagpt.inference import kv_decoder, megatron_engine
from megagpt.inference.sampling import Sampling

VOCAB, EOD = 96, 95


def megatron_logits(model, tokens: list[int]) -> torch.Tensor:
    """megatron's logits for every position of one sequence: [len, vocab]."""
    ids = torch.tensor([tokens])
    positions = torch.arange(len(tokens)).unsqueeze(0)
    return model(ids, positions, None, runtime_gather_output=True)[0]


class _Tokenizer:
    """The two members megatron's text-generation controller reads from a tokenizer here
    (prompts arrive as ids; the text is only echoed back)."""

    eod = EOD

    def detokenize(self, ids, **kwargs):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("variant", list(GPT_VARIANTS))
def test_prefill_and_each_decode_step_give_megatron_logits(variant):
    """Prompts of three lengths in one batch: the prefill's last-token logits, then four
    decode steps (each row at its own position), equal megatron's full forward pass."""
    prompts = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38, 32]]
    follow = [[5, 2, 8, 1], [7, 7, 0, 6], [9, 3, 4, 4]]
    with cpu_megatron():
        model = tiny_gpt(variant, vocab_size=VOCAB)
        assert kv_decoder.unsupported_reason(model) is None
        decoder = kv_decoder.KVDecoder(model, max_batch=3, max_length=16, use_graphs=False)
        lengths = torch.tensor([len(p) for p in prompts])
        padded = torch.full((3, 8), EOD)
        for r, p in enumerate(prompts):
            padded[r, :len(p)] = torch.tensor(p)
        got = decoder.forward(padded, torch.arange(8).expand(3, -1), lengths - 1)
        for r, p in enumerate(prompts):
            torch.testing.assert_close(got[r], megatron_logits(model, p)[-1], atol=1e-5, rtol=0)
        for step in range(4):
            tokens = torch.tensor([[f[step]] for f in follow])
            got = decoder.forward(tokens, (lengths + step).unsqueeze(1), torch.zeros(3).long())
            for r, p in enumerate(prompts):
                expected = megatron_logits(model, p + follow[r][:step + 1])[-1]
                torch.testing.assert_close(got[r], expected, atol=1e-5, rtol=0)


def test_greedy_tokens_are_megatrons_engine_tokens_for_prompts_of_different_lengths():
    prompts = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38, 32]]
    greedy = Sampling(greedy=True)
    with cpu_megatron():
        model = tiny_gpt("llama_gqa", vocab_size=VOCAB)
        ours = kv_decoder.KVDecoder(model, 3, 20, use_graphs=False).generate(
            prompts, 10, greedy, VOCAB, EOD, stop_at_eod=False)
        theirs = megatron_engine.generate(model, _Tokenizer(), prompts, 10, greedy, VOCAB, EOD,
                                          False, 3, torch.device("cpu"))
    assert ours == theirs
    assert all(len(c) == 10 for c in ours)
    # the batch is exact: each prompt alone gives its row
    with cpu_megatron():
        model = tiny_gpt("llama_gqa", vocab_size=VOCAB)
        alone = [kv_decoder.KVDecoder(model, 1, 20, use_graphs=False).generate(
            [p], 10, greedy, VOCAB, EOD, stop_at_eod=False)[0] for p in prompts]
    assert alone == ours


def test_seeded_sampling_draws_alike_in_both_engines_and_again():
    """Prompts of one length: both engines sample every row once per step from the same
    generator, so a seed gives the same tokens in either, every time."""
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6]]
    sampling = Sampling(temperature=1.3, top_k=20, top_p=0.9, seed=7)
    with cpu_megatron():
        model = tiny_gpt("gpt2", vocab_size=VOCAB)
        decoder = kv_decoder.KVDecoder(model, 2, 16, use_graphs=False)
        first = decoder.generate(prompts, 8, sampling, VOCAB, EOD, stop_at_eod=False)
        again = decoder.generate(prompts, 8, sampling, VOCAB, EOD, stop_at_eod=False)
        other_seed = decoder.generate(prompts, 8, Sampling(temperature=1.3, top_k=20, top_p=0.9,
                                                           seed=8), VOCAB, EOD, False)
        engine = megatron_engine.generate(model, _Tokenizer(), prompts, 8, sampling, VOCAB, EOD,
                                          False, 2, torch.device("cpu"))
    assert first == again == engine
    assert other_seed != first


def test_generation_stops_at_the_end_of_document_token_and_keeps_it():
    """A vocabulary whose most likely token is the end-of-document one: every row stops at
    once and returns just that token, in both engines."""
    with cpu_megatron():
        model = tiny_gpt("gpt2", vocab_size=VOCAB)
        eod = int(megatron_logits(model, [1, 2, 3])[-1].argmax())
        kwargs = dict(max_new_tokens=6, sampling=Sampling(greedy=True), vocab_size=VOCAB, eod=eod,
                      stop_at_eod=True)
        ours = kv_decoder.KVDecoder(model, 1, 16, use_graphs=False).generate([[1, 2, 3]], **kwargs)
        tokenizer = _Tokenizer()
        tokenizer.eod = eod
        theirs = megatron_engine.generate(model, tokenizer, [[1, 2, 3]], batch_size=1,
                                          device=torch.device("cpu"), **kwargs)
    assert ours == theirs == [[eod]]


@pytest.mark.parametrize("features, named", [
    (dict(qk_layernorm=True), "q/k layer norms (--qk-layernorm)"),
    (dict(num_experts=2), "mixture of experts (--num-experts)"),
])
def test_models_the_decoder_does_not_cover_are_named(features, named):
    with cpu_megatron():
        model = tiny_gpt("gpt2", vocab_size=VOCAB, **features)
        assert kv_decoder.unsupported_reason(model) == named
        with pytest.raises(ValueError, match=f"does not cover {named[:10]}"):
            kv_decoder.KVDecoder(model, 1, 8)


def test_compiled_step_gives_the_eager_steps_tokens():
    """``compile_step``: the decode step through torch.compile (inductor on the CPU here)
    gives the eager step's greedy and seeded tokens. (CPU mode switches dynamo off for
    development runs; the test switches it back on.)"""
    prompts = [[3, 14, 15, 92, 65], [35, 89]]
    with cpu_megatron(), torch._dynamo.config.patch(disable=False):
        model = tiny_gpt("gpt2", vocab_size=VOCAB)
        eager = kv_decoder.KVDecoder(model, 2, 24, use_graphs=False)
        compiled = kv_decoder.KVDecoder(model, 2, 24, use_graphs=False, compile_step=True)
        for sampling in (Sampling(greedy=True), Sampling(temperature=1.3, top_k=20, seed=4)):
            args = (prompts, 10, sampling, VOCAB, EOD, False)
            assert compiled.generate(*args) == eager.generate(*args)
        assert compiled._compiled_forward is not None


@pytest.mark.parametrize("variant", ["gpt2", "llama_gqa"])
def test_compiled_decode_step_gives_the_eager_steps_logits(variant):
    """A compiled decode step of two rows computes its linear layers as reductions
    (``GEMV_MAX_ROWS``); its logits equal the eager step's on the same cache."""
    assert 2 <= kv_decoder.GEMV_MAX_ROWS
    with cpu_megatron(), torch._dynamo.config.patch(disable=False), torch.inference_mode():
        model = tiny_gpt(variant, vocab_size=VOCAB)
        decoder = kv_decoder.KVDecoder(model, 2, 24, use_graphs=False, compile_step=True)
        prompt = torch.tensor([[3, 14, 15, 92, 65], [35, 89, 7, 7, 1]])
        decoder.forward(prompt, torch.arange(5).expand(2, -1), torch.tensor([4, 4]))
        step = (torch.tensor([[9], [4]]), torch.tensor([[5], [5]]), torch.tensor([0, 0]))
        eager = decoder.forward(*step)
        compiled = decoder._step_forward()(*step)  # rewrites the same cache entries
        assert compiled.shape == eager.shape == (2, model.vocab_size)
        torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
