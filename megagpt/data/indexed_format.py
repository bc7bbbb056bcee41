"""Megatron's indexed-dataset files (``PREFIX.bin`` + ``PREFIX.idx``), without torch or megatron.

Preprocessing writes them and the data check reads their headers; importing megatron for
that costs seconds of start-up (``megatron.core`` imports torch and its model code). The
layout is megatron's ``IndexedDatasetBuilder`` / ``_IndexWriter``
(``megatron/core/datasets/indexed_dataset.py``):

  .bin  the token ids of every sequence, back to back, in the dataset's dtype
  .idx  b"MMIDIDX\\x00\\x00", version 1 (<Q), dtype code (<B), sequence count (<Q),
        document count (<Q), sequence lengths (int32), sequence byte offsets (int64),
        document indices (int64: the first sequence of each document, then the total)

One sequence per document, as preprocessing writes them. ``tests/test_indexed_format.py``
checks the files are byte-identical to megatron's builder's and that megatron reads them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")
# megatron's DType enum: numpy dtype -> code in the .idx header
DTYPE_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3,
               np.dtype(np.int32): 4, np.dtype(np.int64): 5, np.dtype(np.float64): 6,
               np.dtype(np.float32): 7, np.dtype(np.uint16): 8}
DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: int | None) -> np.dtype:
    """megatron's ``DType.optimal_dtype``: uint16 below 65,500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32)


class IndexedWriter:
    """Writes documents (one sequence each) to ``bin_path``; ``finalize`` writes the index."""

    def __init__(self, bin_path: str, dtype) -> None:
        self.dtype = np.dtype(dtype)
        self.data_file = open(bin_path, "wb")
        self._lengths: list[np.ndarray] = []

    def add_documents(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """``ids``: the documents' ids back to back; ``lengths``: each document's length."""
        self.data_file.write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
        self._lengths.append(np.asarray(lengths, dtype=np.int64))

    def finalize(self, idx_path: str) -> None:
        self.data_file.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        documents = np.arange(len(lengths) + 1, dtype=np.int64)
        with open(idx_path, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, DTYPE_CODES[self.dtype], len(lengths),
                                len(documents)))
            f.write(lengths.astype(np.int32).tobytes())
            f.write(pointers.tobytes())
            f.write(documents.tobytes())

    def close(self) -> None:
        self.data_file.close()


@dataclass(frozen=True)
class IndexFacts:
    """What a .idx says about its dataset."""

    dtype: np.dtype
    sequences: int
    documents: int  # megatron's document-index count: the documents + 1
    bin_bytes: int  # how long the .bin must be

    @property
    def document_count(self) -> int:
        return max(self.documents - 1, 0)


def read_index(idx_path: str) -> IndexFacts:
    """The header of ``idx_path`` and the .bin length it implies; ValueError if not an index."""
    with open(idx_path, "rb") as f:
        header = f.read(HEADER.size)
    if len(header) < HEADER.size:
        raise ValueError("shorter than an index header")
    magic, version, code, sequences, documents = HEADER.unpack(header)
    if magic != MAGIC or version != VERSION or code not in DTYPES_BY_CODE:
        raise ValueError("not megatron's indexed-dataset format")
    dtype = DTYPES_BY_CODE[code]
    bin_bytes = 0
    if sequences:
        last_length = np.fromfile(idx_path, np.int32, 1, offset=HEADER.size + 4 * (sequences - 1))
        last_pointer = np.fromfile(idx_path, np.int64, 1,
                                   offset=HEADER.size + 4 * sequences + 8 * (sequences - 1))
        if len(last_length) != 1 or len(last_pointer) != 1:
            raise ValueError("the index is truncated")
        bin_bytes = int(last_pointer[0]) + int(last_length[0]) * dtype.itemsize
    return IndexFacts(dtype, sequences, documents, bin_bytes)
