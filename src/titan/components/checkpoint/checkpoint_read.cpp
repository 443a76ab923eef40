// Reading titan's checkpoint format (checkpoint.h): the index, the slice indexes a read needs, blocks
// of any split, and loading them into placed tensors.
#include "titan/components/checkpoint/checkpoint.h"

#include "titan/common/error.h"
#include "titan/common/json_integer.h"
#include "titan/common/plain_name.h"
#include "titan/components/checkpoint/file_io.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <regex>

namespace titan::checkpoint {
namespace fs = std::filesystem;

namespace {

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

[[noreturn]] void corrupt(const std::string& path, const std::string& what) {
  throw UserError(path + " is corrupt: " + what + "; load another step with --checkpoint.load_step");
}

// A slice's begin and length, checked to lie inside `shape`.
std::pair<std::vector<int64_t>, std::vector<int64_t>> slice_extent(const nlohmann::json& slice,
                                                                   const std::vector<int64_t>& shape,
                                                                   const std::string& path, const std::string& name) {
  auto begin = json_integers<int64_t>(slice.at("begin"));
  auto length = json_integers<int64_t>(slice.at("length"));
  bool inside = begin.size() == shape.size() && length.size() == shape.size();
  for (size_t d = 0; inside && d < shape.size(); ++d)
    inside = begin[d] >= 0 && length[d] >= 0 && begin[d] <= shape[d] - length[d];
  if (!inside)
    corrupt(path, "a slice of tensor '" + name + "' (begin " + shape_str(begin) + ", length " + shape_str(length) +
                      ") lies outside its shape " + shape_str(shape));
  return {std::move(begin), std::move(length)};
}

std::vector<int64_t> checked_shape(const nlohmann::json& shape, const std::string& path, const std::string& name) {
  auto s = json_integers<int64_t>(shape);
  for (int64_t d : s)
    if (d < 0) corrupt(path, "tensor '" + name + "' has shape " + shape_str(s));
  return s;
}

}  // namespace

// Every entry of an index is checked when the folder is opened: a damaged index.json is then a
// UserError naming the entry, not a failure (or an out-of-range access) in the middle of a load. JSON
// type errors are reported as a corrupt index.
Reader::Reader(std::string step_dir) : dir_(std::move(step_dir)) {
  const std::string path = (fs::path(dir_) / kIndexFile).string();
  TITAN_USER_CHECK(fs::is_directory(dir_), "checkpoint folder ", dir_, " does not exist");
  TITAN_USER_CHECK(fs::exists(path), dir_, " is not a complete titan checkpoint: it has no ", kIndexFile,
                   " (a save that did not finish, or not a checkpoint folder; Hugging Face folders load with "
                   "checkpoint.initial_load_in_hf or titan convert from-hf)");
  const std::string text = read_file(path);
  index_bytes_read_ += static_cast<int64_t>(text.size());
  try {
    index_ = nlohmann::json::parse(text);
    TITAN_USER_CHECK(index_.at("format") == "titan-checkpoint", path, " is not a titan checkpoint index");
    const int version = json_integer<int>(index_.at("version"));
    TITAN_USER_CHECK(version <= kFormatVersion, path, " has format version ", version,
                     ", newer than this titan reads (", kFormatVersion, "): update titan");
    for (const char* key : {"info", "state", "files", "tensors"}) (void)index_.at(key);
    for (const char* key : {"files", "tensors"})
      if (!index_.at(key).is_object()) corrupt(path, std::string("\"") + key + "\" is not an object");
    for (const auto& [name, f] : index_.at("files").items()) {
      plain_file_name(name, path);
      if (json_integer<int64_t>(f.at("bytes")) < 0) corrupt(path, "file " + name + " has a negative size");
      (void)json_integer<uint32_t>(f.at("crc32"));
    }
    if (version >= 2) {
      for (const auto& stem : index_.at("shards")) {
        const std::string s = stem.get<std::string>();
        plain_file_name(s, path);
        for (const std::string& f : {s + ".safetensors", s + kSlicesSuffix})
          if (!index_.at("files").contains(f)) corrupt(path, "it names the data file " + f + " but does not describe it");
        shards_.push_back(s);
      }
    }
    for (const auto& [name, t] : index_.at("tensors").items()) {
      Entry e;
      e.meta.dtype = dtype_from_name(t.at("dtype").get<std::string>());
      e.meta.shape = checked_shape(t.at("shape"), path, name);
      if (version >= 2) {
        for (const auto& range : t.at("shards")) {
          const auto r = json_integers<int64_t>(range);
          if (r.size() != 2 || r[0] < 0 || r[0] >= r[1] || r[1] > static_cast<int64_t>(shards_.size()))
            corrupt(path, "tensor '" + name + "' names files outside the " + std::to_string(shards_.size()) + " written");
          for (int64_t i = r[0]; i < r[1]; ++i) e.shards.push_back(i);
        }
      } else {
        if (!t.at("slices").is_array()) corrupt(path, "the slices of tensor '" + name + "' are not a list");
        for (const auto& slice : t.at("slices")) {
          auto [begin, length] = slice_extent(slice, e.meta.shape, path, name);
          e.slices.push_back({plain_file_name(slice.at("file").get<std::string>(), path), std::move(begin),
                              std::move(length), json_integer<uint32_t>(slice.at("crc32"))});
        }
      }
      tensors_.emplace(name, std::move(e));
    }
    TITAN_USER_CHECK(string_crc32(index_.at("info").dump() + "\n" + index_.at("state").dump()) ==
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
  for (const auto& [name, t] : tensors_) out.push_back(name);
  return out;
}

std::optional<TensorMeta> Reader::meta(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return std::nullopt;
  return it->second.meta;
}

std::string Reader::checked_path(const std::string& name) const {
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
  return path;
}

SafetensorsFile& Reader::file(const std::string& name) {
  auto& f = files_[name];
  if (!f) f = std::make_unique<SafetensorsFile>(checked_path(name));
  return *f;
}

const nlohmann::json& Reader::shard_index(int64_t shard) {
  auto it = shard_indexes_.find(shard);
  if (it != shard_indexes_.end()) return it->second;
  const std::string name = shards_.at(static_cast<size_t>(shard)) + kSlicesSuffix;
  const std::string path = checked_path(name);
  const std::string text = read_file(path);
  index_bytes_read_ += static_cast<int64_t>(text.size());
  if (string_crc32(text) != json_integer<uint32_t>(index_.at("files").at(name).at("crc32")))
    corrupt(path, "its CRC-32 does not match the index");
  nlohmann::json sub;
  try {
    sub = nlohmann::json::parse(text);
    if (sub.at("format") != "titan-checkpoint-slices" || !sub.at("slices").is_object())
      corrupt(path, "it is not a titan slice index");
    if (plain_file_name(sub.at("data").get<std::string>(), path) != shards_.at(static_cast<size_t>(shard)) + ".safetensors")
      corrupt(path, "it describes another data file (" + sub.at("data").get<std::string>() + ")");
  } catch (const nlohmann::json::exception& e) {
    corrupt(path, std::string("not a valid slice index (") + e.what() + ")");
  }
  return shard_indexes_.emplace(shard, std::move(sub)).first->second;
}

std::vector<Reader::SliceRef> Reader::slices_of(const std::string& name, const Entry& e) {
  if (shards_.empty()) return e.slices;
  std::vector<SliceRef> out;
  for (int64_t shard : e.shards) {
    const nlohmann::json& sub = shard_index(shard);
    const std::string path = (fs::path(dir_) / (shards_[static_cast<size_t>(shard)] + kSlicesSuffix)).string();
    const auto& slices = sub.at("slices");
    if (!slices.contains(name)) corrupt(path, "the index says it holds a slice of tensor '" + name + "', but it does not");
    try {
      const auto& s = slices.at(name);
      if (dtype_from_name(s.at("dtype").get<std::string>()) != e.meta.dtype ||
          json_integers<int64_t>(s.at("shape")) != e.meta.shape)
        corrupt(path, "tensor '" + name + "' has another dtype or shape there than in the index");
      auto [begin, length] = slice_extent(s, e.meta.shape, path, name);
      out.push_back({sub.at("data").get<std::string>(), std::move(begin), std::move(length),
                     json_integer<uint32_t>(s.at("crc32"))});
    } catch (const nlohmann::json::exception& ex) {
      corrupt(path, "the entry of tensor '" + name + "' is malformed (" + ex.what() + ")");
    }
  }
  return out;
}

at::Tensor Reader::read(const std::string& name, const std::vector<int64_t>& begin, const std::vector<int64_t>& length) {
  auto it = tensors_.find(name);
  TITAN_USER_CHECK(it != tensors_.end(), describe(), " has no tensor '", name, "'");
  const Entry& e = it->second;
  const at::ScalarType dtype = e.meta.dtype;
  at::Tensor out;
  int64_t filled = 0;
  for (const SliceRef& s : slices_of(name, e)) {
    // The overlap of the requested block and this slice, per dimension.
    std::vector<int64_t> lo(begin.size()), n(begin.size());
    bool empty = false;
    for (size_t d = 0; d < begin.size(); ++d) {
      lo[d] = std::max(begin[d], s.begin[d]);
      n[d] = std::min(begin[d] + length[d], s.begin[d] + s.length[d]) - lo[d];
      empty = empty || n[d] <= 0;
    }
    if (empty) continue;
    at::Tensor slice = file(s.file).read(name);  // whole slice, so that its CRC can be checked
    TITAN_USER_CHECK(slice.sizes().vec() == s.length && slice.scalar_type() == dtype, describe(), ": file ", s.file,
                     " holds tensor '", name, "' with another shape or dtype than its index says: the checkpoint is corrupt");
    TITAN_USER_CHECK(tensor_crc32(slice) == s.crc32, describe(), ": file ", (fs::path(dir_) / s.file).string(),
                     " is corrupt: the CRC-32 of tensor '", name, "' does not match the index; load another step with "
                     "--checkpoint.load_step");
    // The slice is exactly the block (a load under the saving layout): no second copy.
    if (s.begin == begin && s.length == length && filled == 0) return slice;
    if (!out.defined()) out = at::empty(length, at::TensorOptions().dtype(dtype));
    std::vector<int64_t> in_slice(lo.size()), in_out(lo.size());
    for (size_t d = 0; d < lo.size(); ++d) {
      in_slice[d] = lo[d] - s.begin[d];
      in_out[d] = lo[d] - begin[d];
    }
    block_of(out, in_out, n).copy_(block_of(slice, in_slice, n));
    filled += numel_of(n);
  }
  TITAN_USER_CHECK(filled == numel_of(length), describe(), ": tensor '", name, "' is not fully stored (",
                   filled, " of ", numel_of(length), " entries of the requested block): the checkpoint is corrupt");
  if (!out.defined()) out = at::empty(length, at::TensorOptions().dtype(dtype));  // an empty block
  return out;
}

void Reader::verify_all() {
  for (const auto& [name, f] : index_.at("files").items()) {
    const std::string path = checked_path(name);
    TITAN_USER_CHECK(file_crc32(path) == f.at("crc32").get<uint32_t>(), describe(), ": file ", path,
                     " is corrupt: its CRC-32 does not match the index");
  }
}

// ---------------------------------------------------------------------------------------------
// Loading into placed tensors

namespace {

// The block of `t` its placement covers, read from `source` and checked; undefined when it holds none.
at::Tensor read_block(Source& source, const dist::PlacedTensor& t, bool allow_cast) {
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
  if (p.real_numel() == 0) return {};
  return source.read(t.name, p.global_begin(), p.global_length());
}

}  // namespace

void check(Source& source, const std::vector<dist::PlacedTensor>& tensors, bool allow_cast) {
  for (const auto& t : tensors) (void)read_block(source, t, allow_cast);  // one block alive at a time
}

void load_into(Source& source, const std::vector<dist::PlacedTensor>& tensors, bool allow_cast) {
  at::NoGradGuard no_grad;
  for (const auto& t : tensors) {
    at::Tensor block = read_block(source, t, allow_cast);
    at::Tensor local = t.local;
    if (t.placement.real_numel() < local.numel()) local.zero_();  // padding stays zero
    if (!block.defined()) continue;
    at::Tensor real = t.placement.real_part(local);
    real.copy_(block.reshape(real.sizes()));
  }
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
