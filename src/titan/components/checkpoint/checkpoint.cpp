// Writing titan's checkpoint format (checkpoint.h): snapshots, the choice of writers, each rank's data
// file and slice index, and rank 0's index. Reading is checkpoint_read.cpp.
#include "titan/components/checkpoint/checkpoint.h"

#include "titan/common/error.h"
#include "titan/components/checkpoint/file_io.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <numeric>

namespace titan::checkpoint {
namespace fs = std::filesystem;

namespace {

class SingleProcess : public Coordinator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::vector<std::string> gather(const std::string& record) override { return {record}; }
  std::string broadcast(const std::string& message) override { return message; }
};

std::string stem_of(const char* kind, int64_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s-%05lld", kind, static_cast<long long>(n));
  return buf;
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// What one data file holds, as a 64-bit FNV-1a hash of its tensors' names, dtypes and global shapes (in
// name order): files with equal hashes hold the same tensors, so rank 0 reads one slice index per hash.
uint64_t contents_hash(const nlohmann::json& slices) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](const std::string& text) {
    for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;  // separator
  };
  for (const auto& [name, s] : slices.items()) {
    mix(name);
    mix(s.at("dtype").dump());
    mix(s.at("shape").dump());
  }
  return h;
}

// What rank 0 learns from each rank about its part of a save: a fixed-size record, so that the gather
// is one collective of world x 256 bytes (names and slices stay in the rank's own slice index).
struct Record {
  enum : int64_t { kWrote = 1, kNothing = 2, kFailed = 3 };
  int64_t status = kNothing;
  int64_t data_bytes = 0, data_crc32 = 0, index_bytes = 0, index_crc32 = 0;
  uint64_t contents = 0;  // contents_hash of its slice index
  int64_t elements = 0;   // entries of all its slices
  int64_t reserved = 0;
  char error[192] = {};   // the start of its error message when it failed

  std::string bytes() const { return std::string(reinterpret_cast<const char*>(this), sizeof(Record)); }
  static Record from(const std::string& b) {
    TITAN_ASSERT(b.size() == sizeof(Record), "checkpoint record of ", b.size(), " bytes");
    Record r;
    std::memcpy(&r, b.data(), sizeof r);
    r.error[sizeof r.error - 1] = '\0';
    return r;
  }
};
static_assert(sizeof(Record) == 256);

struct Shard {
  std::string stem;  // "rank-00003": rank-00003.safetensors and rank-00003.slices.json
  Record record;
};

// The slice index of data file `stem`.safetensors holding `slices` with CRC-32s `crcs`, and the record
// its rank reports (all but the data file's size and CRC-32).
std::pair<std::string, Record> slice_index(const std::string& stem, const std::vector<Snapshot::Slice>& slices,
                                           const std::vector<uint32_t>& crcs) {
  nlohmann::json index_slices = nlohmann::json::object();
  Record r;
  r.status = Record::kWrote;
  for (size_t i = 0; i < slices.size(); ++i) {
    const auto& s = slices[i];
    index_slices[s.name] = {{"dtype", dtype_name(s.stored_dtype())},
                            {"shape", s.global_shape},
                            {"begin", s.begin},
                            {"length", s.data.sizes().vec()},
                            {"crc32", crcs[i]}};
    r.elements += s.data.numel();
  }
  std::string text = nlohmann::json{{"format", "titan-checkpoint-slices"}, {"version", 1},
                                    {"data", stem + ".safetensors"}, {"slices", index_slices}}
                         .dump();
  r.index_bytes = static_cast<int64_t>(text.size());
  r.index_crc32 = string_crc32(text);
  r.contents = contents_hash(index_slices);
  return {std::move(text), r};
}

// Writes `slices` as `stem`.safetensors in `dir` (its metadata says where each slice sits in its tensor,
// for tools that read the file alone) and `stem`.slices.json, its slice index.
Record write_shard(const fs::path& dir, const std::string& stem, const std::vector<Snapshot::Slice>& slices) {
  std::vector<SafetensorsEntry> entries;
  nlohmann::json where = nlohmann::json::object();
  for (const auto& s : slices) {
    entries.push_back({s.name, s.data, s.store_as});
    where[s.name] = {{"global_shape", s.global_shape}, {"begin", s.begin}};
  }
  const WrittenFile written = write_safetensors((dir / (stem + ".safetensors")).string(), entries,
                                                {{"format", "pt"}, {"titan_slices", where.dump()}});
  auto [text, r] = slice_index(stem, slices, written.entry_crc32);
  write_file_atomically((dir / (stem + kSlicesSuffix)).string(), text);
  r.data_bytes = written.bytes;
  r.data_crc32 = written.crc32;
  return r;
}

std::mutex g_cost_mutex;  // a background save writes the cost
IndexCost g_last_index_cost;

// The index of a save from every rank's record: one slice index per distinct contents is read (through
// `read_slice_index`, given the file's number) to learn which tensors each file holds.
std::string build_index(const std::vector<Shard>& shards, const std::function<std::string(size_t)>& read_slice_index,
                        const std::string& where, const nlohmann::json& info, const nlohmann::json& state_in,
                        IndexCost& cost) {
  nlohmann::json files = nlohmann::json::object(), stems = nlohmann::json::array();
  std::map<uint64_t, std::vector<int64_t>> by_contents;
  int64_t written_elements = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    const Shard& s = shards[i];
    files[s.stem + ".safetensors"] = {{"bytes", s.record.data_bytes}, {"crc32", static_cast<uint32_t>(s.record.data_crc32)}};
    files[s.stem + kSlicesSuffix] = {{"bytes", s.record.index_bytes}, {"crc32", static_cast<uint32_t>(s.record.index_crc32)}};
    stems.push_back(s.stem);
    by_contents[s.record.contents].push_back(static_cast<int64_t>(i));
    written_elements += s.record.elements;
  }
  struct TensorEntry {
    nlohmann::json dtype, shape;
    std::vector<int64_t> shards;
  };
  std::map<std::string, TensorEntry> tensors;
  for (const auto& [contents, ids] : by_contents) {
    const Shard& first = shards[static_cast<size_t>(ids.front())];
    const std::string text = read_slice_index(static_cast<size_t>(ids.front()));
    cost.slice_index_bytes_read += static_cast<int64_t>(text.size());
    TITAN_USER_CHECK(string_crc32(text) == static_cast<uint32_t>(first.record.index_crc32), "checkpoint ", where, ": ",
                     first.stem, kSlicesSuffix, " changed after it was written (its CRC-32 differs)");
    const nlohmann::json slices = nlohmann::json::parse(text).at("slices");
    TITAN_ASSERT(contents_hash(slices) == contents, "the contents of ", first.stem, " differ from what its rank reported");
    for (const auto& [name, s] : slices.items()) {
      TensorEntry& t = tensors[name];
      if (t.shards.empty()) {
        t.dtype = s.at("dtype");
        t.shape = s.at("shape");
      }
      TITAN_ASSERT(t.dtype == s.at("dtype") && t.shape == s.at("shape"), "ranks disagree on the dtype or shape of ", name);
      t.shards.insert(t.shards.end(), ids.begin(), ids.end());
    }
  }
  // The entries written add up to the tensors written (a piece written by two holders, or a piece of a
  // written tensor that no holder wrote, shows here; a tensor nobody wrote is missing at load time).
  int64_t expected = 0;
  for (const auto& [name, t] : tensors) expected += numel_of(t.shape.get<std::vector<int64_t>>());
  TITAN_ASSERT(expected == written_elements, "the ranks wrote ", written_elements, " entries but the tensors of ",
               where, " have ", expected);

  nlohmann::json tensors_json = nlohmann::json::object();
  for (auto& [name, t] : tensors) {
    std::sort(t.shards.begin(), t.shards.end());
    nlohmann::json ranges = nlohmann::json::array();  // [first, last + 1) runs of file numbers
    for (size_t i = 0; i < t.shards.size();) {
      size_t j = i + 1;
      while (j < t.shards.size() && t.shards[j] == t.shards[j - 1] + 1) ++j;
      ranges.push_back({t.shards[i], t.shards[j - 1] + 1});
      i = j;
    }
    tensors_json[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"shards", ranges}};
  }
  const nlohmann::json state = state_in.is_null() ? nlohmann::json::object() : state_in;
  // What the checkpoint is and the non-tensor state (step, data position) have their own CRC-32: a
  // damaged digit would otherwise resume silently at the wrong place.
  const nlohmann::json index = {{"format", "titan-checkpoint"}, {"version", kFormatVersion}, {"info", info},
                                {"state", state}, {"info_state_crc32", string_crc32(info.dump() + "\n" + state.dump())},
                                {"files", files}, {"shards", stems}, {"tensors", tensors_json}};
  std::string text = index.dump(1);
  cost.index_bytes = static_cast<int64_t>(text.size());
  return text;
}

// Rank 0, once every file is written: checks that it sees every file with the size its writer
// reported (the folder must be shared by all ranks), writes the index last and makes the folder
// visible as `step_dir`.
void write_index(const fs::path& tmp_dir, const fs::path& step_dir, const std::vector<Shard>& shards,
                 const nlohmann::json& info, const nlohmann::json& state) {
  for (const Shard& s : shards) {
    for (const auto& [name, bytes] : {std::pair{s.stem + ".safetensors", s.record.data_bytes},
                                      std::pair{s.stem + kSlicesSuffix, s.record.index_bytes}}) {
      std::error_code ec;
      const auto seen = fs::file_size(tmp_dir / name, ec);
      TITAN_USER_CHECK(!ec && static_cast<int64_t>(seen) == bytes, "checkpoint ", step_dir.string(), ": rank 0 ",
                       ec ? "does not see " : "sees a different size of ", (tmp_dir / name).string(), " (",
                       bytes, " bytes written", ec ? "" : ", " + std::to_string(seen) + " seen",
                       "): the checkpoint folder must be on a file system that every rank shares (a network or "
                       "parallel file system, not node-local disks); set job.dump_folder to such a folder");
    }
  }
  IndexCost cost;
  cost.gathered_bytes = static_cast<int64_t>(shards.size() * sizeof(Record));
  const std::string text = build_index(
      shards, [&](size_t i) { return read_file((tmp_dir / (shards[i].stem + kSlicesSuffix)).string()); },
      step_dir.string(), info, state, cost);
  write_file_atomically((tmp_dir / kIndexFile).string(), text);
  sync_directory(tmp_dir.string());
  {
    std::lock_guard<std::mutex> lock(g_cost_mutex);
    g_last_index_cost = cost;
  }
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

std::unique_ptr<Coordinator> single_process_coordinator() { return std::make_unique<SingleProcess>(); }

IndexCost last_index_cost() {
  std::lock_guard<std::mutex> lock(g_cost_mutex);
  return g_last_index_cost;
}

// ---------------------------------------------------------------------------------------------
// Snapshots and writers

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
    if (!o.copy && real.is_contiguous()) {
      s.data = real;  // FSDP's real part is a leading run of rows: contiguous
      if (dtype != real.scalar_type()) s.store_as = dtype;
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

void assign_writers(std::vector<dist::PlacedTensor>& tensors,
                    const std::function<std::pair<int, int>(const std::string&)>& member) {
  // Pieces are balanced within each set of replica dimensions: every holder of such a piece holds the
  // same set of pieces with the same replica dimensions, so each computes the same assignment.
  std::map<std::vector<std::string>, std::vector<size_t>> classes;
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::vector<std::string> dims = tensors[i].placement.replicated;
    if (dims.empty()) continue;
    std::sort(dims.begin(), dims.end());
    classes[dims].push_back(i);
  }
  for (auto& [dims, items] : classes) {
    int64_t holders = 1, me = 0;  // this rank's number among the holders (mixed radix over dims)
    for (const auto& d : dims) {
      const auto [index, size] = member(d);
      me = me * size + index;
      holders *= size;
    }
    auto bytes = [&](size_t i) {
      return tensors[i].placement.real_numel() * static_cast<int64_t>(tensors[i].local.element_size());
    };
    std::sort(items.begin(), items.end(), [&](size_t a, size_t b) {
      return bytes(a) != bytes(b) ? bytes(a) > bytes(b) : tensors[a].name < tensors[b].name;
    });
    std::vector<int64_t> load(static_cast<size_t>(holders), 0);
    for (size_t i : items) {
      const auto w = static_cast<int64_t>(std::min_element(load.begin(), load.end()) - load.begin());
      load[static_cast<size_t>(w)] += bytes(i);
      tensors[i].placement.primary = w == me;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Writing a save

MetadataSimulation simulate_metadata(int world, const std::function<std::vector<Snapshot::Slice>(int)>& slices_of) {
  MetadataSimulation out;
  std::vector<Shard> shards;
  std::vector<std::string> texts;  // every rank's slice index (rank 0 reads one per distinct contents)
  out.slice_index_bytes.assign(static_cast<size_t>(world), 0);
  for (int r = 0; r < world; ++r) {
    const auto slices = slices_of(r);
    if (slices.empty()) continue;
    auto [text, record] = slice_index(stem_of("rank", r), slices, std::vector<uint32_t>(slices.size(), 0xffffffffu));
    out.slice_index_bytes[static_cast<size_t>(r)] = record.index_bytes;
    shards.push_back({stem_of("rank", r), record});
    texts.push_back(std::move(text));
  }
  const auto start = std::chrono::steady_clock::now();
  out.cost.gathered_bytes = static_cast<int64_t>(static_cast<size_t>(world) * sizeof(Record));
  out.index = build_index(shards, [&](size_t i) { return texts[i]; }, "simulation", nlohmann::json::object(),
                          nlohmann::json::object(), out.cost);
  out.rank0_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

int64_t write(const std::string& step_dir_in, const Snapshot& snap, Coordinator& coord,
              const std::function<void()>& rank0_before_index) {
  const fs::path step_dir = fs::path(step_dir_in).lexically_normal();
  const fs::path tmp_dir = step_dir.string() + ".partial";
  // This rank's slices as one file and its slice index. A rank that cannot write still reports to
  // rank 0 (which then fails the save on every rank with its reason instead of waiting for it).
  Record mine;
  std::string my_error;
  try {
    create_partial_dir(step_dir);
    if (!snap.slices.empty()) mine = write_shard(tmp_dir, stem_of("rank", coord.rank()), snap.slices);
  } catch (const std::exception& e) {
    my_error = e.what();
    mine = Record();
    mine.status = Record::kFailed;
    std::strncpy(mine.error, my_error.c_str(), sizeof mine.error - 1);
  }
  if (my_error.empty()) crash_point("index");
  const std::vector<std::string> all = coord.gather(mine.bytes());
  std::string outcome;  // empty: the checkpoint is complete
  if (coord.rank() == 0) {
    try {
      std::vector<Shard> shards;
      for (size_t rank = 0; rank < all.size(); ++rank) {
        const Record r = Record::from(all[rank]);
        TITAN_USER_CHECK(r.status != Record::kFailed, "checkpoint ", step_dir.string(), " is incomplete: rank ",
                         rank, " could not write its part: ", r.error);
        if (r.status == Record::kWrote) shards.push_back({stem_of("rank", static_cast<int64_t>(rank)), r});
      }
      if (rank0_before_index) rank0_before_index();
      write_index(tmp_dir, step_dir, shards, snap.info, snap.state);
    } catch (const std::exception& e) {
      outcome = e.what();
    }
  }
  // No rank returns (and enters the next training collective) before the save is complete everywhere.
  outcome = coord.broadcast(outcome);
  if (!my_error.empty()) throw UserError(my_error);
  if (!outcome.empty()) throw UserError(outcome);
  return mine.status == Record::kWrote ? mine.data_bytes + mine.index_bytes : 0;
}

void write_single_process(const std::string& step_dir_in, const std::vector<std::string>& names,
                          const std::function<at::Tensor(const std::string&)>& fetch, const nlohmann::json& info,
                          const nlohmann::json& state, int64_t max_file_bytes) {
  const fs::path step_dir = fs::path(step_dir_in).lexically_normal();
  const fs::path tmp_dir = create_partial_dir(step_dir);
  std::vector<Shard> shards;
  std::vector<Snapshot::Slice> pending;
  int64_t pending_bytes = 0;
  auto flush = [&] {
    if (pending.empty()) return;
    const std::string stem = stem_of("part", static_cast<int64_t>(shards.size()));
    shards.push_back({stem, write_shard(tmp_dir, stem, pending)});
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
  write_index(tmp_dir, step_dir, shards, info, state);
}

void write_single_process(const std::string& step_dir, const std::map<std::string, at::Tensor>& tensors,
                          const nlohmann::json& info, const nlohmann::json& state) {
  std::vector<std::string> names;
  for (const auto& [n, t] : tensors) names.push_back(n);
  write_single_process(step_dir, names, [&](const std::string& n) { return tensors.at(n); }, info, state);
}

}  // namespace titan::checkpoint
