"""megagpt.data.indexed_format against megatron's own builder and reader."""

import numpy as np
import pytest

from megagpt.data import indexed_format


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_files_are_byte_identical_to_megatrons_builder_and_read_back(tmp_path, dtype):
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 60000, size=rng.integers(1, 50)) for _ in range(40)]
    theirs = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=dtype)
    for doc in docs:
        theirs.add_document(doc, [len(doc)])
    theirs.finalize(str(tmp_path / "m.idx"))
    ours = indexed_format.IndexedWriter(str(tmp_path / "o.bin"), dtype)
    ours.add_documents(np.concatenate(docs[:25]), [len(d) for d in docs[:25]])
    ours.add_documents(np.concatenate(docs[25:]), [len(d) for d in docs[25:]])
    ours.finalize(str(tmp_path / "o.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"o{ext}").read_bytes() == (tmp_path / f"m{ext}").read_bytes()
    read = IndexedDataset(str(tmp_path / "o"))
    assert [read[i].tolist() for i in range(len(docs))] == [d.astype(dtype).tolist() for d in docs]
    facts = indexed_format.read_index(str(tmp_path / "o.idx"))
    assert facts.dtype == np.dtype(dtype) and facts.sequences == 40 and facts.document_count == 40
    assert facts.bin_bytes == (tmp_path / "o.bin").stat().st_size


def test_dtype_codes_and_choice_are_megatrons():
    from megatron.core.datasets.indexed_dataset import DType

    for dtype, code in indexed_format.DTYPE_CODES.items():
        assert DType.code_from_dtype(dtype.type) == code
    for vocab in (None, 512, 50257, 65499, 65500, 200000):
        assert indexed_format.optimal_dtype(vocab) == np.dtype(DType.optimal_dtype(vocab))


def test_not_an_index(tmp_path):
    (tmp_path / "x.idx").write_bytes(b"MMIDIDX\x00\x00" + b"\x02" + b"\x00" * 40)
    with pytest.raises(ValueError, match="not megatron's indexed-dataset format"):
        indexed_format.read_index(str(tmp_path / "x.idx"))
    (tmp_path / "y.idx").write_bytes(b"short")
    with pytest.raises(ValueError, match="shorter than an index header"):
        indexed_format.read_index(str(tmp_path / "y.idx"))
