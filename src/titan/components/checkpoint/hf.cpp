#include "titan/components/checkpoint/hf.h"

#include "titan/common/error.h"
#include "titan/common/plain_name.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>

namespace titan::checkpoint {
namespace fs = std::filesystem;
namespace {

std::string join(const std::string& dir, const std::string& name) { return (fs::path(dir) / name).string(); }

std::string shape_str(const std::vector<int64_t>& shape) { return nlohmann::json(shape).dump(); }

// Every parameter of the flavor with its shape, from a model built on the meta device (no memory),
// and with `biases` the MoE layers' routing biases (buffers that checkpoints hold too).
std::map<std::string, std::vector<int64_t>> parameter_shapes(const ModelSpec& spec, const std::string& flavor,
                                                             bool biases = false) {
  LanguageModel model = spec.build(flavor, at::TensorOptions().device(at::kMeta).dtype(at::kFloat), 1);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : model->named_parameters()) shapes[p.key()] = p.value().sizes().vec();
  if (biases)
    for (const auto& [prefix, layer] : model->moe_layers())
      if (layer->expert_bias.defined()) shapes[prefix + "expert_bias"] = layer->expert_bias.sizes().vec();
  return shapes;
}

// The HF names and shapes of one titan parameter: one tensor, a MoE layer's stacked experts one per
// expert, or none (a tied output projection).
std::vector<std::pair<std::string, std::vector<int64_t>>> to_hf_names(const HFAdapter& adapter, const std::string& name,
                                                                      const std::vector<int64_t>& shape) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const auto& [hf_name, t] : adapter.to_hf({{name, at::empty(shape, at::TensorOptions().device(at::kMeta))}}))
    out.emplace_back(hf_name, t.sizes().vec());
  return out;
}

// Name -> (dtype, shape) of a safetensors file, from its header only.
std::map<std::string, TensorMeta> read_header(const std::string& path) { return SafetensorsFile(path).tensors(); }

std::string read_config(const std::string& hf_dir) {
  const std::string path = join(hf_dir, kHFConfigFile);
  TITAN_USER_CHECK(fs::is_directory(hf_dir), "Hugging Face folder ", hf_dir, " does not exist");
  TITAN_USER_CHECK(fs::exists(path), hf_dir, " has no ", kHFConfigFile,
                   ": it is not a Hugging Face model folder (transformers' save_pretrained writes one)");
  return read_file(path);
}

std::string config_mismatch(const HFAdapter& adapter, const std::string& text, const std::string& path) {
  try {
    return adapter.config_mismatch(text);
  } catch (const UserError& e) {
    throw UserError(path + ": " + e.what());
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Writing

HFWriter::HFWriter(std::string out_dir, const ModelSpec& spec, const std::string& flavor, at::ScalarType dtype,
                   int64_t max_shard_bytes)
    : out_dir_(std::move(out_dir)),
      flavor_(flavor),
      adapter_(spec.hf_adapter(flavor)),
      dtype_(dtype),
      max_shard_bytes_(max_shard_bytes) {
  TITAN_USER_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                   "Hugging Face export writes float32, bfloat16 or float16, not ", c10::toString(dtype));
  TITAN_ASSERT(max_shard_bytes > 0);
  std::error_code ec;
  fs::create_directories(out_dir_, ec);
  TITAN_USER_CHECK(fs::is_directory(out_dir_), "cannot create folder ", out_dir_, ": ", ec.message());
  for (const auto& entry : fs::directory_iterator(out_dir_)) {
    const std::string name = entry.path().filename().string();
    const bool weights = name.rfind("model", 0) == 0 && name.find(".safetensors") != std::string::npos;
    TITAN_USER_CHECK(!weights && name != kHFConfigFile, out_dir_, " already holds a Hugging Face model (", name,
                     "): export into a new or empty folder, or remove its config.json and model*.safetensors");
  }
  expected_ = parameter_shapes(spec, flavor);
  for (const auto& [name, shape] : parameter_shapes(spec, flavor, /*biases=*/true))
    if (!expected_.count(name)) optional_[name] = shape;
}

HFWriter::~HFWriter() {
  if (finished_) return;
  std::error_code ec;  // an export that did not finish leaves no partial shards behind
  for (const auto& path : shard_paths_) fs::remove(path, ec);
}

void HFWriter::add(const std::string& titan_name, const at::Tensor& full) {
  TITAN_ASSERT(!finished_, "add() after finish()");
  TITAN_USER_CHECK(!added_.count(titan_name), "parameter '", titan_name, "' was given twice");
  const bool optional = optional_.count(titan_name) > 0;  // a routing bias: written where the architecture has one
  auto it = optional ? optional_.find(titan_name) : expected_.find(titan_name);
  TITAN_USER_CHECK(optional || it != expected_.end(), "'", titan_name, "' is not a parameter of model flavor '",
                   flavor_, "': is the checkpoint of another model or flavor?");
  TITAN_USER_CHECK(full.sizes().vec() == it->second, "parameter '", titan_name, "' has shape ",
                   shape_str(full.sizes().vec()), " but flavor '", flavor_, "' has ", shape_str(it->second),
                   ": is the checkpoint of another flavor?");
  if (!optional) expected_.erase(it);
  added_.insert(titan_name);
  for (auto& [hf_name, t] : adapter_.to_hf({{titan_name, full.detach()}})) {
    const bool fp32 = adapter_.keep_fp32 && adapter_.keep_fp32(hf_name);
    at::Tensor value = t.to(at::kCPU, fp32 ? at::kFloat : dtype_).contiguous();
    const int64_t bytes = value.numel() * value.element_size();
    if (!pending_.empty() && pending_bytes_ + bytes > max_shard_bytes_) flush();
    pending_.push_back({hf_name, value});
    pending_bytes_ += bytes;
  }
}

void HFWriter::flush() {
  if (pending_.empty()) return;
  char name[64];
  std::snprintf(name, sizeof(name), ".shard-%05zu.partial", shard_paths_.size() + 1);
  const std::string path = join(out_dir_, name);
  write_safetensors(path, pending_, {{"format", "pt"}});  // transformers expects format "pt"
  shard_paths_.push_back(path);
  shard_names_.emplace_back();
  for (const auto& e : pending_) shard_names_.back().push_back(e.name);
  total_bytes_ += pending_bytes_;
  pending_.clear();
  pending_bytes_ = 0;
}

void HFWriter::finish() {
  TITAN_ASSERT(!finished_, "finish() called twice");
  TITAN_USER_CHECK(expected_.empty(), "parameter '", expected_.begin()->first, "' of model flavor '", flavor_,
                   "' was never given (", expected_.size(), " missing): is the checkpoint complete?");
  flush();
  const size_t n = shard_paths_.size();
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t i = 0; i < n; ++i) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", i + 1, n);
    const std::string file = n == 1 ? kHFSingleFile : name;
    TITAN_USER_CHECK(std::rename(shard_paths_[i].c_str(), join(out_dir_, file).c_str()) == 0, "cannot rename ",
                     shard_paths_[i], " to ", join(out_dir_, file));
    for (const auto& tensor : shard_names_[i]) weight_map[tensor] = file;
  }
  finished_ = true;
  if (n > 1) {
    const nlohmann::json index = {{"metadata", {{"total_size", total_bytes_}}}, {"weight_map", weight_map}};
    write_file_atomically(join(out_dir_, kHFIndexFile), index.dump(2) + "\n");
  }
  write_file_atomically(join(out_dir_, kHFConfigFile), adapter_.config_json(dtype_));
  sync_directory(out_dir_);
}

// ---------------------------------------------------------------------------------------------
// Reading

HFSource::HFSource(std::string hf_dir, const ModelSpec& spec, const std::string& flavor)
    : dir_(std::move(hf_dir)), adapter_(spec.hf_adapter(flavor)) {
  const std::string config_path = join(dir_, kHFConfigFile);
  const std::string why = config_mismatch(adapter_, read_config(dir_), config_path);
  TITAN_USER_CHECK(why.empty(), config_path, " does not describe ", spec.name, " flavor '", flavor, "': ", why,
                   ". Convert with the flavor the model was saved from (--model.flavor), or check the folder");

  // HF name -> file holding it.
  std::map<std::string, std::string> location;
  const std::string index_path = join(dir_, kHFIndexFile), single_path = join(dir_, kHFSingleFile);
  if (fs::exists(index_path)) {
    nlohmann::json index;
    try {
      index = nlohmann::json::parse(read_file(index_path));
      for (const auto& [name, file] : index.at("weight_map").items())
        location[name] = join(dir_, plain_file_name(file.get<std::string>(), index_path + " (weight_map of " + name + ")"));
    } catch (const nlohmann::json::exception& e) {
      throw UserError(index_path + " is malformed (expected {\"weight_map\": {tensor: file}}): " + e.what());
    }
  } else {
    TITAN_USER_CHECK(fs::exists(single_path), dir_, " has neither ", kHFSingleFile, " nor ", kHFIndexFile,
                     fs::exists(join(dir_, "pytorch_model.bin"))
                         ? ": its weights are a PyTorch pickle (pytorch_model.bin), which titan does not read; re-save "
                           "them with save_pretrained(..., safe_serialization=True)"
                         : ": save the model with transformers' save_pretrained");
    for (const auto& [name, m] : read_header(single_path)) location[name] = single_path;
  }
  std::map<std::string, std::map<std::string, TensorMeta>> headers;  // by file
  for (const auto& [name, file] : location) {
    TITAN_USER_CHECK(fs::exists(file), index_path, " puts tensor '", name, "' in ", file,
                     ", which does not exist: the folder is incomplete (copy or download the missing shard)");
    if (!headers.count(file)) headers[file] = read_header(file);
    TITAN_USER_CHECK(headers[file].count(name), index_path, " puts tensor '", name, "' in ", file,
                     ", which does not hold it: the index and the shards are from different saves");
  }

  // Every parameter of the flavor must be stored, with its HF shape.
  std::map<std::string, std::string> hf_to_titan;
  for (const auto& [titan_name, shape] : parameter_shapes(spec, flavor, /*biases=*/true)) {
    Entry entry;
    for (const auto& [hf_name, hf_shape] : to_hf_names(adapter_, titan_name, shape)) {
      auto it = location.find(hf_name);
      TITAN_USER_CHECK(it != location.end(), dir_, " lacks tensor '", hf_name, "' (titan's '", titan_name, "') of ",
                       spec.name, " flavor '", flavor, "': the folder is incomplete or of another model");
      const TensorMeta& stored = headers[it->second].at(hf_name);
      TITAN_USER_CHECK(stored.shape == hf_shape, it->second, ": tensor '", hf_name, "' has shape ",
                       shape_str(stored.shape), " but ", spec.name, " flavor '", flavor, "' needs ", shape_str(hf_shape));
      TITAN_USER_CHECK(at::isFloatingType(stored.dtype), it->second, ": tensor '", hf_name, "' is ",
                       c10::toString(stored.dtype), ", not a floating-point type");
      entry.parts.emplace_back(hf_name, it->second);
      entry.meta = {stored.dtype, shape};
      hf_to_titan[hf_name] = titan_name;
    }
    if (entry.parts.size() > 1 && static_cast<int64_t>(entry.parts.size()) == shape[0]) {
      // One HF tensor per row of dim 0 (experts): which part is which row, found by converting a
      // tensor whose rows hold their own index.
      std::vector<int64_t> probe_shape(shape.size(), 1);
      probe_shape[0] = shape[0];
      const at::Tensor probe = at::arange(shape[0], at::kDouble).view(probe_shape);
      std::map<std::string, size_t> part_of;
      for (size_t i = 0; i < entry.parts.size(); ++i) part_of[entry.parts[i].first] = i;
      entry.rows.assign(static_cast<size_t>(shape[0]), entry.parts.size());
      for (const auto& [hf_name, t] : adapter_.to_hf({{titan_name, probe}})) {
        const auto row = static_cast<size_t>(t.item<double>());
        TITAN_ASSERT(t.numel() == 1 && row < entry.rows.size() && part_of.count(hf_name), "rows of '", titan_name, "'");
        entry.rows[row] = part_of.at(hf_name);
      }
      for (size_t r : entry.rows) TITAN_ASSERT(r < entry.parts.size(), "a row of '", titan_name, "' has no part");
    }
    if (!entry.parts.empty()) entries_["model." + titan_name] = std::move(entry);
  }
  // Anything else must be something the adapter drops (e.g. rotary buffers, a tied lm_head); the
  // adapter throws naming a tensor it does not know.
  for (const auto& [name, file] : location) {
    if (hf_to_titan.count(name)) continue;
    const TensorMeta& m = headers[file].at(name);
    StateDict converted;
    try {
      converted = adapter_.from_hf({{name, at::empty(m.shape, at::TensorOptions().device(at::kMeta).dtype(m.dtype))}});
    } catch (const UserError& e) {
      throw UserError(file + ": " + e.what());
    }
    TITAN_USER_CHECK(converted.empty(), file, ": tensor '", name, "' duplicates titan's '", converted.begin()->first,
                     "': the folder is not a plain ", spec.name, " model");
  }
}

HFSource::~HFSource() = default;

std::vector<std::string> HFSource::names() const {
  std::vector<std::string> out;
  for (const auto& [name, e] : entries_) out.push_back(name);
  return out;
}

std::optional<TensorMeta> HFSource::meta(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) return std::nullopt;
  return it->second.meta;
}

at::Tensor HFSource::read(const std::string& name, const std::vector<int64_t>& begin,
                          const std::vector<int64_t>& length) {
  auto it = entries_.find(name);
  TITAN_USER_CHECK(it != entries_.end(), describe(), " has no tensor '", name, "'");
  const Entry& e = it->second;
  const auto& shape = e.meta.shape;
  TITAN_ASSERT(begin.size() == shape.size() && length.size() == shape.size(), "block of '", name,
               "' has the wrong number of dimensions");
  for (size_t d = 0; d < shape.size(); ++d)
    TITAN_ASSERT(begin[d] >= 0 && length[d] >= 0 && begin[d] + length[d] <= shape[d], "block of '", name,
                 "' lies outside its shape ", shape_str(shape));
  if (!e.rows.empty()) {  // only the rows (experts) asked for
    std::vector<at::Tensor> rows;
    for (int64_t j = begin[0]; j < begin[0] + length[0]; ++j) {
      const auto& [hf_name, path] = e.parts[e.rows[static_cast<size_t>(j)]];
      auto& file = files_[path];
      if (!file) file = std::make_unique<SafetensorsFile>(path);
      rows.push_back(file->read(hf_name));
    }
    if (rows.empty()) {
      std::vector<int64_t> empty = length;
      return at::empty(empty, at::TensorOptions().dtype(e.meta.dtype));
    }
    std::vector<int64_t> rest_begin(begin.begin() + 1, begin.end()), rest_length(length.begin() + 1, length.end());
    std::vector<at::Tensor> blocks;
    for (const at::Tensor& r : rows) blocks.push_back(block_of(r, rest_begin, rest_length));
    return at::stack(blocks).contiguous();
  }
  if (cached_name_ != name) {
    StateDict stored;
    for (const auto& [hf_name, path] : e.parts) {
      auto& file = files_[path];
      if (!file) file = std::make_unique<SafetensorsFile>(path);
      stored[hf_name] = file->read(hf_name);
    }
    StateDict converted = adapter_.from_hf(stored);
    TITAN_ASSERT(converted.size() == 1, "adapter made ", converted.size(), " tensors of '", e.parts.front().first, "'");
    cached_ = converted.begin()->second.contiguous();
    cached_name_ = name;
  }
  return block_of(cached_, begin, length).clone(at::MemoryFormat::Contiguous);  // never the cached tensor itself
}

std::vector<std::string> matching_hf_flavors(const std::string& hf_dir, const ModelSpec& spec) {
  const std::string text = read_config(hf_dir);
  std::vector<std::string> out;
  for (const auto& flavor : spec.flavors)
    if (config_mismatch(spec.hf_adapter(flavor), text, join(hf_dir, kHFConfigFile)).empty()) out.push_back(flavor);
  return out;
}

nlohmann::json model_record(const ModelSpec& spec, const std::string& flavor) {
  nlohmann::json record = {{"name", spec.name}, {"flavor", flavor}};
  const std::string recorded = spec.flavor_record ? spec.flavor_record(flavor) : flavor;
  if (recorded != flavor) record["hf_config"] = recorded;
  return record;
}

}  // namespace titan::checkpoint
