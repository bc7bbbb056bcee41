"""The next-token rule both generation engines use."""

import re

import pytest
import torch

from megagpt.inference.sampling import Sampling, SamplingError, generator_for, next_tokens


def draws(logits, sampling, vocab, n=400):
    generator = generator_for(sampling, "cpu")
    return torch.stack([next_tokens(logits, sampling, vocab, generator) for _ in range(n)])


def test_greedy_is_the_largest_real_logit_and_never_a_padding_row():
    logits = torch.tensor([[0.1, 2.0, 0.3, 9.0], [5.0, 1.0, 4.0, 9.0]])  # column 3: padding
    assert next_tokens(logits, Sampling(greedy=True), 3, None).tolist() == [1, 0]


def test_a_seed_gives_the_same_draws_and_another_seed_others():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    one = draws(logits, Sampling(seed=3), 50, n=20)
    assert torch.equal(one, draws(logits, Sampling(seed=3), 50, n=20))
    assert not torch.equal(one, draws(logits, Sampling(seed=4), 50, n=20))


def test_top_k_1_is_greedy():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    greedy = next_tokens(logits, Sampling(greedy=True), 50, None)
    sampled = draws(logits, Sampling(top_k=1, temperature=2.0), 50, n=30)
    assert (sampled == greedy).all()


def test_top_k_and_top_p_keep_what_they_say():
    # probabilities 0.5, 0.25, 0.125, 0.0625, ... of tokens 0, 1, 2, 3, ...
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.03125, 0.03125]]))
    assert set(draws(logits, Sampling(top_k=2), 6).unique().tolist()) == {0, 1}
    # top-p 0.7: 0.5 alone is short of it, 0.5 + 0.25 reaches it: tokens 0 and 1
    assert set(draws(logits, Sampling(top_p=0.7), 6).unique().tolist()) == {0, 1}
    assert set(draws(logits, Sampling(top_p=0.5), 6).unique().tolist()) == {0}
    # combined: top-k 3 first, then the nucleus of what is left (0.5/0.875 = 0.57 < 0.6)
    assert set(draws(logits, Sampling(top_k=3, top_p=0.6), 6).unique().tolist()) == {0, 1}


def test_low_temperature_sharpens_and_high_flattens():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    cold = draws(logits, Sampling(temperature=0.05), 3)
    hot = draws(logits, Sampling(temperature=50.0), 3)
    assert (cold == 0).all()
    assert set(hot.unique().tolist()) == {0, 1, 2}


@pytest.mark.parametrize("sampling, message", [
    (Sampling(temperature=0), "--temperature 0: must be > 0"),
    (Sampling(top_k=51), "--top-k 51: must be between 0 (off) and the vocabulary's 50 tokens"),
    (Sampling(top_p=0), "--top-p 0: must be in (0, 1]"),
])
def test_impossible_settings_are_named(sampling, message):
    with pytest.raises(SamplingError, match=re.escape(message)):
        sampling.check(50)
