"""Merging datasets, and loading our outputs through megatron's own dataset builder (CPU).

The training entry passes --data-path (optionally weighted: 0.7 a 0.3 b) or
--train-data-path/--valid-data-path/--test-data-path to BlendedMegatronDatasetBuilder with a
GPTDatasetConfig; these tests do the same with the files our preprocessing writes.
"""

import json
import os

import numpy as np
import pytest

from megagpt.data.merge import MergeError, expand_prefixes, main as merge_main, merge_datasets
from megagpt.data.preprocess import preprocess


def null_dataset(tmp_path, name, rows, vocab_size=1000, **kw):
    """A dataset whose token ids are literally the numbers in the text (NullTokenizer)."""
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"text": " ".join(map(str, r))}) + "\n" for r in rows))
    r = preprocess(str(src), tmp_path / name, tokenizer_type="NullTokenizer", vocab_size=vocab_size,
                   log_interval=0, workers=1, **kw)
    return r.prefixes["text"]


def read_all(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds.document_indices.tolist()


def test_merge_keeps_order_and_every_document(tmp_path, capsys):
    a = null_dataset(tmp_path, "a", [[1, 2, 3], [4]])
    b = null_dataset(tmp_path, "b", [[5, 6], [7, 8, 9], [10]])
    out = str(tmp_path / "m" / "ab_text_document")
    r = merge_datasets([a, b], out)
    assert (r.documents, r.tokens, r.dtype) == (5, 10, "uint16")
    seqs, doc_idx = read_all(out)
    assert seqs == [[1, 2, 3], [4], [5, 6], [7, 8, 9], [10]]
    assert doc_idx == [0, 1, 2, 3, 4, 5]
    # CLI, with a folder as input (pairs sorted by name) and .bin paths accepted as prefixes
    assert merge_main(["--input", str(tmp_path / "m"), a + ".bin", "--output-prefix",
                       str(tmp_path / "again")]) == 0
    assert "2 datasets" in capsys.readouterr().err
    assert read_all(str(tmp_path / "again"))[0] == seqs + [[1, 2, 3], [4]]
    assert expand_prefixes([str(tmp_path / "m")]) == [out]


def test_merged_data_keeps_the_tokenizer_record_its_inputs_agree_on(tmp_path, capsys):
    from megagpt.data import tokenizer_record

    a = null_dataset(tmp_path, "a", [[1, 2, 3], [4]])
    b = null_dataset(tmp_path, "b", [[5, 999]])
    out = str(tmp_path / "ab")
    merge_datasets([a, b], out)
    record = tokenizer_record.read(out)
    assert record.tokenizer == tokenizer_record.read(a).tokenizer
    assert (record.max_token_id, record.documents, record.tokens) == (999, 3, 6)
    other = null_dataset(tmp_path, "c", [[7]], vocab_size=2000)  # another vocabulary
    assert merge_main(["--input", a, other, "--output-prefix", out]) == 0
    assert "no tokenizer record written" in capsys.readouterr().err
    assert tokenizer_record.read(out) is None  # the earlier output's record is gone


def test_merge_refuses_bad_inputs_without_writing(tmp_path, capsys):
    a = null_dataset(tmp_path, "a", [[1, 2]])
    big = null_dataset(tmp_path, "big", [[69999]], vocab_size=70000)
    out = tmp_path / "out"
    with pytest.raises(MergeError, match="different token dtypes: .*uint16.*int32"):
        merge_datasets([a, big], str(out))
    with pytest.raises(MergeError, match="nope.bin: not found"):
        merge_datasets([a, str(tmp_path / "nope")], str(out))
    with pytest.raises(MergeError, match="the output is also an input"):
        merge_datasets([a], a)
    with open(a + ".bin", "ab") as f:  # a .bin that does not match its index
        f.write(b"\0\0")
    assert merge_main(["--input", a, "--output-prefix", str(out)]) == 2
    assert "bytes, but its index describes" in capsys.readouterr().err
    assert not list(tmp_path.glob("out*"))


@pytest.fixture(scope="module")
def gpt_config_factory():
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.tokenizers import MegatronTokenizer

    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=1000)

    def make(tmp_path, **kw):
        return GPTDatasetConfig(random_seed=1234, sequence_length=8, reset_position_ids=False,
                                reset_attention_mask=False, eod_mask_loss=False, tokenizer=tokenizer,
                                path_to_cache=str(tmp_path / "index-cache"), mmap_bin_files=True, **kw)

    return make


def build(config, sizes):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


def two_sources(tmp_path):
    # source A holds only ids 1..99, source B only 100..199: a sample tells where it came from
    rng = np.random.default_rng(0)
    a = null_dataset(tmp_path, "A", [rng.integers(1, 100, 30).tolist() for _ in range(60)], append_eod=True)
    b = null_dataset(tmp_path, "B", [rng.integers(100, 200, 30).tolist() for _ in range(60)], append_eod=True)
    return a, b


def test_single_prefix_with_split(tmp_path, gpt_config_factory):
    from megatron.core.datasets.utils import get_blend_from_list

    a, _ = two_sources(tmp_path)
    cfg = gpt_config_factory(tmp_path, blend=get_blend_from_list([a]), split="90,5,5")
    train, valid, test = build(cfg, [50, 5, 5])
    assert len(train) >= 50 and valid is not None and test is not None
    sample = train[0]
    assert sample["tokens"].shape[0] == 8
    assert set(sample["tokens"].tolist()) <= set(range(1, 100)) | {999}  # 999: NullTokenizer EOD


def test_weighted_blend_like_data_path_0_7_a_0_3_b(tmp_path, gpt_config_factory):
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.utils import get_blend_from_list

    a, b = two_sources(tmp_path)
    blend = get_blend_from_list(["0.7", a, "0.3", b])  # --data-path 0.7 A 0.3 B
    cfg = gpt_config_factory(tmp_path, blend=blend, split="90,5,5")
    train, valid, test = build(cfg, [200, 10, 10])
    assert isinstance(train, BlendedDataset) and len(train) == 200
    assert isinstance(valid, BlendedDataset) and len(valid) == 10
    A, B = set(range(1, 100)) | {999}, set(range(100, 200)) | {999}
    origin = []
    for i in range(len(train)):
        toks = set(train[i]["tokens"].tolist()) | set(train[i]["labels"].tolist())
        assert toks <= A or toks <= B, toks
        origin.append(0 if toks <= A else 1)
    assert origin == [int(d) for d in train.dataset_index]  # megatron's own record of the source
    assert 130 <= origin.count(0) <= 150  # 70% of 200 = 140


def test_per_split_paths_like_train_valid_test_data_path(tmp_path, gpt_config_factory):
    from megatron.core.datasets.utils import get_blend_from_list

    a, b = two_sources(tmp_path)
    merged = str(tmp_path / "AB_text_document")
    merge_datasets([a, b], merged)
    cfg = gpt_config_factory(tmp_path, blend_per_split=[
        get_blend_from_list([a]),  # --train-data-path A
        get_blend_from_list([b]),  # --valid-data-path B
        get_blend_from_list([merged]),  # --test-data-path AB (the merge output)
    ])
    train, valid, test = build(cfg, [40, 10, 10])
    assert all(set(train[i]["tokens"].tolist()) <= set(range(1, 100)) | {999} for i in range(len(train)))
    assert all(set(valid[i]["tokens"].tolist()) <= set(range(100, 200)) | {999} for i in range(len(valid)))
    assert len(test) >= 10
    # the index caches megatron writes are beside the data, not in the source folder
    assert os.path.isdir(tmp_path / "index-cache")
