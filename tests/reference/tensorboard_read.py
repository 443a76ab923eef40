"""Reads TensorBoard event files with TensorBoard's own readers (used by
tests/unit/metrics/tensorboard_test.cpp).

usage: tensorboard_read.py LOG_DIR
Prints JSON:
  {"files": [names of the event files],
   "records": number of records that passed TensorBoard's CRC checks (strict record reader),
   "crc_error": the reader's error message or null,
   "first_file_version": file_version of the first event,
   "scalars": {tag: [[step, value], ...]}   (EventAccumulator, all events kept)}
"""

import json
import os
import sys

from tensorboard.backend.event_processing import event_accumulator
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub import errors, pywrap_tensorflow


def strict_records(path):
    """All records of `path`, stopping at the first CRC or truncation error (returned too)."""
    reader = pywrap_tensorflow.PyRecordReader_New(path.encode() if isinstance(path, str) else path)
    records = []
    while True:
        try:
            reader.GetNext()
        except errors.OutOfRangeError:
            return records, None
        except errors.DataLossError as e:
            return records, str(e)
        records.append(reader.record())


def main():
    log_dir = sys.argv[1]
    files = sorted(f for f in os.listdir(log_dir) if "tfevents" in f)
    records, crc_error = [], None
    for name in files:
        recs, err = strict_records(os.path.join(log_dir, name))
        records += recs
        crc_error = crc_error or err
    first = event_pb2.Event.FromString(records[0]) if records else None

    acc = event_accumulator.EventAccumulator(log_dir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    scalars = {tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    print(json.dumps({
        "files": files,
        "records": len(records),
        "crc_error": crc_error,
        "first_file_version": first.file_version if first else None,
        "scalars": scalars,
    }))


if __name__ == "__main__":
    main()
