"""The pretrain_gpt hooks on real megatron code: loss_func, get_batch (TP=2, CP=2 over
gloo processes) and the dataset provider (real .bin/.idx and mock data)."""

import numpy as np
import pytest
import torch

import pretrain_gpt
from gloo_ranks import run_on_ranks, single_gloo_rank
from megagpt import cpu_mode

MICRO_BATCH, SEQ = 2, 8


def known_batch() -> dict:
    """A micro-batch whose every value says where it came from."""
    tokens = torch.arange(MICRO_BATCH * SEQ, dtype=torch.int64).view(MICRO_BATCH, SEQ)
    return {
        "tokens": tokens,
        "labels": tokens + 1000,
        "loss_mask": (tokens % 3 != 0).float(),
        "position_ids": torch.arange(SEQ).repeat(MICRO_BATCH, 1),
        "attention_mask": None,
    }


LAYOUT = pretrain_gpt.BatchLayout(micro_batch_size=MICRO_BATCH, seq_length=SEQ,
                                  create_attention_mask=False, mtp_num_layers=None)


# ---------------------------------------------------------------------------
# loss_func
# ---------------------------------------------------------------------------

def test_loss_func_sums_masked_token_losses_and_counts_tokens():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    checks = pretrain_gpt.LossChecks(nan_and_inf=True, spiky_loss=False)

    loss, num_tokens, report = pretrain_gpt.loss_func(mask, per_token, checks=checks)

    # By hand: 1 + 3 + 4 + 5 over the unmasked tokens; 2 and 6 are masked out.
    assert loss.item() == 13.0
    assert num_tokens.item() == 4 and num_tokens.dtype == torch.int32
    assert report["lm loss"].tolist() == [13.0, 4.0]


def test_loss_func_with_everything_masked_is_zero_over_zero_tokens():
    per_token = torch.full((2, 3), 7.0)
    checks = pretrain_gpt.LossChecks(nan_and_inf=False, spiky_loss=False)
    loss, num_tokens, _ = pretrain_gpt.loss_func(torch.zeros(2, 3), per_token, checks=checks)
    assert loss.item() == 0.0 and num_tokens.item() == 0


def test_loss_func_rejects_nan_through_the_rerun_state_machine():
    from megatron.core.rerun_state_machine import (
        RerunMode, destroy_rerun_state_machine, initialize_rerun_state_machine)

    # Outside a training step the state machine validates directly (DISABLED mode) and a
    # fatal rejection raises; inside pretrain, VALIDATE_RESULTS mode re-runs the step first.
    destroy_rerun_state_machine()  # an earlier test may have created the default one
    initialize_rerun_state_machine(mode=RerunMode.DISABLED)
    try:
        per_token = torch.tensor([[1.0, float("nan")]])
        checks = pretrain_gpt.LossChecks(nan_and_inf=True, spiky_loss=False)
        with cpu_mode.active(), pytest.raises(RuntimeError, match="found NaN"):
            pretrain_gpt.loss_func(torch.ones(1, 2), per_token, checks=checks)
        masked_nan = pretrain_gpt.loss_func(torch.tensor([[1, 0]]), torch.tensor([[1.0, 5.0]]),
                                            checks=checks)
        assert masked_nan[0].item() == 1.0
    finally:
        destroy_rerun_state_machine()


# ---------------------------------------------------------------------------
# get_batch over gloo processes
# ---------------------------------------------------------------------------

def _tp2_worker(rank, world_size):
    from megatron.core import parallel_state

    with cpu_mode.active():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
        try:
            # Only TP rank 0 reads data; rank 1 has no iterator and must receive the batch.
            iterator = iter([known_batch()]) if rank == 0 else None
            tokens, labels, loss_mask, attention_mask, position_ids = pretrain_gpt.get_batch(
                iterator, LAYOUT)
            expected = known_batch()
            assert tokens.shape == (MICRO_BATCH, SEQ)
            assert torch.equal(tokens, expected["tokens"])
            assert torch.equal(labels, expected["labels"])
            assert torch.equal(loss_mask, expected["loss_mask"])
            assert torch.equal(position_ids, expected["position_ids"])
            assert attention_mask is None
        finally:
            parallel_state.destroy_model_parallel()


def _cp2_worker(rank, world_size):
    from megatron.core import parallel_state

    with cpu_mode.active():
        parallel_state.initialize_model_parallel(context_parallel_size=2)
        try:
            # Both ranks are TP rank 0 of their own TP group, so both read the same batch.
            tokens, labels, loss_mask, _, position_ids = pretrain_gpt.get_batch(
                iter([known_batch()]), LAYOUT)
            # Zigzag balancing: the sequence is cut into 2*CP = 4 chunks of 2 tokens;
            # CP rank 0 keeps chunks 0 and 3, CP rank 1 keeps chunks 1 and 2.
            chunks = {0: [0, 3], 1: [1, 2]}[rank]
            keep = torch.cat([torch.arange(c * 2, c * 2 + 2) for c in chunks])
            expected = known_batch()
            assert tokens.shape == (MICRO_BATCH, SEQ // 2)
            assert torch.equal(tokens, expected["tokens"][:, keep])
            assert torch.equal(labels, expected["labels"][:, keep])
            assert torch.equal(loss_mask, expected["loss_mask"][:, keep])
            assert torch.equal(position_ids, expected["position_ids"][:, keep])
        finally:
            parallel_state.destroy_model_parallel()


def _pp3_worker(rank, world_size):
    from megatron.core import parallel_state

    with cpu_mode.active():
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=3)
        try:
            iterator = iter([known_batch()])
            out = pretrain_gpt.get_batch(iterator, LAYOUT)
            if rank == 1:
                # The middle stage gets activations from its neighbour, not data.
                assert out == (None, None, None, None, None)
                assert next(iterator, None) is not None  # and it consumed no data
            elif rank == 0:
                # The first stage embeds tokens; it has no use for labels.
                tokens, labels, loss_mask, _, position_ids = out
                assert torch.equal(tokens, known_batch()["tokens"])
                assert torch.equal(position_ids, known_batch()["position_ids"])
                assert labels is None and loss_mask is None
            else:
                # The last stage computes the loss; it gets labels and the mask, no tokens.
                tokens, labels, loss_mask, _, position_ids = out
                assert tokens is None and position_ids is None
                assert torch.equal(labels, known_batch()["labels"])
                assert torch.equal(loss_mask, known_batch()["loss_mask"])
        finally:
            parallel_state.destroy_model_parallel()


@pytest.mark.slow
def test_get_batch_tensor_parallel_source_rank_broadcasts():
    run_on_ranks(_tp2_worker, 2)


@pytest.mark.slow
def test_get_batch_context_parallel_slices_the_sequence():
    run_on_ranks(_cp2_worker, 2)


@pytest.mark.slow
def test_get_batch_gives_middle_pipeline_stages_nothing():
    run_on_ranks(_pp3_worker, 3)


# ---------------------------------------------------------------------------
# Dataset provider
# ---------------------------------------------------------------------------

def _write_indexed_dataset(prefix: str, documents: list[list[int]]) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in documents:
        builder.add_document(np.array(doc, dtype=np.int64), [len(doc)])
    builder.finalize(prefix + ".idx")


class _Tokenizer:
    """The two tokenizer attributes GPTDataset reads."""

    eod = 0
    pad = 1
    vocab_size = 512

    @property
    def unique_identifiers(self):
        return {"class": "test"}


def _dataset_config(**overrides):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    fields = dict(random_seed=1234, sequence_length=SEQ, tokenizer=_Tokenizer(),
                  reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                  path_to_cache=None, mid_level_dataset_surplus=0.005)
    fields.update(overrides)
    return GPTDatasetConfig(**fields)


@pytest.fixture()
def single_rank_data_parallel():
    """megatron's dataset builder asks parallel_state which ranks build; one gloo rank."""
    with single_gloo_rank():
        yield


def test_dataset_provider_reads_a_real_indexed_dataset(tmp_path, single_rank_data_parallel):
    rng = np.random.default_rng(0)
    documents = [list(rng.integers(2, 500, size=int(n))) for n in rng.integers(5, 40, size=60)]
    prefix = str(tmp_path / "corpus_text_document")
    _write_indexed_dataset(prefix, documents)
    config = _dataset_config(blend=([prefix], None), split="90,5,5")

    train, valid, test = pretrain_gpt.train_valid_test_datasets_provider(
        [40, 4, 4], dataset_config=config, mock_data=False)

    assert len(train) >= 40 and valid is not None and test is not None
    all_tokens = set(t for doc in documents for t in doc) | {_Tokenizer.eod}
    sample = train[0]
    assert sample["tokens"].shape == (SEQ,)
    # Every token of a sample comes from the corpus, and labels are tokens shifted by one.
    assert set(sample["tokens"].tolist()) <= all_tokens
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])


def test_dataset_provider_blends_by_weight(tmp_path, single_rank_data_parallel):
    a, b = str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")
    _write_indexed_dataset(a, [[10] * 30 for _ in range(50)])
    _write_indexed_dataset(b, [[20] * 30 for _ in range(50)])
    config = _dataset_config(blend=([a, b], [0.75, 0.25]), split="100,0,0")

    train, _, _ = pretrain_gpt.train_valid_test_datasets_provider(
        [200, 0, 0], dataset_config=config, mock_data=False)

    from_a = sum(1 for i in range(200) if 10 in train[i]["tokens"].tolist())
    assert 130 <= from_a <= 170, from_a  # 75% of 200, by the blend's weights


def test_dataset_provider_mock_data(single_rank_data_parallel):
    config = _dataset_config(blend=None, split="1,1,1")
    train, valid, test = pretrain_gpt.train_valid_test_datasets_provider(
        [16, 4, 4], dataset_config=config, mock_data=True)
    assert len(train) >= 16
    assert train[3]["tokens"].shape == (SEQ,)


def test_dataset_provider_builds_no_split_asked_for_no_samples(
        tmp_path, single_rank_data_parallel, capsys):
    """A small corpus under megatron's default split: the test share (1/1000) holds one
    document of 3 tokens, shorter than one sequence. Asked for no samples (--eval-iters 0),
    the validation and test splits are not built: megatron would build their indices all
    the same, loop forever for a share that rounds to no document, and its sampler asserts
    on an empty dataset. Asked for samples, a split gets them (megatron repeats epochs)."""
    documents = [[7] * 20 for _ in range(999)] + [[9] * 3]  # the last document: 3 tokens
    prefix = str(tmp_path / "small_text_document")
    _write_indexed_dataset(prefix, documents)
    config = _dataset_config(blend=([prefix], None), split="969,30,1")

    train, valid, test = pretrain_gpt.train_valid_test_datasets_provider(
        [32, 0, 0], dataset_config=config, mock_data=False)
    assert len(train) >= 32 and valid is None and test is None
    assert "no samples asked of the validation and test splits: not built" in \
        capsys.readouterr().out
    assert config.split_matrix[2] is not None  # the caller's config is left as it was

    _, valid, test = pretrain_gpt.train_valid_test_datasets_provider(
        [32, 4, 4], dataset_config=config, mock_data=False)
    assert len(valid) >= 4 and test is not None and len(test) >= 4


def test_a_per_split_dataset_too_small_for_one_sample_is_left_out(
        tmp_path, single_rank_data_parallel, capsys):
    """Per-split paths (--test-data-path): a test dataset shorter than one sequence, asked
    for no samples, is left out rather than handed to megatron's sampler."""
    big, tiny = str(tmp_path / "big_text_document"), str(tmp_path / "tiny_text_document")
    _write_indexed_dataset(big, [[7] * 20 for _ in range(200)])
    _write_indexed_dataset(tiny, [[9] * 3])
    config = _dataset_config(blend_per_split=[([big], None), ([big], None), ([tiny], None)])
    train, valid, test = pretrain_gpt.train_valid_test_datasets_provider(
        [32, 4, 0], dataset_config=config, mock_data=False)
    assert len(train) >= 32 and len(valid) >= 4 and test is None
    assert "the test split holds no whole sample" in capsys.readouterr().out
