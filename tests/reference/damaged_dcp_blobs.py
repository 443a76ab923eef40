"""Writes a torch.distributed.checkpoint folder whose torch.save blobs are damaged in ways LibTorch's
reader does not check (the folder's metadata is sound):

    python damaged_dcp_blobs.py OUT_DIR

- norm.weight: a 16-element tensor whose storage record holds only 6 elements (24 bytes): the pickle's
  storage reference asks for 16, LibTorch would size the storage by it and read past the record.
- train_state.step: a list that holds itself (LibTorch builds the cycle; walking it never ends).
"""
import io
import os
import pickle
import sys
import zipfile

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)


def saved(obj):
    b = io.BytesIO()
    torch.save(obj, b)
    return b.getvalue()


def short_storage_blob():
    sixteen = zipfile.ZipFile(io.BytesIO(saved(torch.arange(16.0))))
    six = zipfile.ZipFile(io.BytesIO(saved(torch.arange(6.0))))
    six_root = six.namelist()[0].split("/")[0]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name in sixteen.namelist():
            root, rest = name.split("/", 1)
            z.writestr(name, six.read(six_root + "/" + rest) if rest == "data/0" else sixteen.read(name))
    return out.getvalue()


def write_folder(out, blobs, tensors):
    """blobs: [(key, bytes)] stored back to back; tensors: {key: size} of those that are tensors."""
    os.makedirs(out, exist_ok=True)
    storage, state, at = {}, {}, 0
    for key, blob in blobs:
        if key in tensors:
            size = tensors[key]
            chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=torch.Size(size))
            state[key] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size(size),
                                               chunks=[chunk])
            storage[MetadataIndex(key, torch.Size([0] * len(size)))] = _StorageInfo("__0_0.distcp", at, len(blob))
        else:
            state[key] = BytesStorageMetadata()
            storage[MetadataIndex(key)] = _StorageInfo("__0_0.distcp", at, len(blob))
        at += len(blob)
    with open(os.path.join(out, "__0_0.distcp"), "wb") as f:
        f.write(b"".join(blob for _, blob in blobs))
    with open(os.path.join(out, ".metadata"), "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=state, storage_data=storage), f)


def main(out):
    loop = []
    loop.append(loop)
    write_folder(out, [("norm.weight", short_storage_blob()), ("train_state.step", saved(loop))], {"norm.weight": [16]})


if __name__ == "__main__":
    main(sys.argv[1])
