#include "titan/components/checkpoint/dcp.h"

#include "titan/common/error.h"
#include "titan/components/checkpoint/pickle.h"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <torch/csrc/jit/serialization/import_read.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

namespace titan::checkpoint {

namespace fs = std::filesystem;

namespace {

// The data-parallel degree torchtitan's data loader saves beside its per-rank states (its grain
// loader, from 2026-08), and as older versions named it.
constexpr std::array<const char*, 2> kRecordedDpDegree = {"dataloader.dp_world_size", "dataloader.world_size"};

const std::map<std::string, at::ScalarType>& dtypes() {
  static const std::map<std::string, at::ScalarType> m = {
      {"torch.float32", at::kFloat},         {"torch.bfloat16", at::kBFloat16},
      {"torch.float16", at::kHalf},          {"torch.float64", at::kDouble},
      {"torch.int64", at::kLong},            {"torch.int32", at::kInt},
      {"torch.int16", at::kShort},           {"torch.int8", at::kChar},
      {"torch.uint8", at::kByte},            {"torch.bool", at::kBool},
      {"torch.float8_e4m3fn", at::kFloat8_e4m3fn}, {"torch.float8_e5m2", at::kFloat8_e5m2}};
  return m;
}

std::vector<int64_t> ints(const pickle::Value& v) {
  std::vector<int64_t> out;
  for (const auto& x : v.sequence()) out.push_back(x->as_int());
  return out;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

// Wrappers torchtitan's model state dict may still carry (activation checkpointing, torch.compile).
std::string strip_wrappers(std::string fqn) {
  for (const std::string w : {"_checkpoint_wrapped_module.", "_orig_mod."}) {
    for (size_t p; (p = fqn.find(w)) != std::string::npos;) fqn.erase(p, w.size());
  }
  return fqn;
}

// titan's checkpoint name for a DCP tensor key, or "" when titan has no such tensor.
std::string titan_name(const std::string& key) {
  static const std::vector<std::string> not_model = {"optimizer.", "lr_scheduler.", "dataloader.", "train_state."};
  if (starts_with(key, "optimizer.state.")) {
    for (const std::string suffix : {".exp_avg_sq", ".exp_avg", ".step"})
      if (ends_with(key, suffix)) {
        const std::string param = key.substr(16, key.size() - 16 - suffix.size());
        return "optimizer." + strip_wrappers(param) + suffix;
      }
    return "";
  }
  for (const auto& p : not_model)
    if (starts_with(key, p)) return "";
  if (starts_with(key, "model.")) return "model." + strip_wrappers(key.substr(6));
  return "model." + strip_wrappers(key);
}

// A torch.save blob in memory whose reads stop at its end. LibTorch's own in-memory readers copy
// whatever range the zip's directory names, so a damaged directory would read past the blob (other
// heap memory); a short read here makes the zip reader fail instead.
class BoundedBlobReader final : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit BoundedBlobReader(const std::vector<char>& blob) : blob_(blob) {}
  size_t size() const override { return blob_.size(); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= blob_.size()) return 0;
    n = std::min<uint64_t>(n, blob_.size() - pos);
    std::memcpy(buf, blob_.data() + pos, n);
    return n;
  }

 private:
  const std::vector<char>& blob_;
};

// Bytes per element of a torch.save storage type ("torch.FloatStorage", ...), or 0 for a type titan
// does not read (torch.save writes the dtypes without a typed storage class, float8 among them, as
// untyped storages rebuilt by _rebuild_tensor_v3, which LibTorch's unpickler refuses).
int64_t storage_item_bytes(const std::string& type) {
  static const std::map<std::string, at::ScalarType> kTypes = {
      {"Float", at::kFloat},          {"Double", at::kDouble},         {"Half", at::kHalf},
      {"BFloat16", at::kBFloat16},    {"Long", at::kLong},             {"Int", at::kInt},
      {"Short", at::kShort},          {"Char", at::kChar},             {"Byte", at::kByte},
      {"Bool", at::kBool},            {"ComplexFloat", at::kComplexFloat}, {"ComplexDouble", at::kComplexDouble}};
  static const std::string prefix = "torch.", suffix = "Storage";
  if (!starts_with(type, prefix) || !ends_with(type, suffix) || type.size() <= prefix.size() + suffix.size()) return 0;
  auto it = kTypes.find(type.substr(prefix.size(), type.size() - prefix.size() - suffix.size()));
  return it == kTypes.end() ? 0 : static_cast<int64_t>(c10::elementSize(it->second));
}

// Throws unless `t` is a dense CPU tensor whose view lies inside its storage. LibTorch's unpickler
// takes a tensor's size, strides and storage offset as the pickle gives them, without checking them
// against the storage: a damaged pickle makes a view reading past it.
void check_view_in_storage(const at::Tensor& t) {
  if (!t.is_cpu() || t.layout() != at::kStrided || t.is_quantized())
    throw std::runtime_error(detail::concat("a tensor on ", t.device(), " of layout ", t.layout(),
                                            ", not a dense CPU tensor"));
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) < 0 || t.stride(d) < 0)
      throw std::runtime_error(detail::concat("a tensor of size ", t.sizes(), " and strides ", t.strides()));
  if (t.numel() == 0) return;
  int64_t last = t.storage_offset();  // the element furthest into the storage the view reaches
  bool fits = last >= 0;
  for (int64_t d = 0; d < t.dim() && fits; ++d) {
    int64_t reach = 0;
    fits = !__builtin_mul_overflow(t.size(d) - 1, t.stride(d), &reach) && !__builtin_add_overflow(last, reach, &last);
  }
  const auto item = static_cast<int64_t>(t.element_size());
  fits = fits && last < std::numeric_limits<int64_t>::max() / item &&
         (last + 1) * item <= static_cast<int64_t>(t.storage().nbytes());
  if (!fits)
    throw std::runtime_error(detail::concat("a tensor of size ", t.sizes(), ", strides ", t.strides(),
                                            " and storage offset ", t.storage_offset(), " reaches past its storage of ",
                                            t.storage().nbytes(), " bytes"));
}

// Whether a value of `doc` holds itself (a list appended to itself, ...). torch.save never writes
// one for tensors and numbers; LibTorch's unpickler would build the cycle, which is never freed.
bool holds_itself(const pickle::Document& doc) {
  std::map<const pickle::Value*, int> state;  // 1: on the current path, 2: done
  for (const auto& start : doc.values()) {
    if (state[start.get()] == 2) continue;
    // Depth-first, iteratively: (value, index of its next child).
    std::vector<std::pair<const pickle::Value*, size_t>> path = {{start.get(), 0}};
    state[start.get()] = 1;
    while (!path.empty()) {
      auto& [v, next] = path.back();
      const size_t n_items = v->items.size(), n_dict = 2 * v->dict.size();
      const pickle::Value* child = nullptr;
      if (next < n_items) child = v->items[next];
      else if (next < n_items + n_dict) child = (next - n_items) % 2 ? v->dict[(next - n_items) / 2].second
                                                                     : v->dict[(next - n_items) / 2].first;
      else if (next == n_items + n_dict && v->state) child = v->state;
      else {
        state[v] = 2;
        path.pop_back();
        continue;
      }
      ++next;
      int& s = state[child];
      if (s == 1) return true;
      if (s == 0) {
        s = 1;
        path.emplace_back(child, 0);
      }
    }
  }
  return false;
}

// The value a torch.save blob holds (a tensor, a number, a tuple), as torch::pickle_load reads it but
// bounded to the blob, on the CPU, and checked first by titan's pickle reader: LibTorch reserves the
// length a string's header gives before reading it (a damaged length would ask for gigabytes), sizes
// a storage by the element count its reference gives, not by its record (a larger count would read
// past the record), and builds a value that holds itself, which is never freed. Throws std::exception
// (c10::Error, runtime_error) when the blob is not readable (never UserError: callers name the file
// and the value).
c10::IValue load_torch_save(const std::vector<char>& blob) {
  caffe2::serialize::PyTorchStreamReader archive(std::make_shared<BoundedBlobReader>(blob));
  {
    auto [data, size] = archive.getRecord("data.pkl");
    const pickle::Document doc = pickle::parse(std::string_view(static_cast<const char*>(data.get()), size));
    if (holds_itself(doc)) throw std::runtime_error("its pickle makes a value that holds itself");
    // Only the globals a plain tensor's pickle names: LibTorch resolves some others its own way (after
    // torch._tensor._rebuild_from_type_v2 it reads a later global as another one), so the storage
    // types checked below would not be the ones it uses.
    for (const auto& v : doc.values())
      if (v->kind == pickle::Value::Kind::Global && v->s != "torch._utils._rebuild_tensor_v2" &&
          v->s != "collections.OrderedDict" && storage_item_bytes(v->s) == 0)
        throw std::runtime_error("its pickle names " + v->s + ", which titan does not read (a plain tensor's pickle "
                                 "names torch._utils._rebuild_tensor_v2, collections.OrderedDict and a storage type)");
    // Every storage reference: ('storage', type, key, location, element count), its record data/<key>.
    for (const auto& v : doc.values()) {
      if (v->kind != pickle::Value::Kind::Object || v->s != "persistent_id") continue;
      const pickle::Value* id = v->items.empty() ? nullptr : v->items[0];
      if (!id || id->kind != pickle::Value::Kind::Tuple || id->items.size() != 5 ||
          id->items[0]->kind != pickle::Value::Kind::String || id->items[0]->s != "storage")
        throw std::runtime_error("a storage reference that is not ('storage', type, key, location, size)");
      const std::string& type = id->items[1]->as_string();
      const std::string& key = id->items[2]->as_string();
      const int64_t count = id->items[4]->as_int(), item = storage_item_bytes(type);
      if (item == 0) throw std::runtime_error("a storage of type " + type + ", which titan does not read");
      const std::string record = "data/" + key;
      if (!archive.hasRecord(record)) throw std::runtime_error("no record " + record + " for a storage");
      const auto bytes = static_cast<int64_t>(archive.getRecordSize(record));
      if (count < 0 || count > bytes / item)
        throw std::runtime_error(detail::concat("a storage of ", count, " elements of ", item, " bytes in ", record,
                                                ", which holds ", bytes, " bytes"));
    }
  }
  c10::IValue v = torch::jit::readArchiveAndTensors("data", /*pickle_prefix=*/"", /*tensor_prefix=*/"",
                                                     /*type_resolver=*/std::nullopt, /*obj_loader=*/std::nullopt,
                                                     /*device=*/at::Device(at::kCPU), archive);
  // The tensors a caller reads: the value itself, or the items of a tuple or list (nothing deeper is
  // read).
  if (v.isTensor()) check_view_in_storage(v.toTensor());
  if (v.isTuple())
    for (const c10::IValue& x : v.toTupleRef().elements())
      if (x.isTensor()) check_view_in_storage(x.toTensor());
  if (v.isList())
    for (const c10::IValue& x : v.toListRef())
      if (x.isTensor()) check_view_in_storage(x.toTensor());
  return v;
}

}  // namespace

bool is_dcp_folder(const std::string& dir) {
  std::error_code ec;
  return fs::is_regular_file(fs::path(dir) / kDcpMetadataFile, ec);
}

DcpSource::DcpSource(std::string dir) : dir_(std::move(dir)) {
  const fs::path md_path = fs::path(dir_) / kDcpMetadataFile;
  std::ifstream f(md_path, std::ios::binary);
  TITAN_USER_CHECK(f.good(), describe(), " has no readable ", kDcpMetadataFile,
                   " file: give the step folder of a torch.distributed.checkpoint save (e.g. .../checkpoint/step-1000)");
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  pickle::Document doc;
  try {
    doc = pickle::parse(bytes);
  } catch (const std::exception& e) {
    throw UserError(detail::concat(md_path.string(), " is not a readable pickle (damaged or not DCP metadata): ", e.what()));
  }
  const pickle::Value* md = &doc.root();
  try {
    TITAN_USER_CHECK(md->kind == pickle::Value::Kind::Object && ends_with(md->s, ".Metadata"), md_path.string(),
                     " holds a ", md->kind == pickle::Value::Kind::Object ? md->s : "plain value",
                     ", not torch.distributed.checkpoint's Metadata");
    // Where each chunk and value is stored: MetadataIndex(fqn, offset, index) -> _StorageInfo.
    std::map<std::pair<std::string, std::vector<int64_t>>, Blob> storage;
    const pickle::Value* sd = md->get("storage_data");
    TITAN_USER_CHECK(sd && sd->kind == pickle::Value::Kind::Dict, md_path.string(),
                     " has no storage_data: was it written by a FileSystemWriter (dcp.save to a folder)?");
    for (const auto& [k, v] : sd->dict) {
      const std::string fqn = k->at("fqn").as_string();
      // MetadataIndex keeps no offset attribute of its own for a non-tensor value (the class default, None).
      const pickle::Value* off = k->get("offset");
      std::vector<int64_t> offsets = !off || off->kind == pickle::Value::Kind::None ? std::vector<int64_t>{} : ints(*off);
      const pickle::Value* transforms = v->get("transform_descriptors");
      TITAN_USER_CHECK(!transforms || transforms->kind == pickle::Value::Kind::None || transforms->sequence().empty(),
                       md_path.string(), ": '", fqn, "' is stored with transforms (compression or encryption), which "
                       "titan does not read: save without them");
      Blob b{v->at("relative_path").as_string(), v->at("offset").as_int(), v->at("length").as_int()};
      TITAN_USER_CHECK(b.offset >= 0 && b.length >= 0 && b.offset <= std::numeric_limits<int64_t>::max() - b.length,
                       md_path.string(), ": '", fqn, "' is stored at offset ", b.offset, " with length ", b.length,
                       ", which is no place in a file");
      TITAN_USER_CHECK(b.file.find('/') == std::string::npos && b.file != ".." && !b.file.empty(), md_path.string(),
                       ": '", fqn, "' names the file '", b.file, "', which is not a plain file name in the folder");
      storage[{fqn, offsets}] = b;
    }
    auto stored = [&](const std::string& fqn, const std::vector<int64_t>& offsets) -> const Blob& {
      auto it = storage.find({fqn, offsets});
      TITAN_USER_CHECK(it != storage.end(), md_path.string(), ": '", fqn, "' has a chunk with no storage entry");
      return it->second;
    };
    for (const auto& [k, v] : md->at("state_dict_metadata").dict) {
      const std::string key = k->as_string();
      const bool tensor = v->kind == pickle::Value::Kind::Object && ends_with(v->s, "TensorStorageMetadata");
      if (!tensor) {
        if (v->kind == pickle::Value::Kind::Object && ends_with(v->s, "BytesStorageMetadata")) values_[key] = stored(key, {});
        else unread_.push_back(key);
        continue;
      }
      // Older torchtitan saved the step counters as 0-d tensors: read as values.
      const bool state_scalar = key == "train_state.step" || key == "train_state.ntokens_seen" || key == "lr_scheduler.last_epoch";
      const std::string name = state_scalar ? key : titan_name(key);
      if (name.empty()) {
        unread_.push_back(key);
        continue;
      }
      Entry e;
      e.key = key;
      const pickle::Value& props = v->at("properties");
      // TensorProperties pickles its fields as a tuple (dtype, layout, requires_grad, memory_format, pin_memory).
      const pickle::Value* dtype = props.get("dtype");
      if (!dtype && props.state && props.state->kind == pickle::Value::Kind::Tuple && !props.state->items.empty())
        dtype = props.state->items[0];
      TITAN_USER_CHECK(dtype && dtype->kind == pickle::Value::Kind::Global, md_path.string(), ": '", key, "' has no dtype");
      auto dt = dtypes().find(dtype->s);
      if (dt == dtypes().end()) {  // e.g. complex64 RoPE tables (freqs_cis), which titan computes itself
        unread_.push_back(key);
        continue;
      }
      e.meta.dtype = dt->second;
      e.meta.shape = ints(v->at("size"));
      for (int64_t d : e.meta.shape)
        TITAN_USER_CHECK(d >= 0 && d <= (int64_t{1} << 48), md_path.string(), ": '", key, "' has size ",
                         c10::IntArrayRef(e.meta.shape), ", which is not a tensor's");
      int64_t covered = 0;
      for (const auto& c : v->at("chunks").sequence()) {
        Chunk ch;
        ch.offsets = ints(c->at("offsets"));
        ch.sizes = ints(c->at("sizes"));
        TITAN_USER_CHECK(ch.offsets.size() == e.meta.shape.size() && ch.sizes.size() == e.meta.shape.size(),
                         md_path.string(), ": a chunk of '", key, "' has the wrong rank");
        int64_t n = 1;
        for (size_t d = 0; d < ch.sizes.size(); ++d) {
          TITAN_USER_CHECK(ch.offsets[d] >= 0 && ch.sizes[d] >= 0 && ch.sizes[d] <= e.meta.shape[d] &&
                               ch.offsets[d] <= e.meta.shape[d] - ch.sizes[d],
                           md_path.string(), ": a chunk of '", key, "' lies outside its size");
          TITAN_USER_CHECK(!__builtin_mul_overflow(n, ch.sizes[d], &n), md_path.string(), ": a chunk of '", key,
                           "' is too large");
        }
        covered += n;
        const Blob& b = stored(key, ch.offsets);
        ch.file = b.file;
        ch.offset = b.offset;
        ch.length = b.length;
        e.chunks.push_back(std::move(ch));
      }
      int64_t numel = 1;
      for (int64_t s : e.meta.shape)
        TITAN_USER_CHECK(!__builtin_mul_overflow(numel, s, &numel), md_path.string(), ": '", key, "' is too large");
      TITAN_USER_CHECK(covered == numel, md_path.string(), ": the chunks of '", key, "' hold ", covered, " of its ", numel,
                       " elements");
      TITAN_USER_CHECK(!tensors_.count(name), md_path.string(), ": '", key, "' and '", tensors_[name].key,
                       "' are the same tensor for titan (", name, ")");
      if (state_scalar) {
        TITAN_USER_CHECK(numel == 1, md_path.string(), ": '", key, "' holds ", numel, " values, not one");
        scalar_tensors_[key] = std::move(e);
        continue;
      }
      tensors_[name] = std::move(e);
    }
  } catch (const UserError&) {
    throw;
  } catch (const std::exception& e) {
    throw UserError(detail::concat(md_path.string(), " is not torch.distributed.checkpoint metadata titan can read: ", e.what()));
  }
  // Every file the metadata names exists and holds what it points at.
  std::map<std::string, int64_t> needed;
  for (const auto& [name, e] : tensors_)
    for (const auto& c : e.chunks) needed[c.file] = std::max(needed[c.file], c.offset + c.length);
  for (const auto& [name, e] : scalar_tensors_)
    for (const auto& c : e.chunks) needed[c.file] = std::max(needed[c.file], c.offset + c.length);
  for (const auto& [key, b] : values_) needed[b.file] = std::max(needed[b.file], b.offset + b.length);
  for (const auto& [file, end] : needed) {
    std::error_code ec;
    const auto size = fs::file_size(fs::path(dir_) / file, ec);
    TITAN_USER_CHECK(!ec, describe(), ": ", file, " is missing (", kDcpMetadataFile, " names it): the save is incomplete");
    TITAN_USER_CHECK(static_cast<int64_t>(size) >= end, describe(), ": ", file, " has ", size, " bytes, but ",
                     kDcpMetadataFile, " places data up to byte ", end, ": the file is truncated");
  }
}

DcpSource::~DcpSource() = default;

std::vector<std::string> DcpSource::names() const {
  std::vector<std::string> out;
  for (const auto& [name, e] : tensors_) out.push_back(name);
  return out;
}

std::optional<TensorMeta> DcpSource::meta(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return std::nullopt;
  return it->second.meta;
}

std::vector<char> DcpSource::read_bytes(const std::string& file, int64_t offset, int64_t length, const std::string& what) {
  const fs::path path = fs::path(dir_) / file;
  std::ifstream f(path, std::ios::binary);
  TITAN_USER_CHECK(f.good(), describe(), ": cannot open ", file, " (", what, ")");
  std::vector<char> buf(static_cast<size_t>(length));
  f.seekg(offset);
  f.read(buf.data(), length);
  TITAN_USER_CHECK(f.gcount() == length, describe(), ": ", file, " ends before byte ", offset + length, " (", what,
                   "): the file is truncated");
  return buf;
}

at::Tensor DcpSource::load_chunk(const Entry& e, const Chunk& c) {
  const std::string where = e.key + "@" + c.file + ":" + std::to_string(c.offset);
  if (where == cached_key_) return cached_;
  const std::string what = "'" + e.key + "', a chunk at offsets " + c10::str(c10::IntArrayRef(c.offsets));
  std::vector<char> blob = read_bytes(c.file, c.offset, c.length, what);
  at::Tensor t;
  int64_t numel = 1;
  for (int64_t s : c.sizes) numel *= s;
  if (blob.size() >= 4 && blob[0] == 'P' && blob[1] == 'K' && blob[2] == 3 && blob[3] == 4) {  // a torch.save zip
    try {
      c10::IValue v = load_torch_save(blob);
      TITAN_USER_CHECK(v.isTensor(), describe(), ": ", c.file, " holds no tensor for ", what);
      t = v.toTensor();
    } catch (const UserError&) {
      throw;
    } catch (const std::exception& ex) {
      throw UserError(detail::concat(describe(), ": ", c.file, " is damaged at byte ", c.offset, " (", what, "): ",
                                     std::string(ex.what()).substr(0, 300)));
    }
  } else {  // raw bytes (DCP's non-torch.save serialization)
    TITAN_USER_CHECK(static_cast<int64_t>(blob.size()) == numel * static_cast<int64_t>(c10::elementSize(e.meta.dtype)),
                     describe(), ": ", c.file, " at byte ", c.offset, " holds ", blob.size(), " bytes for ", what,
                     ", which is neither a torch.save blob nor its raw data");
    t = at::empty(c.sizes, at::TensorOptions().dtype(e.meta.dtype));
    std::memcpy(t.data_ptr(), blob.data(), blob.size());
  }
  TITAN_USER_CHECK(t.scalar_type() == e.meta.dtype && t.sizes().vec() == c.sizes, describe(), ": ", c.file, " holds a ",
                   c10::toString(t.scalar_type()), " tensor of size ", t.sizes(), " for ", what, ", whose metadata says ",
                   c10::toString(e.meta.dtype), " of size ", c10::IntArrayRef(c.sizes));
  cached_key_ = where;
  cached_ = t;
  return t;
}

at::Tensor DcpSource::read(const std::string& name, const std::vector<int64_t>& begin, const std::vector<int64_t>& length) {
  auto it = tensors_.find(name);
  TITAN_USER_CHECK(it != tensors_.end(), describe(), " holds no tensor for ", name);
  const Entry& e = it->second;
  TITAN_USER_CHECK(begin.size() == e.meta.shape.size() && length.size() == e.meta.shape.size(), describe(), ": block of ",
                   name, " has the wrong rank");
  at::Tensor out = at::empty(length, at::TensorOptions().dtype(e.meta.dtype));
  // Which elements a chunk wrote: every one exactly once (chunks that overlap, or leave a gap, are a
  // damaged checkpoint).
  at::Tensor written = at::zeros(length, at::TensorOptions().dtype(at::kBool));
  for (const Chunk& c : e.chunks) {
    std::vector<int64_t> lo(begin.size()), n(begin.size());
    bool overlaps = true;
    for (size_t d = 0; d < begin.size(); ++d) {
      lo[d] = std::max(begin[d], c.offsets[d]);
      const int64_t hi = std::min(begin[d] + length[d], c.offsets[d] + c.sizes[d]);
      n[d] = hi - lo[d];
      overlaps = overlaps && n[d] > 0;
    }
    if (!overlaps && !begin.empty()) continue;
    const at::Tensor chunk = load_chunk(e, c);
    std::vector<int64_t> in_chunk(begin.size()), in_out(begin.size());
    for (size_t d = 0; d < begin.size(); ++d) {
      in_chunk[d] = lo[d] - c.offsets[d];
      in_out[d] = lo[d] - begin[d];
    }
    at::Tensor seen = block_of(written, in_out, n);
    TITAN_USER_CHECK(!seen.any().item<bool>(), describe(), ": chunks of '", e.key, "' overlap (the one at offsets ",
                     c10::IntArrayRef(c.offsets), " among them): the metadata is damaged");
    seen.fill_(true);
    block_of(out, in_out, n).copy_(block_of(chunk, in_chunk, n));
  }
  TITAN_USER_CHECK(written.all().item<bool>(), describe(), ": the chunks of '", e.key, "' leave ",
                   (~written).sum().item<int64_t>(), " of the elements asked for uncovered: the metadata is damaged");
  return out;
}

int64_t DcpSource::num_files() const {
  std::set<std::string> files;
  for (const auto& [name, e] : tensors_)
    for (const auto& c : e.chunks) files.insert(c.file);
  for (const auto& [key, b] : values_) files.insert(b.file);
  return static_cast<int64_t>(files.size());
}

std::vector<std::string> DcpSource::contents() const {
  std::vector<std::string> out;
  bool model = false, optimizer = false;
  for (const auto& [name, e] : tensors_) {
    model = model || starts_with(name, "model.");
    optimizer = optimizer || starts_with(name, "optimizer.");
  }
  if (model) out.push_back("model");
  if (optimizer) out.push_back("optimizer");
  if (has_value("lr_scheduler.last_epoch")) out.push_back("lr_scheduler");
  if (has_value("train_state.step")) out.push_back("train_state");
  return out;
}

std::optional<double> DcpSource::scalar(const std::string& key) {
  if (auto t = scalar_tensors_.find(key); t != scalar_tensors_.end())
    return load_chunk(t->second, t->second.chunks.at(0)).item<double>();
  auto it = values_.find(key);
  if (it == values_.end()) return std::nullopt;
  std::vector<char> blob = read_bytes(it->second.file, it->second.offset, it->second.length, "'" + key + "'");
  try {
    const c10::IValue v = load_torch_save(blob);
    if (v.isInt()) return static_cast<double>(v.toInt());
    if (v.isDouble()) return v.toDouble();
    if (v.isBool()) return v.toBool() ? 1.0 : 0.0;
    if (v.isTensor() && v.toTensor().numel() == 1 && !v.toTensor().is_complex()) return v.toTensor().item<double>();
  } catch (const std::exception& ex) {
    throw UserError(detail::concat(describe(), ": the value of '", key, "' in ", it->second.file,
                                   " is not readable: ", std::string(ex.what()).substr(0, 300)));
  }
  return std::nullopt;
}

nlohmann::json DcpSource::state(int64_t dp_degree_if_unrecorded) {
  nlohmann::json s = nlohmann::json::object();
  auto as_integer = [&](const std::string& key) -> std::optional<int64_t> {
    const std::optional<double> v = scalar(key);
    if (!v || *v < 0 || *v >= 0x1p63 || *v != std::floor(*v)) return std::nullopt;
    return static_cast<int64_t>(*v);
  };
  auto integer = [&](const std::string& key) {
    const std::optional<int64_t> v = as_integer(key);
    TITAN_USER_CHECK(v.has_value(), describe(), ": '", key, "' is not a non-negative integer");
    return *v;
  };
  if (has_value("train_state.step")) {
    const int64_t tokens = has_value("train_state.ntokens_seen") ? integer("train_state.ntokens_seen") : 0;
    // The record is another program's (a data loader's): one that is not a degree is not used.
    int64_t dp_degree = dp_degree_if_unrecorded;
    for (const char* key : kRecordedDpDegree)
      if (has_value(key)) {
        if (const std::optional<int64_t> d = as_integer(key); d && *d >= 1) dp_degree = *d;
        break;
      }
    int64_t seen = 0;
    TITAN_USER_CHECK(!__builtin_mul_overflow(tokens, dp_degree, &seen), describe(), ": 'train_state.ntokens_seen' (",
                     tokens, ") times the data-parallel degree ", dp_degree, " does not fit 64 bits");
    s["train_state"] = {{"step", integer("train_state.step")}, {"ntokens_seen", seen}, {"dp_degree", dp_degree}};
  }
  if (has_value("lr_scheduler.last_epoch")) s["lr_scheduler"] = {{"step", integer("lr_scheduler.last_epoch")}};
  return s;
}

std::map<std::string, double> DcpSource::optimizer_hyperparameters() {
  std::map<std::string, double> out;
  std::string first;  // the first parameter with a saved group
  for (const auto& [key, b] : values_)
    if (starts_with(key, "optimizer.param_groups.") && ends_with(key, ".lr")) {
      first = key.substr(0, key.size() - 3);
      break;
    }
  if (first.empty()) return out;
  for (const std::string h : {"lr", "initial_lr", "eps", "weight_decay", "decoupled_weight_decay", "fused", "foreach"})
    if (auto v = scalar(first + "." + h)) out[h] = *v;
  auto it = values_.find(first + ".betas");
  if (it != values_.end()) {
    std::vector<char> blob = read_bytes(it->second.file, it->second.offset, it->second.length, "'" + first + ".betas'");
    try {
      c10::IValue v = load_torch_save(blob);
      if (v.isTuple() && v.toTupleRef().elements().size() == 2) {
        out["beta1"] = v.toTupleRef().elements()[0].toDouble();
        out["beta2"] = v.toTupleRef().elements()[1].toDouble();
      }
    } catch (const std::exception&) {
    }
  }
  return out;
}

std::string DcpSource::unread_summary() const {
  std::map<std::string, int> by_part;
  auto part = [](const std::string& key) {
    if (starts_with(key, "optimizer.param_groups.")) return std::string("optimizer.param_groups");
    return key.substr(0, key.find('.'));
  };
  for (const auto& k : unread_) by_part[part(k)]++;
  static const std::set<std::string> read_values = {"train_state.step", "train_state.ntokens_seen",
                                                    "lr_scheduler.last_epoch", kRecordedDpDegree[0],
                                                    kRecordedDpDegree[1]};
  for (const auto& [k, b] : values_)
    if (!read_values.count(k)) by_part[part(k)]++;
  std::string out;
  for (const auto& [p, n] : by_part)
    out += (out.empty() ? "" : ", ") + p + " (" + std::to_string(n) + (n == 1 ? " key)" : " keys)");
  return out;
}

namespace {

constexpr const char* kDcpModule = "torch.distributed.checkpoint.metadata";
constexpr const char* kDcpDataFile = "__0_0.distcp";

std::string torch_dtype_name(at::ScalarType t) {
  for (const auto& [name, type] : dtypes())
    if (type == t) return name.substr(std::string("torch.").size());
  throw UserError(std::string("a torch.distributed.checkpoint cannot record a tensor of dtype ") + c10::toString(t));
}

// torch.Size((d0, d1, ...)).
void write_size(pickle::Writer& w, const std::vector<int64_t>& dims) {
  w.global_("torch", "Size");
  w.mark();
  w.mark();
  for (int64_t d : dims) w.integer(d);
  w.tuple();
  w.tuple();
  w.reduce();
}

// A dataclass of DCP: module.name(), then its fields (the caller writes key, value pairs) and BUILD.
template <class Fields>
void write_dataclass(pickle::Writer& w, const char* module, const char* name, const Fields& fields) {
  w.global_(module, name);
  w.empty_tuple();
  w.newobj();
  w.empty_dict();
  w.mark();
  fields();
  w.setitems();
  w.build();
}

}  // namespace

DcpWriter::DcpWriter(std::string dir) : dir_(std::move(dir)) {
  namespace fs = std::filesystem;
  TITAN_USER_CHECK(!fs::exists(dir_), dir_, " already exists: choose a new folder for the torch.distributed.checkpoint");
  std::error_code ec;
  fs::create_directories(dir_, ec);
  TITAN_USER_CHECK(!ec, "cannot create ", dir_, ": ", ec.message());
  data_ = std::make_unique<std::ofstream>(fs::path(dir_) / kDcpDataFile, std::ios::binary);
  if (!data_->good()) {
    data_.reset();
    fs::remove_all(dir_, ec);
    throw UserError("cannot write " + (fs::path(dir_) / kDcpDataFile).string());
  }
}

DcpWriter::~DcpWriter() {
  if (finished_) return;
  data_.reset();
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);  // an unfinished folder is no checkpoint: leave nothing behind
}

namespace {
std::string joined(const std::vector<std::string>& path) {
  std::string key;
  for (const auto& p : path) key += (key.empty() ? "" : ".") + p;
  return key;
}
}  // namespace

void DcpWriter::append(Item item, const std::function<void(const std::function<size_t(const void*, size_t)>&)>& write) {
  item.offset = written_;
  int64_t length = 0;
  try {
    write([&](const void* bytes, size_t n) {
      data_->write(static_cast<const char*>(bytes), static_cast<std::streamsize>(n));
      length += static_cast<int64_t>(n);
      return data_->good() ? n : 0;
    });
  } catch (const UserError&) {
    throw UserError("writing " + item.key + " to " + dir_ + " failed (disk full?)");
  }
  item.length = length;
  written_ += item.length;
  items_.push_back(std::move(item));
}

void DcpWriter::add(const std::vector<std::string>& path, const at::Tensor& tensor) {
  TITAN_USER_CHECK(data_, "torch.distributed.checkpoint ", dir_, " is already finished");
  const at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
  const std::string key = joined(path);
  Item item{key, path, false, t.scalar_type(), t.sizes().vec(), 0, 0};
  torch_dtype_name(item.dtype);  // a dtype DCP's metadata can name
  const TorchSaveEntry entry{key, item.dtype, item.shape, std::nullopt};
  // One torch.save blob, as DCP's FileSystemWriter writes each tensor.
  append(std::move(item), [&](const auto& sink) {
    write_torch_save(sink, {entry}, /*as_dict=*/false, [&](size_t) { return t; });
  });
}

void DcpWriter::add_object(const std::vector<std::string>& path, const std::function<void(pickle::Writer&)>& write) {
  TITAN_USER_CHECK(data_, "torch.distributed.checkpoint ", dir_, " is already finished");
  pickle::Writer w;
  write(w);
  const std::string pickled = w.finish();
  append(Item{joined(path), path, true, at::kByte, {}, 0, 0},
         [&](const auto& sink) { write_torch_save_archive(sink, pickled, 0, nullptr); });
}

void DcpWriter::add_alias(const std::vector<std::string>& path, const std::string& existing) {
  TITAN_ASSERT(data_, "DcpWriter: ", dir_, " is already finished");
  const std::string key = joined(path);
  TITAN_ASSERT(std::none_of(items_.begin(), items_.end(), [&](const Item& i) { return i.key == key; }),
               "DcpWriter: ", key, " added twice");
  const auto it = std::find_if(items_.begin(), items_.end(), [&](const Item& i) { return i.key == existing; });
  TITAN_ASSERT(it != items_.end(), "DcpWriter: ", existing, " was not added");
  Item alias = *it;
  alias.key = key;
  alias.path = path;
  items_.push_back(std::move(alias));
}

void DcpWriter::finish() {
  namespace fs = std::filesystem;
  TITAN_USER_CHECK(data_, "torch.distributed.checkpoint ", dir_, " is already finished");
  data_->close();
  TITAN_USER_CHECK(!data_->fail(), "writing ", (fs::path(dir_) / kDcpDataFile).string(), " failed");
  data_.reset();
  // Metadata(state_dict_metadata={key: TensorStorageMetadata}, planner_data={key: (key,)},
  //          storage_data={MetadataIndex(key, offsets): _StorageInfo(file, offset, length)},
  //          storage_meta=None, version="1.0.0")
  pickle::Writer w;
  write_dataclass(w, kDcpModule, "Metadata", [&] {
    w.string("state_dict_metadata");
    w.empty_dict();
    w.mark();
    for (const Item& it : items_) {
      w.string(it.key);
      if (it.object) {
        write_dataclass(w, kDcpModule, "BytesStorageMetadata", [] {});
        continue;
      }
      write_dataclass(w, kDcpModule, "TensorStorageMetadata", [&] {
        w.string("properties");
        // TensorProperties' state is a tuple: dtype, layout, requires_grad, memory_format, pin_memory.
        w.global_(kDcpModule, "TensorProperties");
        w.empty_tuple();
        w.newobj();
        w.mark();
        w.global_("torch", torch_dtype_name(it.dtype));
        w.global_("torch.serialization", "_get_layout");
        w.mark();
        w.string("torch.strided");
        w.tuple();
        w.reduce();
        w.boolean(false);
        w.global_(kDcpModule, "_MEM_FORMAT_ENCODING");
        w.mark();
        w.integer(0);  // torch.contiguous_format
        w.tuple();
        w.reduce();
        w.boolean(false);
        w.tuple();
        w.build();
        w.string("size");
        write_size(w, it.shape);
        w.string("chunks");
        w.empty_list();
        w.mark();
        write_dataclass(w, kDcpModule, "ChunkStorageMetadata", [&] {
          w.string("offsets");
          write_size(w, std::vector<int64_t>(it.shape.size(), 0));
          w.string("sizes");
          write_size(w, it.shape);
        });
        w.appends();
      });
    }
    w.setitems();
    w.string("planner_data");
    w.empty_dict();
    w.mark();
    for (const Item& it : items_) {  // the path of each key in the nested state dict
      w.string(it.key);
      w.mark();
      for (const auto& p : it.path) w.string(p);
      w.tuple();
    }
    w.setitems();
    w.string("storage_data");
    w.empty_dict();
    w.mark();
    for (const Item& it : items_) {
      write_dataclass(w, kDcpModule, "MetadataIndex", [&] {
        w.string("fqn");
        w.string(it.key);
        if (!it.object) {  // a bytes item's index keeps the class default (None) for its offset
          w.string("offset");
          write_size(w, std::vector<int64_t>(it.shape.size(), 0));
        }
        w.string("index");
        if (it.object)
          w.none();
        else
          w.integer(0);
      });
      write_dataclass(w, "torch.distributed.checkpoint.filesystem", "_StorageInfo", [&] {
        w.string("relative_path");
        w.string(kDcpDataFile);
        w.string("offset");
        w.integer(it.offset);
        w.string("length");
        w.integer(it.length);
        w.string("transform_descriptors");
        w.none();
      });
    }
    w.setitems();
    w.string("storage_meta");
    w.none();
    w.string("version");
    w.string("1.0.0");
  });
  const std::string metadata = w.finish();
  const fs::path tmp = fs::path(dir_) / (std::string(kDcpMetadataFile) + ".tmp");
  {
    std::ofstream out(tmp, std::ios::binary);
    out.write(metadata.data(), static_cast<std::streamsize>(metadata.size()));
    out.close();
    TITAN_USER_CHECK(!out.fail(), "writing ", tmp.string(), " failed");
  }
  fs::rename(tmp, fs::path(dir_) / kDcpMetadataFile);
  finished_ = true;
}

void write_torch_save(const std::function<size_t(const void*, size_t)>& sink, const std::vector<TorchSaveEntry>& entries,
                      bool as_dict, const std::function<at::Tensor(size_t)>& fetch) {
  TITAN_ASSERT(as_dict || entries.size() == 1, "write_torch_save: one tensor, or a dict");
  pickle::Writer w;
  if (as_dict) {
    w.empty_dict();
    w.mark();
  }
  for (size_t i = 0; i < entries.size(); ++i) {
    const TorchSaveEntry& e = entries[i];
    const size_t storage = e.same_as.value_or(i);
    if (e.same_as) {
      const TorchSaveEntry& target = entries.at(storage);
      TITAN_ASSERT(storage < i && !target.same_as && target.dtype == e.dtype && target.shape == e.shape,
                   "write_torch_save: ", e.name, " must share an earlier entry's storage of its dtype and shape");
    }
    int64_t numel = 1;
    for (int64_t d : e.shape) numel *= d;
    if (as_dict) w.string(e.name);
    w.global_("torch._utils", "_rebuild_tensor_v2");
    w.mark();
    w.mark();  // the storage: persistent_load(('storage', type, key, location, numel))
    w.string("storage");
    w.global_("torch", std::string(c10::toString(e.dtype)) + "Storage");
    w.string(std::to_string(storage));
    w.string("cpu");
    w.integer(numel);
    w.tuple();
    w.persid();
    w.integer(0);  // storage offset
    w.mark();
    for (int64_t d : e.shape) w.integer(d);
    w.tuple();
    w.mark();
    std::vector<int64_t> strides(e.shape.size());
    int64_t stride = 1;
    for (size_t k = e.shape.size(); k-- > 0;) {
      strides[k] = stride;
      stride *= e.shape[k];
    }
    for (int64_t s : strides) w.integer(s);
    w.tuple();
    w.boolean(false);  // requires_grad
    w.global_("collections", "OrderedDict");  // backward hooks: none
    w.empty_tuple();
    w.reduce();
    w.tuple();
    w.reduce();
  }
  if (as_dict) w.setitems();
  write_torch_save_archive(sink, w.finish(), entries.size(), [&](size_t i) -> std::optional<at::Tensor> {
    if (entries[i].same_as) return std::nullopt;
    const at::Tensor t = fetch(i);
    TITAN_ASSERT(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == entries[i].dtype &&
                     t.sizes() == at::IntArrayRef(entries[i].shape),
                 "write_torch_save: ", entries[i].name, " is not the declared contiguous CPU tensor");
    return t;
  });
}

void write_torch_save_archive(const std::function<size_t(const void*, size_t)>& sink, const std::string& pickled,
                              size_t records, const std::function<std::optional<at::Tensor>(size_t)>& record) {
  // The sink's failures are remembered, not reported to the archive writer: it would throw from
  // writeRecord and again from its destructor while unwinding (std::terminate). The caller's sink
  // is checked once the archive is complete.
  bool failed = false;
  caffe2::serialize::PyTorchStreamWriter archive([&](const void* bytes, size_t n) -> size_t {
    if (!failed && sink(bytes, n) != n) failed = true;
    return n;
  });
  archive.writeRecord("data.pkl", pickled.data(), pickled.size());
  archive.writeRecord("byteorder", "little", 6);
  for (size_t i = 0; i < records; ++i)
    if (const std::optional<at::Tensor> t = record(i))
      archive.writeRecord("data/" + std::to_string(i), t->data_ptr(), t->nbytes());
  archive.writeEndOfFile();
  TITAN_USER_CHECK(!failed, "writing the torch.save data failed (disk full?)");
}

}  // namespace titan::checkpoint
