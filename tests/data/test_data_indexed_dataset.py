"""The .idx/.bin reader and writer: a golden byte vector of Megatron's builder, every dtype, and every corruption."""

from __future__ import annotations

import os
import pickle
import struct

import numpy as np
import pytest

from mcore.data.errors import DataError
from mcore.data.indexed_dataset import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetBuilder,
    bin_path,
    code_from_dtype,
    idx_path,
    optimal_dtype,
)

GOLDEN_IDX = bytes.fromhex(
    "4d4d4944494458" "0000"
    "0100000000000000"
    "08"
    "0400000000000000"
    "0500000000000000"
    "04000000" "02000000" "02000000" "04000000"
    "0000000000000000" "0800000000000000" "0c00000000000000" "1000000000000000"
    "0000000000000000" "0100000000000000" "0300000000000000" "0300000000000000" "0400000000000000"
)  # fmt: skip
GOLDEN_BIN = bytes.fromhex("0a000b000c0050c414001500160050c41e001f00200050c4")


def write_golden(prefix: str) -> str:
    """The Megatron builder calls that produced the golden bytes."""
    builder = IndexedDatasetBuilder(bin_path(prefix), dtype=optimal_dtype(50257))
    builder.add_document([10, 11, 12, 50256], [4])
    builder.add_item([20, 21])
    builder.add_item([22, 50256])
    builder.end_document()
    builder.add_document([], [])
    builder.add_document([30, 31, 32, 50256], [4])
    builder.finalize(idx_path(prefix))
    return prefix


def test_golden_bytes(tmp_path):
    prefix = write_golden(str(tmp_path / "g"))
    assert open(idx_path(prefix), "rb").read() == GOLDEN_IDX
    assert open(bin_path(prefix), "rb").read() == GOLDEN_BIN
    assert sorted(os.listdir(tmp_path)) == ["g.bin", "g.idx"]  # no temporaries left
    ds = IndexedDataset(prefix)
    assert len(ds) == 4
    assert ds.sequence_lengths.tolist() == [4, 2, 2, 4]
    assert ds.document_indices.tolist() == [0, 1, 3, 3, 4]
    assert ds.sequence_pointers.tolist() == [0, 8, 12, 16]
    assert ds.dtype == np.uint16
    assert ds[1].tolist() == [20, 21]
    assert ds.get(0, offset=1, length=2).tolist() == [11, 12]
    assert [a.tolist() for a in ds[2:4]] == [[22, 50256], [30, 31, 32, 50256]]


def test_golden_merge_twice(tmp_path):
    prefix = write_golden(str(tmp_path / "g"))
    builder = IndexedDatasetBuilder(bin_path(str(tmp_path / "m")), dtype=np.uint16)
    builder.add_index(prefix)
    builder.add_index(prefix)
    builder.finalize(idx_path(str(tmp_path / "m")))
    merged = IndexedDataset(str(tmp_path / "m"))
    assert merged.document_indices.tolist() == [0, 1, 3, 3, 4, 5, 7, 7, 8]
    assert merged.sequence_pointers.tolist() == [0, 8, 12, 16, 24, 32, 36, 40]
    assert open(bin_path(str(tmp_path / "m")), "rb").read() == GOLDEN_BIN * 2


def test_optimal_dtype():
    assert optimal_dtype(50257) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(None) == np.int32
    assert optimal_dtype(128256) == np.int32


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
@pytest.mark.parametrize("mmap", [True, False])
def test_roundtrip_every_dtype(tmp_path, code, mmap):
    dtype = DTYPE_CODES[code]
    rng = np.random.default_rng(code)
    docs = [
        [rng.integers(0, 100, size=int(n)).astype(dtype) for n in rng.integers(0, 9, size=3)]
        for _ in range(7)
    ]
    prefix = str(tmp_path / f"d{code}")
    with IndexedDatasetBuilder(bin_path(prefix), dtype=dtype) as builder:
        for doc in docs:
            for seq in doc:
                builder.add_item(seq)
            builder.end_document()
        builder.finalize(idx_path(prefix))
    assert open(idx_path(prefix), "rb").read()[17] == code
    ds = IndexedDataset(prefix, mmap=mmap)
    flat = [seq for doc in docs for seq in doc]
    assert len(ds) == len(flat) and ds.dtype == dtype
    for i, seq in enumerate(flat):
        np.testing.assert_array_equal(ds[i], seq)
    assert ds.document_indices.tolist() == np.cumsum([0] + [len(d) for d in docs]).tolist()
    again = pickle.loads(pickle.dumps(ds))  # DataLoader workers that spawn reopen the files
    np.testing.assert_array_equal(again[len(flat) - 1], flat[-1])


def test_code_from_dtype_rejects_unknown():
    assert code_from_dtype(np.uint16) == 8 and code_from_dtype(">i4") == 4
    with pytest.raises(ValueError, match="no Megatron dtype code"):
        code_from_dtype(np.uint32)


def test_builder_rejects_ids_that_do_not_fit(tmp_path):
    with IndexedDatasetBuilder(bin_path(str(tmp_path / "x")), dtype=np.uint16) as builder:
        with pytest.raises(ValueError, match="70000 does not fit"):
            builder.add_item([1, 70000])
        with pytest.raises(ValueError, match="-1 does not fit"):
            builder.add_document([-1, 3], [2])
        builder.abort()
    assert os.listdir(tmp_path) == []


def test_interrupted_builder_leaves_nothing(tmp_path):
    prefix = str(tmp_path / "x")
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(bin_path(prefix), dtype=np.int32) as builder:
            builder.add_item([1, 2, 3])
            raise RuntimeError("killed")
    assert os.listdir(tmp_path) == []


def test_finalize_replaces_an_existing_pair(tmp_path):
    prefix = write_golden(str(tmp_path / "g"))
    with IndexedDatasetBuilder(bin_path(prefix), dtype=np.uint16) as builder:
        builder.add_document([7, 8, 9], [3])
        builder.finalize(idx_path(prefix))
    ds = IndexedDataset(prefix)
    assert len(ds) == 1 and ds[0].tolist() == [7, 8, 9]
    assert sorted(os.listdir(tmp_path)) == ["g.bin", "g.idx"]


def test_merge_with_different_dtype_is_an_error(tmp_path):
    prefix = write_golden(str(tmp_path / "g"))
    with IndexedDatasetBuilder(bin_path(str(tmp_path / "m")), dtype=np.int32) as builder:
        with pytest.raises(DataError, match=r"g\.idx: token dtype uint16 differs from the output's int32"):
            builder.add_index(prefix)
        builder.abort()


# ---- bad input: each error names the file and, where it applies, the byte offset -------------------


def _corrupt(prefix: str, offset: int, data: bytes) -> None:
    with open(idx_path(prefix), "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.fixture
def golden(tmp_path) -> str:
    return write_golden(str(tmp_path / "g"))


def test_missing_data_path(tmp_path):
    with pytest.raises(DataError, match=r"missing data path .*nope.*no such file .*nope\.idx"):
        IndexedDataset(str(tmp_path / "nope"))


def test_missing_bin(golden):
    os.remove(bin_path(golden))
    with pytest.raises(DataError, match=r"no such file .*g\.bin"):
        IndexedDataset(golden)


def test_wrong_magic(golden):
    _corrupt(golden, 0, b"NOTMEGA!!")
    with pytest.raises(DataError, match=r"g\.idx: not a Megatron index file: bytes 0-8"):
        IndexedDataset(golden)


def test_wrong_version(golden):
    _corrupt(golden, 9, struct.pack("<Q", 2))
    with pytest.raises(DataError, match=r"g\.idx: index version 2 at byte offset 9"):
        IndexedDataset(golden)


def test_unknown_dtype_code(golden):
    _corrupt(golden, 17, bytes([9]))
    with pytest.raises(DataError, match=r"g\.idx: unknown dtype code 9 at byte offset 17"):
        IndexedDataset(golden)


@pytest.mark.parametrize("size", [0, 20, 33])
def test_truncated_header(golden, size):
    with open(idx_path(golden), "r+b") as f:
        f.truncate(size)
    with pytest.raises(
        DataError, match=rf"g\.idx: truncated index file: {size} bytes, the header alone is 34"
    ):
        IndexedDataset(golden)


def test_truncated_arrays(golden):
    with open(idx_path(golden), "r+b") as f:
        f.truncate(100)
    with pytest.raises(
        DataError, match=r"g\.idx: truncated index file: .* 4 sequences and 5 .* need 122 bytes, .* has 100"
    ):
        IndexedDataset(golden)


def test_corrupted_sequence_count(golden):
    _corrupt(golden, 18, struct.pack("<Q", 1 << 40))
    with pytest.raises(DataError, match=r"g\.idx: truncated index file"):
        IndexedDataset(golden)


def test_corrupted_lengths(golden):
    _corrupt(golden, 34 + 4, struct.pack("<i", -2))
    with pytest.raises(DataError, match=r"sequence_lengths\[1\] = -2 at byte offset 38"):
        IndexedDataset(golden)


def test_corrupted_pointers(golden):
    _corrupt(golden, 34 + 16 + 16, struct.pack("<q", 13))
    with pytest.raises(
        DataError, match=r"g\.idx: corrupted index: sequence_pointers\[2\] = 13 at byte offset 66"
    ):
        IndexedDataset(golden)


def test_corrupted_document_indices(golden):
    _corrupt(golden, 34 + 48 + 16, struct.pack("<q", 0))
    with pytest.raises(DataError, match=r"document_indices\[2\] = 0 at byte offset 98 is smaller"):
        IndexedDataset(golden)
    _corrupt(golden, 34 + 48 + 16, struct.pack("<q", 3))
    _corrupt(golden, 34 + 48 + 32, struct.pack("<q", 3))
    with pytest.raises(
        DataError, match=r"last document index 3 at byte offset 114 must equal the sequence count 4"
    ):
        IndexedDataset(golden)


def test_bin_shorter_than_index(golden):
    with open(bin_path(golden), "r+b") as f:
        f.truncate(14)
    with pytest.raises(
        DataError,
        match=r"g\.bin: the \.bin is shorter than its index says: it has 14 bytes, .* needs 24; sequence 2 \(byte offset 12\)",
    ):
        IndexedDataset(golden)


def test_bin_longer_than_index(golden):
    with open(bin_path(golden), "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(
        DataError, match=r"g\.bin: the \.bin is longer than its index says: .* from offset 24"
    ):
        IndexedDataset(golden)


def test_trailing_idx_bytes_are_ignored(golden):
    with open(idx_path(golden), "ab") as f:
        f.write(b"\0" * 4)  # e.g. sequence_modes of a multimodal file read as text
    assert IndexedDataset(golden).document_indices.tolist() == [0, 1, 3, 3, 4]


def test_fingerprint_changes_when_data_changes(golden):
    before = IndexedDataset(golden).fingerprint()
    assert set(before) == {"idx_size", "idx_mtime_ns", "idx_md5", "bin_size", "bin_mtime_ns"}
    with IndexedDatasetBuilder(bin_path(golden), dtype=np.uint16) as builder:
        builder.add_document([1, 2, 3, 4], [4])
        builder.add_document([5, 6, 7, 8], [2, 2])
        builder.add_document([], [])
        builder.finalize(idx_path(golden))
    after = IndexedDataset(golden).fingerprint()
    assert after["idx_md5"] != before["idx_md5"]
