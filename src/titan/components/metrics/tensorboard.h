// TensorBoard event files written natively: scalar summaries readable by TensorBoard.
//
// File format (TFRecord): each record is
//   uint64 length (little endian) | uint32 masked CRC-32C of those 8 bytes | data | uint32 masked CRC-32C of data
// Each record's data is a serialized tensorflow.Event protobuf, encoded here by hand:
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }
//   Value   { string tag = 1; float simple_value = 2; }
// The first record is an Event with file_version "brain.Event:2"; then one Event per add_scalars call.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace titan::metrics {

using Scalars = std::vector<std::pair<std::string, double>>;  // (tag, value), in writing order

// The serialized Event protobuf of `scalars` at `step` (values are stored as float32, as
// TensorBoard's simple_value is).
std::string encode_scalars_event(double wall_time, int64_t step, const Scalars& scalars);

// The serialized Event protobuf that opens every event file (file_version "brain.Event:2").
std::string encode_file_version_event(double wall_time);

// One TFRecord: the framing of `data` described above.
std::string frame_record(const std::string& data);

// Seconds since the Unix epoch, as Event.wall_time.
double wall_time_now();

// The run folder torchtitan uses: <dump_folder>/<save_tb_folder>/<local time as %Y%m%d-%H%M>,
// with /rank_<rank> appended when every rank saves its own metrics.
std::string tensorboard_run_dir(const std::string& dump_folder, const std::string& save_tb_folder,
                                bool save_for_all_ranks, int rank);

// Writes one event file in a folder. Not thread-safe.
class TensorBoardWriter {
 public:
  // Creates `log_dir` (and parents) and the file events.out.tfevents.<unix time>.<host>.<pid>.<n> in
  // it, starting with the file_version record. Throws UserError when the folder or file cannot be made.
  explicit TensorBoardWriter(const std::string& log_dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // Appends one Event holding `scalars` at `step` and flushes it to the file, so that TensorBoard
  // sees it at once. Throws UserError when the write fails (e.g. the disk is full).
  void add_scalars(int64_t step, const Scalars& scalars, double wall_time = wall_time_now());

  // The event file's path.
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& data);

  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace titan::metrics
