#include "titan/components/checkpoint/file_io.h"

#include "titan/common/error.h"
#include "titan/common/json_integer.h"
#include "titan/common/fault_injection.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <zlib.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace titan::checkpoint {
namespace {

std::string why() { return std::strerror(errno); }

uint32_t crc_update(uint32_t crc, const void* data, uint64_t n) {
  return static_cast<uint32_t>(crc32_z(crc, static_cast<const Bytef*>(data), static_cast<z_size_t>(n)));
}

class OutFile {
 public:
  explicit OutFile(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    TITAN_USER_CHECK(fd_ >= 0, "cannot create ", path, ": ", why(), " (check that the folder is writable)");
  }
  ~OutFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  void write(const void* data, uint64_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, std::min<uint64_t>(n, 1u << 30));
      if (w < 0 && errno == EINTR) continue;
      TITAN_USER_CHECK(w > 0, "writing ", path_, " failed: ", why(), " (disk full?)");
      p += w;
      n -= static_cast<uint64_t>(w);
    }
  }
  void sync_and_close() {
    TITAN_USER_CHECK(::fsync(fd_) == 0, "fsync of ", path_, " failed: ", why());
    TITAN_USER_CHECK(::close(fd_) == 0, "closing ", path_, " failed: ", why());
    fd_ = -1;
  }

 private:
  std::string path_;
  int fd_ = -1;
};

void rename_or_throw(const std::string& from, const std::string& to) {
  TITAN_USER_CHECK(std::rename(from.c_str(), to.c_str()) == 0, "cannot rename ", from, " to ", to, ": ", why());
}

}  // namespace

namespace {
thread_local int64_t t_saving_step = -1;
}

SavingStep::SavingStep(int64_t step) : previous_(t_saving_step) { t_saving_step = step; }
SavingStep::~SavingStep() { t_saving_step = previous_; }

void crash_point(const char* phase) { fault::point((std::string("checkpoint_") + phase).c_str(), t_saving_step); }

uint32_t tensor_crc32(const at::Tensor& t) {
  TITAN_ASSERT(t.is_contiguous() && t.device().is_cpu());
  return crc_update(crc32_z(0, nullptr, 0), t.data_ptr(), static_cast<uint64_t>(t.numel() * t.element_size()));
}

WrittenFile write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                              const std::map<std::string, std::string>& metadata, const WriteOptions& options) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& e : entries) {
    TITAN_ASSERT(e.data.is_contiguous(), e.name);
    const uint64_t nbytes = static_cast<uint64_t>(e.data.numel()) * c10::elementSize(e.stored_dtype());
    header[e.name] = {{"dtype", dtype_name(e.stored_dtype())},
                      {"shape", e.data.sizes().vec()},
                      {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  const uint64_t header_len = json.size();

  WrittenFile out;
  const std::string tmp = path + ".tmp";
  OutFile f(tmp);
  uint32_t crc = crc32_z(0, nullptr, 0);
  f.write(&header_len, 8);
  crc = crc_update(crc, &header_len, 8);
  f.write(json.data(), json.size());
  crc = crc_update(crc, json.data(), json.size());
  at::Tensor host;  // the bounded buffer that tensors off the CPU (or cast) are streamed through
  for (const auto& e : entries) {
    const at::ScalarType dtype = e.stored_dtype();
    const int64_t esize = static_cast<int64_t>(c10::elementSize(dtype));
    const uint64_t nbytes = static_cast<uint64_t>(e.data.numel() * esize);
    if (&e == &entries[entries.size() / 2]) crash_point("data");
    uint32_t c = crc32_z(0, nullptr, 0);
    if (e.data.device().is_cpu() && dtype == e.data.scalar_type() && !options.stream_cpu) {
      c = tensor_crc32(e.data);
      f.write(e.data.data_ptr(), nbytes);
    } else {
      const at::Tensor flat = e.data.reshape({-1});
      const int64_t per = std::max<int64_t>(1, std::min<int64_t>(options.host_buffer_bytes / esize, flat.numel()));
      if (!host.defined() || host.numel() < per * esize)
        host = at::empty({per * esize}, at::TensorOptions().dtype(at::kByte).pinned_memory(e.data.is_cuda()));
      for (int64_t off = 0; off < flat.numel(); off += per) {
        const int64_t n = std::min(per, flat.numel() - off);
        at::Tensor part = host.narrow(0, 0, n * esize).view(dtype);
        part.copy_(flat.narrow(0, off, n));  // synchronous (and cast): the buffer is reused right after
        c = crc_update(c, part.data_ptr(), static_cast<uint64_t>(n * esize));
        f.write(part.data_ptr(), static_cast<uint64_t>(n * esize));
      }
    }
    crc = static_cast<uint32_t>(crc32_combine(crc, c, static_cast<z_off_t>(nbytes)));
    out.entry_crc32.push_back(c);
  }
  f.sync_and_close();
  rename_or_throw(tmp, path);
  out.bytes = static_cast<int64_t>(8 + header_len + offset);
  out.crc32 = crc;
  return out;
}

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  TITAN_USER_CHECK(fd_ >= 0, "cannot open ", path_, ": ", why());
  // A corrupt file throws below, and a constructor that throws runs no destructor: close it here.
  struct CloseOnThrow {
    int& fd;
    bool armed = true;
    ~CloseOnThrow() {
      if (armed) ::close(std::exchange(fd, -1));
    }
  } close_on_throw{fd_};
  struct stat st {};
  ::fstat(fd_, &st);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  uint64_t header_len = 0;
  TITAN_USER_CHECK(size >= 8 && ::pread(fd_, &header_len, 8, 0) == 8, path_,
                   " is truncated or not a safetensors file (shorter than its 8-byte header length)");
  TITAN_USER_CHECK(header_len <= size - 8 && header_len < (1ull << 31), path_,
                   " is truncated or corrupt: its header length ", header_len, " exceeds the file size ", size);
  std::string json(header_len, '\0');
  TITAN_USER_CHECK(::pread(fd_, json.data(), header_len, 8) == static_cast<ssize_t>(header_len), path_,
                   ": reading the header failed: ", why());
  try {
    const nlohmann::json header = nlohmann::json::parse(json);
    for (const auto& [name, e] : header.items()) {
      if (name == "__metadata__") {
        for (const auto& [k, v] : e.items()) metadata_[k] = v.is_string() ? v.get<std::string>() : v.dump();
        continue;
      }
      Entry entry;
      entry.dtype = dtype_from_name(e.at("dtype").get<std::string>());
      entry.shape = json_integers<int64_t>(e.at("shape"));
      const auto off = json_integers<uint64_t>(e.at("data_offsets"));
      TITAN_USER_CHECK(off.size() == 2 && off[0] <= off[1] && off[1] <= size - 8 - header_len, path_, ": tensor '",
                       name, "' lies outside the file: the file is truncated or corrupt");
      // The shape and dtype must account for exactly the bytes the offsets give (checked here, before
      // read() allocates the tensor: a corrupt shape must not ask for terabytes).
      uint64_t nbytes = c10::elementSize(entry.dtype);
      for (int64_t d : entry.shape) {
        TITAN_USER_CHECK(d >= 0 && !__builtin_mul_overflow(nbytes, static_cast<uint64_t>(d), &nbytes), path_,
                         ": tensor '", name, "' has an invalid shape: the file is corrupt");
      }
      TITAN_USER_CHECK(off[1] - off[0] == nbytes, path_, ": tensor '", name, "' holds ", off[1] - off[0],
                       " bytes but its shape and dtype need ", nbytes, ": the file is corrupt");
      entry.begin = 8 + header_len + off[0];
      entry.end = 8 + header_len + off[1];
      entries_.emplace(name, std::move(entry));
    }
  } catch (const nlohmann::json::exception& e) {
    throw UserError(path_ + " is corrupt: its safetensors header is not valid JSON (" + e.what() + ")");
  }
  close_on_throw.armed = false;
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::map<std::string, TensorMeta> SafetensorsFile::tensors() const {
  std::map<std::string, TensorMeta> out;
  for (const auto& [name, e] : entries_) out[name] = {e.dtype, e.shape};
  return out;
}

at::Tensor SafetensorsFile::read(const std::string& name) {
  auto it = entries_.find(name);
  TITAN_USER_CHECK(it != entries_.end(), path_, " has no tensor '", name, "'");
  const Entry& e = it->second;
  at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype));
  const uint64_t nbytes = static_cast<uint64_t>(t.numel() * t.element_size());
  TITAN_USER_CHECK(e.end - e.begin == nbytes, path_, ": tensor '", name, "' holds ", e.end - e.begin,
                   " bytes but its shape and dtype need ", nbytes, ": the file is corrupt");
  char* p = static_cast<char*>(t.data_ptr());
  uint64_t done = 0;
  while (done < nbytes) {
    const ssize_t r = ::pread(fd_, p + done, std::min<uint64_t>(nbytes - done, 1u << 30), static_cast<off_t>(e.begin + done));
    if (r < 0 && errno == EINTR) continue;
    TITAN_USER_CHECK(r > 0, path_, ": reading tensor '", name, "' failed: ", r == 0 ? "unexpected end of file" : why());
    done += static_cast<uint64_t>(r);
  }
  return t;
}

uint32_t string_crc32(const std::string& text) {
  return crc_update(crc32_z(0, nullptr, 0), text.data(), text.size());
}

uint32_t file_crc32(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TITAN_USER_CHECK(in.good(), "cannot open ", path);
  std::vector<char> buf(16 << 20);
  uint32_t crc = crc32_z(0, nullptr, 0);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    crc = crc_update(crc, buf.data(), static_cast<uint64_t>(in.gcount()));
  }
  return crc;
}

void write_file_atomically(const std::string& path, const std::string& contents) {
  const std::string tmp = path + ".tmp";
  OutFile f(tmp);
  f.write(contents.data(), contents.size());
  f.sync_and_close();
  rename_or_throw(tmp, path);
}

void replace_directory(const std::string& from, const std::string& to) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string parent = fs::path(to).parent_path().string();
  if (!fs::exists(to)) {
    fs::rename(from, to, ec);
    TITAN_USER_CHECK(!ec, "cannot rename ", from, " to ", to, ": ", ec.message());
  } else {
    const std::string old = to + ".old";
    fs::remove_all(old, ec);
    fs::rename(to, old, ec);
    TITAN_USER_CHECK(!ec, "cannot move aside the existing ", to, ": ", ec.message());
    fs::rename(from, to, ec);
    TITAN_USER_CHECK(!ec, "cannot rename ", from, " to ", to, ": ", ec.message());
    sync_directory(parent);
    fs::remove_all(old, ec);
  }
  sync_directory(parent);
}

std::string recover_directory(const std::string& from, const std::string& to,
                              const std::function<bool(const std::string&)>& complete) {
  namespace fs = std::filesystem;
  const std::string old = to + ".old";
  std::error_code ec;
  if (fs::exists(to, ec) || !fs::exists(old, ec)) return "";
  if (fs::exists(from, ec) && complete(from)) {
    fs::rename(from, to, ec);
    if (ec) return "could not complete the interrupted replacement of " + to + " (" + ec.message() + "); " + from +
                   " and " + old + " are left as they are";
    fs::remove_all(old, ec);
    return "completed the interrupted replacement of " + to;
  }
  fs::rename(old, to, ec);
  if (ec) return "could not restore " + to + " from " + old + " (" + ec.message() + "); it is left as it is";
  return "restored " + to + " (its replacement did not complete)";
}

void sync_directory(const std::string& given) {
  const std::string path = given.empty() ? "." : given;  // the parent of a bare relative name
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TITAN_USER_CHECK(fd >= 0, "cannot open folder ", path, ": ", why());
  ::fsync(fd);  // some file systems do not sync folders; the rename is then as durable as they allow
  ::close(fd);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TITAN_USER_CHECK(in.good(), "cannot read ", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace titan::checkpoint
