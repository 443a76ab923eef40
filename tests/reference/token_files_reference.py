"""Writers of other frameworks' pre-tokenized files, transcribed from their sources, for the data tests.

Megatron-LM (megatron/core/datasets/indexed_dataset.py): IndexedDatasetBuilder appends each sequence's
tokens to PREFIX.bin in the builder's dtype and records its length; end_document() records where the
next document starts; finalize() writes PREFIX.idx through _IndexWriter: the 9-byte header
b"MMIDIDX\\x00\\x00", version 1 as "<Q", the dtype code as "<B", the sequence and document counts as
"<Q", then the lengths (int32), the byte offsets of the sequences (int64, a running sum of length x
itemsize) and the document indices (int64). DType.optimal_dtype picks uint16 below 65,500 tokens of
vocabulary, else int32.

llm.c (dev/data/data_common.py, write_datafile): a header of 256 int32 values (magic, version, token
count, zeros) then the tokens: magic 20240520 version 1 with uint16 tokens for GPT-2, magic 20240801
version 7 with uint32 tokens for Llama 3.

Usage:
  token_files_reference.py megatron PREFIX VOCAB_SIZE DOCS_JSON   # DOCS_JSON: [[sequence, ...], ...]
  token_files_reference.py llmc FILE MODEL TOKENS_JSON             # MODEL: gpt-2 or llama-3
"""
import json
import struct
import sys

import numpy as np

MEGATRON_DTYPE_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5,
                        np.float64: 6, np.float32: 7, np.uint16: 8}


def megatron_optimal_dtype(vocab_size):
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


class MegatronBuilder:
    def __init__(self, bin_path, dtype):
        self.data = open(bin_path, "wb")
        self.dtype = dtype
        self.lengths = []
        self.document_indices = [0]

    def add_item(self, tokens):
        array = np.array(tokens, dtype=self.dtype)
        self.data.write(array.tobytes(order="C"))
        self.lengths.append(array.size)

    def end_document(self):
        self.document_indices.append(len(self.lengths))

    def finalize(self, idx_path):
        self.data.close()
        itemsize = np.dtype(self.dtype).itemsize
        pointers, at = [], 0
        for length in self.lengths:
            pointers.append(at)
            at += length * itemsize
        with open(idx_path, "wb") as f:
            f.write(b"MMIDIDX\x00\x00")
            f.write(struct.pack("<Q", 1))
            f.write(struct.pack("<B", MEGATRON_DTYPE_CODES[self.dtype]))
            f.write(struct.pack("<Q", len(self.lengths)))
            f.write(struct.pack("<Q", len(self.document_indices)))
            f.write(np.array(self.lengths, dtype=np.int32).tobytes(order="C"))
            f.write(np.array(pointers, dtype=np.int64).tobytes(order="C"))
            f.write(np.array(self.document_indices, dtype=np.int64).tobytes(order="C"))


LLMC_HEADERS = {"gpt-2": (20240520, 1, np.uint16), "llama-3": (20240801, 7, np.uint32)}


def llmc_write(filename, tokens, model):
    magic, version, dtype = LLMC_HEADERS[model]
    assert len(tokens) < 2**31
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = magic, version, len(tokens)
    with open(filename, "wb") as f:
        f.write(header.tobytes())
        f.write(np.array(tokens, dtype=dtype).tobytes())


def main():
    kind = sys.argv[1]
    if kind == "megatron":
        prefix, vocab, docs = sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
        builder = MegatronBuilder(prefix + ".bin", megatron_optimal_dtype(vocab))
        for doc in docs:
            for sequence in doc:
                builder.add_item(sequence)
            builder.end_document()
        builder.finalize(prefix + ".idx")
    elif kind == "llmc":
        llmc_write(sys.argv[2], json.loads(sys.argv[4]), sys.argv[3])
    else:
        raise SystemExit("unknown kind " + kind)


if __name__ == "__main__":
    main()
