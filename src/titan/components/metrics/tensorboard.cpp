#include "titan/components/metrics/tensorboard.h"

#include "titan/common/error.h"
#include "titan/components/metrics/crc32c.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>

namespace titan::metrics {
namespace {

// Protobuf wire types.
constexpr uint32_t kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7F) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}

void put_key(std::string& out, uint32_t field, uint32_t wire_type) { put_varint(out, (field << 3) | wire_type); }

template <typename T>
void put_little_endian(std::string& out, T bits) {
  for (size_t i = 0; i < sizeof(T); ++i) out += static_cast<char>((bits >> (8 * i)) & 0xFF);
}

void put_double(std::string& out, uint32_t field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  put_key(out, field, kFixed64);
  put_little_endian(out, bits);
}

void put_float(std::string& out, uint32_t field, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  put_key(out, field, kFixed32);
  put_little_endian(out, bits);
}

void put_bytes(std::string& out, uint32_t field, const std::string& bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out += bytes;
}

// Event fields.
constexpr uint32_t kWallTime = 1, kStep = 2, kFileVersion = 3, kSummary = 5;
// Summary and Summary.Value fields.
constexpr uint32_t kSummaryValue = 1, kTag = 1, kSimpleValue = 2;

std::atomic<int> next_file_id{0};

}  // namespace

std::string encode_scalars_event(double wall_time, int64_t step, const Scalars& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    put_bytes(v, kTag, tag);
    put_float(v, kSimpleValue, static_cast<float>(value));
    put_bytes(summary, kSummaryValue, v);
  }
  std::string event;
  put_double(event, kWallTime, wall_time);
  put_key(event, kStep, kVarint);
  put_varint(event, static_cast<uint64_t>(step));  // int64: negatives take 10 bytes, as protobuf does
  put_bytes(event, kSummary, summary);
  return event;
}

std::string encode_file_version_event(double wall_time) {
  std::string event;
  put_double(event, kWallTime, wall_time);
  put_bytes(event, kFileVersion, "brain.Event:2");
  return event;
}

std::string frame_record(const std::string& data) {
  std::string header;
  put_little_endian(header, static_cast<uint64_t>(data.size()));
  std::string record = header;
  put_little_endian(record, masked_crc32c(header));
  record += data;
  put_little_endian(record, masked_crc32c(data));
  return record;
}

double wall_time_now() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

std::string tensorboard_run_dir(const std::string& dump_folder, const std::string& save_tb_folder,
                                bool save_for_all_ranks, int rank) {
  std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y%m%d-%H%M", &local);
  std::filesystem::path dir = std::filesystem::path(dump_folder) / save_tb_folder / stamp;
  if (save_for_all_ranks) dir /= "rank_" + std::to_string(rank);
  return dir.string();
}

TensorBoardWriter::TensorBoardWriter(const std::string& log_dir) {
  std::error_code ec;
  std::filesystem::create_directories(log_dir, ec);
  TITAN_USER_CHECK(!ec, "cannot create the TensorBoard folder '", log_dir, "': ", ec.message(),
                   ". Check metrics.save_tb_folder and job.dump_folder, or set metrics.enable_tensorboard = false.");
  char host[256] = "localhost";
  if (gethostname(host, sizeof(host)) != 0) std::strcpy(host, "localhost");
  host[sizeof(host) - 1] = '\0';
  char name[512];
  std::snprintf(name, sizeof(name), "events.out.tfevents.%010lld.%s.%d.%d", static_cast<long long>(std::time(nullptr)),
                host, static_cast<int>(getpid()), next_file_id++);
  path_ = (std::filesystem::path(log_dir) / name).string();
  file_ = std::fopen(path_.c_str(), "wb");
  TITAN_USER_CHECK(file_ != nullptr, "cannot create the TensorBoard event file '", path_, "': ", std::strerror(errno),
                   ". Check that the folder is writable, or set metrics.enable_tensorboard = false.");
  write_record(encode_file_version_event(wall_time_now()));
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void TensorBoardWriter::add_scalars(int64_t step, const Scalars& scalars, double wall_time) {
  write_record(encode_scalars_event(wall_time, step, scalars));
}

void TensorBoardWriter::write_record(const std::string& data) {
  const std::string record = frame_record(data);
  const bool ok = std::fwrite(record.data(), 1, record.size(), file_) == record.size() && std::fflush(file_) == 0;
  TITAN_USER_CHECK(ok, "cannot write the TensorBoard event file '", path_, "': ", std::strerror(errno),
                   ". Check free disk space, or set metrics.enable_tensorboard = false.");
}

}  // namespace titan::metrics
