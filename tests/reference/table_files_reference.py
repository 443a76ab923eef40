"""Writers of Parquet, Arrow IPC and Hugging Face datasets folders, for the data tests: each writes the
same documents the test also writes as JSON Lines, with the libraries users write them with (pyarrow,
and Hugging Face `datasets`).

Usage: table_files_reference.py SPEC_JSON_FILE, where the file holds a spec or a list of specs, each
an object {"kind": KIND, "out": PATH, "docs": [text or null, ...], ...}
KIND:
  parquet          pyarrow.parquet.write_table, columns id and text (or "column"), "row_group_size" rows
                   per row group, "type": string | large_string (default string), "compression",
                   "dictionary" (default true), "statistics" (default true: min and max in every page
                   header), "checksums" (page CRCs, default false); prints {"page_offset", "page_bytes"}: where the
                   data pages of the first row group's text column lie in the file
  arrow-stream     pyarrow.ipc.new_stream, "batch_size" rows per record batch, "type": string |
                   large_string | string_view
  arrow-file       pyarrow.ipc.new_file (the IPC file format, magic ARROW1), as arrow-stream
  save-to-disk     datasets.Dataset.from_dict(...).save_to_disk(out, num_shards="num_shards")
  dataset-dict     datasets.DatasetDict of "splits": {name: [docs]} .save_to_disk(out, num_shards="num_shards")
  to-parquet       datasets.Dataset.from_dict(...).to_parquet(out, batch_size="batch_size")
  load-json        datasets.load_dataset("json", data_files="data_files", cache_dir=out): the cache
                   folder of the json builder (.../json/default-*/0.0.0/<hash>/json-train.arrow)
"""
import json
import os
import sys

import pyarrow as pa

os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


def table(docs, column="text", type_name="string"):
    return pa.table({"id": pa.array(range(len(docs)), pa.int64()),
                     column: pa.array(docs, getattr(pa, type_name)())})


def write(spec):
    kind, out = spec["kind"], spec["out"]
    docs = spec.get("docs", [])
    column = spec.get("column", "text")
    if kind == "parquet":
        import pyarrow.parquet as pq
        pq.write_table(table(docs, column, spec.get("type", "string")), out,
                       row_group_size=spec.get("row_group_size", 7),
                       compression=spec.get("compression", "snappy"),
                       use_dictionary=spec.get("dictionary", True),
                       write_statistics=spec.get("statistics", True),
                       write_page_checksum=spec.get("checksums", False))
        chunk = pq.ParquetFile(out).metadata.row_group(0).column(1)
        start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
        end = start + chunk.total_compressed_size  # the dictionary page, then the data page(s)
        print(json.dumps({"page_offset": chunk.data_page_offset, "page_bytes": end - chunk.data_page_offset}))
    elif kind in ("arrow-stream", "arrow-file"):
        t = table(docs, column, spec.get("type", "string"))
        open_writer = pa.ipc.new_stream if kind == "arrow-stream" else pa.ipc.new_file
        with pa.OSFile(out, "wb") as sink, open_writer(sink, t.schema) as writer:
            for batch in t.to_batches(max_chunksize=spec.get("batch_size", 7)):
                writer.write_batch(batch)
    elif kind == "save-to-disk":
        import datasets
        ds = datasets.Dataset.from_dict({"id": list(range(len(docs))), column: docs})
        ds.save_to_disk(out, num_shards=spec.get("num_shards", 1))
    elif kind == "dataset-dict":
        import datasets
        dd = datasets.DatasetDict({name: datasets.Dataset.from_dict({"id": list(range(len(d))), column: d})
                                   for name, d in spec["splits"].items()})
        dd.save_to_disk(out, num_shards=spec.get("num_shards"))
    elif kind == "to-parquet":
        import datasets
        ds = datasets.Dataset.from_dict({"id": list(range(len(docs))), column: docs})
        ds.to_parquet(out, batch_size=spec.get("batch_size", 7))
    elif kind == "load-json":
        os.environ["HF_DATASETS_OFFLINE"] = "1"
        import datasets
        datasets.load_dataset("json", data_files=spec["data_files"], cache_dir=out)
    else:
        raise SystemExit(f"unknown kind {kind}")


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    for one in spec if isinstance(spec, list) else [spec]:
        write(one)


if __name__ == "__main__":
    main()
