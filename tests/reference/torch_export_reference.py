"""Reads what `titan convert to-dcp` and `to-torch` write with PyTorch's own readers, for
tests/unit/checkpoint/hf_test.cpp.

REF.safetensors holds the expected tensors (the titan checkpoint's model, in the export dtype). The
script loads DCP_DIR with torch.distributed.checkpoint.load (no process group) into a state dict of
zeros of REF's names, shapes and dtypes, as torchtitan's initial_load_path does with its model's
state dict, and PT_FILE with torch.load(weights_only=True), and prints a JSON report: for each, the
names, the names whose tensor is not bitwise REF's, and (torch.load) whether a tied output.weight
shares tok_embeddings.weight's storage.

usage: torch_export_reference.py REF.safetensors DCP_DIR PT_FILE
"""

import json
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file


def main():
    ref_path, dcp_dir, pt_path = sys.argv[1:4]
    ref = load_file(ref_path)
    report = {}

    state = {name: torch.zeros_like(t) for name, t in ref.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(state, checkpoint_id=dcp_dir, no_dist=True)
    metadata = dcp.FileSystemReader(dcp_dir).read_metadata()
    report["dcp"] = {
        "names": sorted(metadata.state_dict_metadata),
        "differ": sorted(n for n, t in ref.items() if not (state[n].dtype == t.dtype and torch.equal(state[n], t))),
        "dtypes": sorted({str(m.properties.dtype) for m in metadata.state_dict_metadata.values()}),
    }

    loaded = torch.load(pt_path, weights_only=True)
    report["torch"] = {
        "type": type(loaded).__name__,
        "names": sorted(loaded),
        "differ": sorted(n for n, t in ref.items() if n not in loaded or not (
            loaded[n].dtype == t.dtype and loaded[n].shape == t.shape and torch.equal(loaded[n], t))),
        # A tied table (output.weight beside tok_embeddings.weight) loads as one storage.
        "tied": "output.weight" in loaded and "tok_embeddings.weight" in loaded and (
            loaded["output.weight"].untyped_storage().data_ptr()
            == loaded["tok_embeddings.weight"].untyped_storage().data_ptr()),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
