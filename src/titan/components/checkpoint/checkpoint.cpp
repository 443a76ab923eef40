#include "titan/components/checkpoint/checkpoint.h"

#include "titan/common/error.h"
#include "titan/common/json_integer.h"
#include "titan/components/checkpoint/file_io.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <regex>

namespace titan::checkpoint {
namespace fs = std::filesystem;

namespace {

class SingleProcess : public Coordinator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::vector<std::string> gather_to_rank0(const std::string&, const std::string& mine) override { return {mine}; }
};

std::string rank_file_name(int rank) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "rank-%05d.safetensors", rank);
  return buf;
}

uint32_t info_state_crc32(const nlohmann::json& info, const nlohmann::json& state) {
  return string_crc32(info.dump() + "\n" + state.dump());
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Every file and tensor entry of an index, checked when the folder is opened: a damaged index.json is
// then a UserError naming the entry, not a failure (or an out-of-range access) in the middle of a load.
// JSON type errors are left to the caller, which reports them as a corrupt index.
void check_index(const nlohmann::json& index, const std::string& path) {
  auto corrupt = [&](const std::string& what) {
    throw UserError(path + " is corrupt: " + what + "; load another step with --checkpoint.load_step");
  };
  for (const char* key : {"files", "tensors"})
    if (!index.at(key).is_object()) corrupt(std::string("\"") + key + "\" is not an object");
  for (const auto& [name, f] : index.at("files").items()) {
    if (json_integer<int64_t>(f.at("bytes")) < 0) corrupt("file " + name + " has a negative size");
    (void)json_integer<uint32_t>(f.at("crc32"));
  }
  for (const auto& [name, t] : index.at("tensors").items()) {
    (void)dtype_from_name(t.at("dtype").get<std::string>());
    const auto shape = json_integers<int64_t>(t.at("shape"));
    for (int64_t d : shape)
      if (d < 0) corrupt("tensor '" + name + "' has shape " + shape_str(shape));
    if (!t.at("slices").is_array()) corrupt("the slices of tensor '" + name + "' are not a list");
    for (const auto& slice : t.at("slices")) {
      (void)slice.at("file").get<std::string>();
      (void)json_integer<uint32_t>(slice.at("crc32"));
      const auto begin = json_integers<int64_t>(slice.at("begin"));
      const auto length = json_integers<int64_t>(slice.at("length"));
      bool inside = begin.size() == shape.size() && length.size() == shape.size();
      for (size_t d = 0; inside && d < shape.size(); ++d)
        inside = begin[d] >= 0 && length[d] >= 0 && begin[d] <= shape[d] - length[d];
      if (!inside)
        corrupt("a slice of tensor '" + name + "' (begin " + shape_str(begin) + ", length " + shape_str(length) +
                ") lies outside its shape " + shape_str(shape));
    }
  }
}

}  // namespace

std::unique_ptr<Coordinator> single_process_coordinator() { return std::make_unique<SingleProcess>(); }

// ---------------------------------------------------------------------------------------------
// Writing

Snapshot take_snapshot(const std::vector<dist::PlacedTensor>& tensors, const SnapshotOptions& o) {
  at::NoGradGuard no_grad;
  std::map<std::string, at::Tensor> buffers;
  if (o.reuse)
    for (auto& s : o.reuse->slices) buffers[s.name] = s.data;
  Snapshot snap;
  for (const auto& t : tensors) {
    const dist::Placement& p = t.placement;
    if (!p.primary || p.real_numel() == 0) continue;
    at::Tensor real = p.real_part(t.local.detach());
    at::ScalarType dtype = real.scalar_type();
    if (o.cast_floats_to && at::isFloatingType(dtype)) dtype = *o.cast_floats_to;
    Snapshot::Slice s;
    s.name = t.name;
    s.global_shape = p.global_shape;
    s.begin = p.global_begin();
    if (!o.copy && real.device().is_cpu() && real.is_contiguous() && real.scalar_type() == dtype) {
      s.data = real;  // FSDP's real part is a leading run of rows: contiguous
      snap.slices.push_back(std::move(s));
      continue;
    }
    auto it = buffers.find(t.name);
    if (it != buffers.end() && it->second.sizes() == real.sizes() && it->second.scalar_type() == dtype) {
      s.data = it->second;
    } else {
      s.data = at::empty(real.sizes(), at::TensorOptions().dtype(dtype).pinned_memory(o.pin));
    }
    s.data.copy_(real);
    snap.slices.push_back(std::move(s));
  }
  return snap;
}

namespace {

// Writes `slices` as the safetensors file `name` in `dir` (its metadata says where each slice sits in
// its tensor) and returns the file's record for the index: {file, bytes, crc32, slices: [...]}.
nlohmann::json write_slices(const fs::path& dir, const std::string& name, const std::vector<Snapshot::Slice>& slices) {
  std::vector<SafetensorsEntry> entries;
  nlohmann::json where = nlohmann::json::object();
  for (const auto& s : slices) {
    entries.push_back({s.name, s.data});
    where[s.name] = {{"global_shape", s.global_shape}, {"begin", s.begin}};
  }
  const WrittenFile written =
      write_safetensors((dir / name).string(), entries, {{"format", "pt"}, {"titan_slices", where.dump()}});
  nlohmann::json records = nlohmann::json::array();
  for (size_t i = 0; i < slices.size(); ++i) {
    const auto& s = slices[i];
    records.push_back({{"name", s.name},
                       {"dtype", dtype_name(s.data.scalar_type())},
                       {"global_shape", s.global_shape},
                       {"begin", s.begin},
                       {"length", s.data.sizes().vec()},
                       {"crc32", written.entry_crc32[i]}});
  }
  return {{"file", name}, {"bytes", written.bytes}, {"crc32", written.crc32}, {"slices", records}};
}

// Rank 0, once every file is written: the index (from every rank's file records) is written last,
// then the folder becomes visible as `step_dir`.
void write_index(const fs::path& tmp_dir, const fs::path& step_dir, const std::vector<nlohmann::json>& file_records,
                 const nlohmann::json& info, const nlohmann::json& state_in) {
  nlohmann::json tensors = nlohmann::json::object(), files = nlohmann::json::object();
  for (const auto& r : file_records) {
    files[r.at("file").get<std::string>()] = {{"bytes", r.at("bytes")}, {"crc32", r.at("crc32")}};
    for (const auto& s : r.at("slices")) {
      const std::string name = s.at("name");
      auto& t = tensors[name];
      if (t.is_null()) t = {{"dtype", s.at("dtype")}, {"shape", s.at("global_shape")}, {"slices", nlohmann::json::array()}};
      TITAN_ASSERT(t.at("dtype") == s.at("dtype") && t.at("shape") == s.at("global_shape"), "ranks disagree on ", name);
      t.at("slices").push_back(
          {{"file", r.at("file")}, {"begin", s.at("begin")}, {"length", s.at("length")}, {"crc32", s.at("crc32")}});
    }
  }
  // Every tensor must be covered exactly once (slices of distinct ranks never overlap).
  for (auto& [name, t] : tensors.items()) {
    int64_t covered = 0;
    for (const auto& s : t.at("slices")) covered += numel_of(s.at("length").get<std::vector<int64_t>>());
    TITAN_ASSERT(covered == numel_of(t.at("shape").get<std::vector<int64_t>>()), "checkpoint slices of ", name,
                 " cover ", covered, " of ", shape_str(t.at("shape").get<std::vector<int64_t>>()), " entries");
  }
  const nlohmann::json state = state_in.is_null() ? nlohmann::json::object() : state_in;
  // What the checkpoint is and the non-tensor state (step, data position) have their own CRC-32: a
  // damaged digit would otherwise resume silently at the wrong place.
  nlohmann::json index = {{"format", "titan-checkpoint"}, {"version", kFormatVersion}, {"info", info},
                          {"state", state}, {"info_state_crc32", info_state_crc32(info, state)},
                          {"files", files}, {"tensors", tensors}};
  write_file_atomically((tmp_dir / kIndexFile).string(), index.dump(1));
  sync_directory(tmp_dir.string());
  crash_point("rename");
  // An older folder of the same step (a run that resumed before it) is replaced.
  replace_directory(tmp_dir.string(), step_dir.string());
}

fs::path create_partial_dir(const fs::path& step_dir) {
  const fs::path tmp_dir = step_dir.string() + ".partial";
  std::error_code ec;
  fs::create_directories(tmp_dir, ec);
  TITAN_USER_CHECK(!ec, "cannot create checkpoint folder ", tmp_dir.string(), ": ", ec.message(),
                   " (check checkpoint.folder and job.dump_folder, and that the disk is writable)");
  return tmp_dir;
}

}  // namespace

int64_t write(const std::string& step_dir_in, const Snapshot& snap, Coordinator& coord) {
  const fs::path step_dir = fs::path(step_dir_in).lexically_normal();
  const std::string key = "checkpoint/" + step_dir.string();
  // This rank's slices as one file. A rank that cannot write still reports to rank 0 (which then
  // fails the save with its reason instead of waiting for it), then throws.
  nlohmann::json mine = {{"files", nlohmann::json::array()}};
  int64_t bytes = 0;
  try {
    const fs::path tmp_dir = create_partial_dir(step_dir);
    if (!snap.slices.empty()) {
      mine["files"].push_back(write_slices(tmp_dir, rank_file_name(coord.rank()), snap.slices));
      bytes = mine["files"][0].at("bytes").get<int64_t>();
    }
  } catch (const std::exception& e) {
    coord.gather_to_rank0(key, nlohmann::json({{"error", e.what()}}).dump());
    throw;
  }
  crash_point("index");
  auto all = coord.gather_to_rank0(key, mine.dump());
  if (coord.rank() != 0) return bytes;

  std::vector<nlohmann::json> records;
  for (size_t rank = 0; rank < all.size(); ++rank) {
    const nlohmann::json r = nlohmann::json::parse(all[rank]);
    TITAN_USER_CHECK(!r.contains("error"), "checkpoint ", step_dir.string(), " is incomplete: rank ", rank,
                     " could not write its part: ", r.at("error").get<std::string>());
    for (const auto& f : r.at("files")) records.push_back(f);
  }
  write_index(step_dir.string() + ".partial", step_dir, records, snap.info, snap.state);
  return bytes;
}

void write_single_process(const std::string& step_dir_in, const std::vector<std::string>& names,
                          const std::function<at::Tensor(const std::string&)>& fetch, const nlohmann::json& info,
                          const nlohmann::json& state, int64_t max_file_bytes) {
  const fs::path step_dir = fs::path(step_dir_in).lexically_normal();
  const fs::path tmp_dir = create_partial_dir(step_dir);
  std::vector<nlohmann::json> records;
  std::vector<Snapshot::Slice> pending;
  int64_t pending_bytes = 0;
  auto flush = [&] {
    if (pending.empty()) return;
    char name[64];
    std::snprintf(name, sizeof name, "part-%05zu.safetensors", records.size());
    records.push_back(write_slices(tmp_dir, name, pending));
    pending.clear();
    pending_bytes = 0;
  };
  for (const auto& n : names) {
    at::Tensor t = fetch(n).detach().to(at::kCPU).contiguous();
    const int64_t nbytes = t.numel() * t.element_size();
    if (pending_bytes > 0 && pending_bytes + nbytes > max_file_bytes) flush();
    pending.push_back({n, t, t.sizes().vec(), std::vector<int64_t>(t.dim(), 0)});
    pending_bytes += nbytes;
  }
  flush();
  write_index(tmp_dir, step_dir, records, info, state);
}

void write_single_process(const std::string& step_dir, const std::map<std::string, at::Tensor>& tensors,
                          const nlohmann::json& info, const nlohmann::json& state) {
  std::vector<std::string> names;
  for (const auto& [n, t] : tensors) names.push_back(n);
  write_single_process(step_dir, names, [&](const std::string& n) { return tensors.at(n); }, info, state);
}

// ---------------------------------------------------------------------------------------------
// Reading

Reader::Reader(std::string step_dir) : dir_(std::move(step_dir)) {
  const std::string path = (fs::path(dir_) / kIndexFile).string();
  TITAN_USER_CHECK(fs::is_directory(dir_), "checkpoint folder ", dir_, " does not exist");
  TITAN_USER_CHECK(fs::exists(path), dir_, " is not a complete titan checkpoint: it has no ", kIndexFile,
                   " (a save that did not finish, or not a checkpoint folder; Hugging Face folders load with "
                   "checkpoint.initial_load_in_hf or titan convert from-hf)");
  const std::string text = read_file(path);
  try {
    index_ = nlohmann::json::parse(text);
    TITAN_USER_CHECK(index_.at("format") == "titan-checkpoint", path, " is not a titan checkpoint index");
    TITAN_USER_CHECK(json_integer<int>(index_.at("version")) <= kFormatVersion, path, " has format version ",
                     index_.at("version"), ", newer than this titan reads (", kFormatVersion, "): update titan");
    for (const char* key : {"info", "state", "files", "tensors"}) (void)index_.at(key);
    check_index(index_, path);
    TITAN_USER_CHECK(info_state_crc32(index_.at("info"), index_.at("state")) ==
                         json_integer<uint32_t>(index_.at("info_state_crc32")),
                     path, " is corrupt: the CRC-32 of its info and training state does not match; load another "
                     "step with --checkpoint.load_step");
  } catch (const nlohmann::json::exception& e) {
    throw UserError(path + " is corrupt or not a titan checkpoint index: " + e.what());
  }
}

Reader::~Reader() = default;

std::vector<std::string> Reader::names() const {
  std::vector<std::string> out;
  for (const auto& [name, t] : index_.at("tensors").items()) out.push_back(name);
  return out;
}

std::optional<TensorMeta> Reader::meta(const std::string& name) const {
  const auto& tensors = index_.at("tensors");
  auto it = tensors.find(name);
  if (it == tensors.end()) return std::nullopt;
  return TensorMeta{dtype_from_name(it->at("dtype").get<std::string>()), it->at("shape").get<std::vector<int64_t>>()};
}

SafetensorsFile& Reader::file(const std::string& name) {
  auto& f = files_[name];
  if (!f) {
    const auto& files = index_.at("files");
    TITAN_USER_CHECK(files.contains(name), describe(), ": the index names file ", name, " but does not describe it");
    const int64_t bytes = files.at(name).at("bytes").get<int64_t>();
    const std::string path = (fs::path(dir_) / name).string();
    std::error_code ec;
    const auto size = fs::file_size(path, ec);
    TITAN_USER_CHECK(!ec, describe(), ": file ", path, " is missing (", ec.message(), "): the checkpoint is incomplete");
    TITAN_USER_CHECK(static_cast<int64_t>(size) == bytes, describe(), ": file ", path, " has ", size,
                     " bytes but was written with ", bytes, ": it is truncated or corrupt; load another step with "
                     "--checkpoint.load_step");
    f = std::make_unique<SafetensorsFile>(path);
  }
  return *f;
}

at::Tensor Reader::read(const std::string& name, const std::vector<int64_t>& begin, const std::vector<int64_t>& length) {
  const auto& tensors = index_.at("tensors");
  TITAN_USER_CHECK(tensors.contains(name), describe(), " has no tensor '", name, "'");
  const auto& t = tensors.at(name);
  const at::ScalarType dtype = dtype_from_name(t.at("dtype").get<std::string>());
  at::Tensor out = at::empty(length, at::TensorOptions().dtype(dtype));
  int64_t filled = 0;
  for (const auto& s : t.at("slices")) {
    const auto sb = s.at("begin").get<std::vector<int64_t>>(), sl = s.at("length").get<std::vector<int64_t>>();
    // The overlap of the requested block and this slice, per dimension.
    std::vector<int64_t> lo(begin.size()), n(begin.size());
    bool empty = false;
    for (size_t d = 0; d < begin.size(); ++d) {
      lo[d] = std::max(begin[d], sb[d]);
      n[d] = std::min(begin[d] + length[d], sb[d] + sl[d]) - lo[d];
      empty = empty || n[d] <= 0;
    }
    if (empty) continue;
    const std::string file_name = s.at("file");
    at::Tensor slice = file(file_name).read(name);  // whole slice, so that its CRC can be checked
    TITAN_USER_CHECK(slice.sizes().vec() == sl && slice.scalar_type() == dtype, describe(), ": file ", file_name,
                     " holds tensor '", name, "' with another shape or dtype than its index says: the checkpoint is corrupt");
    TITAN_USER_CHECK(tensor_crc32(slice) == s.at("crc32").get<uint32_t>(), describe(), ": file ",
                     (fs::path(dir_) / file_name).string(), " is corrupt: the CRC-32 of tensor '", name,
                     "' does not match the index; load another step with --checkpoint.load_step");
    std::vector<int64_t> in_slice(lo.size()), in_out(lo.size());
    for (size_t d = 0; d < lo.size(); ++d) {
      in_slice[d] = lo[d] - sb[d];
      in_out[d] = lo[d] - begin[d];
    }
    block_of(out, in_out, n).copy_(block_of(slice, in_slice, n));
    filled += numel_of(n);
  }
  TITAN_USER_CHECK(filled == numel_of(length), describe(), ": tensor '", name, "' is not fully stored (",
                   filled, " of ", numel_of(length), " entries of the requested block): the checkpoint is corrupt");
  return out;
}

void Reader::verify_all() {
  for (const auto& [name, f] : index_.at("files").items()) {
    const std::string path = (fs::path(dir_) / name).string();
    (void)file(name);  // checks presence and size
    TITAN_USER_CHECK(file_crc32(path) == f.at("crc32").get<uint32_t>(), describe(), ": file ", path,
                     " is corrupt: its CRC-32 does not match the index");
  }
}

// ---------------------------------------------------------------------------------------------
// Loading into placed tensors

void Staged::apply() {
  at::NoGradGuard no_grad;
  for (auto& [dst, value] : copies) dst.copy_(value);
}

Staged stage(Source& source, const std::vector<dist::PlacedTensor>& tensors, bool allow_cast) {
  at::NoGradGuard no_grad;
  Staged staged;
  for (const auto& t : tensors) {
    const dist::Placement& p = t.placement;
    auto meta = source.meta(t.name);
    TITAN_USER_CHECK(meta, source.describe(), " has no tensor '", t.name,
                     "': it was written for another model, or without this part (exclude it with "
                     "checkpoint.exclude_from_loading)");
    TITAN_USER_CHECK(meta->shape == p.global_shape, source.describe(), ": tensor '", t.name, "' has shape ",
                     shape_str(meta->shape), " there but ", shape_str(p.global_shape),
                     " in this model: the checkpoint is of another model or flavor");
    const at::ScalarType want = t.local.scalar_type();
    TITAN_USER_CHECK(meta->dtype == want || (allow_cast && at::isFloatingType(meta->dtype) && at::isFloatingType(want)),
                     source.describe(), ": tensor '", t.name, "' is ", c10::toString(meta->dtype), " there but ",
                     c10::toString(want), " here");
    at::Tensor value = at::zeros(t.local.sizes(), t.local.options().requires_grad(false));
    if (p.real_numel() > 0) {
      at::Tensor block = source.read(t.name, p.global_begin(), p.global_length());
      p.real_part(value).copy_(block.reshape(p.real_part(value).sizes()));
    }
    staged.copies.emplace_back(t.local, value);
  }
  return staged;
}

std::map<int64_t, std::string> list_checkpoints(const std::string& folder) {
  std::map<int64_t, std::string> out;
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return out;
  static const std::regex step_re(R"(^step-(\d+)$)");
  for (const auto& e : fs::directory_iterator(folder, ec)) {
    std::smatch m;
    const std::string name = e.path().filename().string();
    if (e.is_directory() && std::regex_match(name, m, step_re) && fs::exists(e.path() / kIndexFile))
      out[std::stoll(m[1])] = e.path().string();
  }
  return out;
}

}  // namespace titan::checkpoint
