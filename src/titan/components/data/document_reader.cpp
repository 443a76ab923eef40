#include "titan/components/data/document_reader.h"

#include "titan/components/data/hub_configs.h"

#include "titan/common/error.h"
#include "titan/common/listing.h"
#include "titan/components/data/table_reader.h"

#include <nlohmann/json.hpp>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <fstream>

namespace titan::data {
namespace fs = std::filesystem;

namespace {

constexpr size_t kChunk = 1 << 20;  // bytes decompressed per read

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Hugging Face datasets' metadata, beside the data of save_to_disk and cache folders.
bool is_hf_metadata(const std::string& name) {
  return name == "dataset_info.json" || name == "dataset_infos.json" || name == "dataset_dict.json" ||
         name == "state.json";
}

bool is_data_file(const std::string& name) {
  if (is_table_file(name)) return true;
  if (is_hf_metadata(name)) return false;
  for (const char* ext : {".json", ".jsonl"})
    for (const char* z : {"", ".gz", ".zst"})
      if (ends_with(name, std::string(ext) + z)) return true;
  return false;
}

// Whether the file at relative path `rel` is named for split name `split` (the rule of list_data_files).
bool named_for(const fs::path& rel, const std::string& split) {
  for (const auto& part : rel) {
    const std::string c = part.string();
    if (c == split) return true;
    if (c.size() > split.size() && c.compare(0, split.size(), split) == 0) {
      const char next = c[split.size()];
      if (next == '-' || next == '.' || next == '_' || (next >= '0' && next <= '9')) return true;
    }
  }
  const std::string name = rel.filename().string();
  return name.find("-" + split + "-") != std::string::npos || name.find("-" + split + ".") != std::string::npos;
}

// The names a split goes by in datasets (the Pile's val.jsonl.zst, dev sets).
std::vector<std::string> split_names(const std::string& split) {
  if (split == "validation") return {"validation", "valid", "val", "dev"};
  return {split};
}

bool in_split(const fs::path& rel, const std::string& split) {
  for (const std::string& name : split_names(split))
    if (named_for(rel, name)) return true;
  return false;
}

// A Hugging Face Hub cache folder (datasets--org--name: blobs/, refs/main, snapshots/<rev>/ whose files
// link into blobs/) stands for the snapshot refs/main names, or its only one; other folders for themselves.
fs::path hub_snapshot(const fs::path& root) {
  std::error_code ec;
  const fs::path snapshots = root / "snapshots";
  if (!fs::is_directory(snapshots, ec) || !(fs::is_directory(root / "refs", ec) || fs::is_directory(root / "blobs", ec)))
    return root;
  if (std::ifstream ref(root / "refs" / "main"); ref) {
    std::string rev;
    std::getline(ref, rev);
    rev.erase(rev.find_last_not_of(" \t\r\n") + 1);
    TITAN_USER_CHECK(!rev.empty() && fs::is_directory(snapshots / rev, ec), "Hugging Face cache folder '", root.string(),
                     "': refs/main names revision '", rev, "' but snapshots/", rev,
                     " is missing (an incomplete download?): download it again, or set the dataset path to a folder "
                     "of snapshots/");
    return snapshots / rev;
  }
  std::vector<std::string> revs;
  std::error_code ec2;
  for (fs::directory_iterator e(snapshots, ec2), end; !ec2 && e != end; e.increment(ec2))
    if (e->is_directory(ec2)) revs.push_back(e->path().filename().string());
  TITAN_USER_CHECK(!ec2, "cannot list '", snapshots.string(), "': ", ec2.message());
  std::sort(revs.begin(), revs.end());
  TITAN_USER_CHECK(revs.size() == 1, "Hugging Face cache folder '", root.string(), "' has no refs/main and ",
                   revs.empty() ? std::string("no snapshot") : std::to_string(revs.size()) + " snapshots", revs.empty() ? "" : " (",
                   joined(revs), revs.empty() ? "" : ")", ": set the dataset path to the snapshot to read, snapshots/<revision>");
  return snapshots / revs.front();
}

// The folder part of a pattern, before its first wildcard ("sample/10BT/*" -> "sample/10BT").
std::string pattern_folder(const std::string& pattern) {
  const size_t wild = pattern.find_first_of("*?[");
  const std::string head = pattern.substr(0, wild);
  const size_t slash = head.rfind('/');
  return slash == std::string::npos ? "" : head.substr(0, slash);
}

constexpr const char* kAccepted =
    "expected .json or .jsonl files (one JSON object per line, optionally compressed as .gz or .zst), Parquet files "
    "(.parquet) or Arrow IPC files (.arrow, as Hugging Face datasets' save_to_disk writes)";

bool under(const fs::path& rel, const std::string& dir) {
  const std::string r = rel.generic_string(), d = fs::path(dir).lexically_normal().generic_string();
  return !d.empty() && r.size() > d.size() && r.compare(0, d.size(), d) == 0 && r[d.size()] == '/';
}

// Whether the file at `r` belongs to configuration c (any split).
bool belongs(const HubConfig& c, const fs::path& r) {
  if (!c.data_dir.empty() && under(r, c.data_dir)) return true;
  for (const auto& [split, pats] : c.files)
    for (const auto& p : pats)
      if (hub_pattern_matches(p, r.generic_string())) return true;
  return false;
}

// The folders (relative to the repository, normalized) that hold every file configuration c can
// name: its data_dir and the folder part of each pattern; "" when some pattern starts at the top.
std::set<std::string> config_folders(const HubConfig& c) {
  auto normal = [](const std::string& folder) {
    std::string f = fs::path(folder).lexically_normal().generic_string();
    while (!f.empty() && f.back() == '/') f.pop_back();
    return f == "." ? std::string() : f;
  };
  std::set<std::string> out;
  if (!c.data_dir.empty()) out.insert(normal(c.data_dir));
  for (const auto& [split, pats] : c.files)
    for (const auto& p : pats) out.insert(normal(pattern_folder(p)));
  return out;
}

// Narrows `rel` (relative to `where`) to split `split` by the names of the files and folders (see
// list_data_files); refuses a folder whose files are named for other splits only.
std::vector<fs::path> narrow_to_split(std::vector<fs::path> rel, const std::string& split, const fs::path& where) {
  std::vector<fs::path> of_split;
  for (const auto& r : rel)
    if (in_split(r, split)) of_split.push_back(r);
  if (!of_split.empty()) return of_split;
  std::set<std::string> others;
  for (const char* s : {"train", "validation", "test", "eval"})
    for (const auto& r : rel)
      if (s != split && in_split(r, s)) others.insert(s);
  TITAN_USER_CHECK(others.empty(), "dataset folder '", where.string(), "' holds files of the ", joined(others, " and "),
                   " split(s) but none of the ", split, " split (files or folders named ", joined(split_names(split), " or "),
                   "): set the dataset path to the ", split, " data");
  return rel;
}

// A Hugging Face dataset repository whose README.md declares configurations (hub_configs.h): of the
// configurations whose files are here, the one load_dataset reads by default (marked default, or
// named "default"), else the only one, else for allenai/c4 "en"; its files of `split`. Nullopt when
// the README declares none or none of them is here (the folder is then read by the other rules).
// `is_here(c)`: whether some file of c is here; `files_of(c)`: the data files that may be c's (at
// least all of them).
std::optional<std::vector<fs::path>> hub_files(const fs::path& root, const std::vector<HubConfig>& configs,
                                               const std::function<bool(const HubConfig&)>& is_here,
                                               const std::function<std::vector<fs::path>(const HubConfig&)>& files_of,
                                               const std::string& split, bool c4) {
  std::vector<const HubConfig*> here;
  for (const auto& c : configs)
    if (c.problem.empty() && is_here(c)) here.push_back(&c);
  const HubConfig* chosen = nullptr;
  for (const auto* c : here)
    if (!chosen && c->is_default) chosen = c;
  // Where none present is marked default, the entry load_dataset would read by default may be one
  // whose files titan cannot list: without data_files nor data_dir, the folder is read by the other
  // rules (as load_dataset finds its files); an entry titan cannot read is an error.
  for (const auto& c : configs) {
    if (chosen || (c.problem.empty() && !c.infers_files)) continue;
    if (!c.is_default && c.name != "default" && configs.size() != 1) continue;
    if (c.infers_files) return std::nullopt;
    TITAN_USER_CHECK(false, c.problem, ". titan cannot read this entry, and load_dataset would read it by default: set "
                     "the dataset path to the folder or file of the data to read, or simplify the entry in README.md");
  }
  if (here.empty()) return std::nullopt;
  for (const auto* c : here)
    if (!chosen && c->name == "default") chosen = c;
  if (!chosen && here.size() == 1) chosen = here.front();
  for (const auto* c : here)
    if (!chosen && c4 && c->name == "en") chosen = c;
  if (!chosen) {
    std::string listed, example;
    for (const auto* c : here) {
      auto t = c->files.find("train");
      const bool pats = t != c->files.end() && !t->second.empty();
      listed += (listed.empty() ? "" : ", ") + c->name +
                (pats ? " (" + joined(t->second) + ")" : c->data_dir.empty() ? "" : " (" + c->data_dir + "/)");
      if (example.empty()) example = pats ? pattern_folder(t->second.front()) : c->data_dir;
    }
    TITAN_USER_CHECK(false, "dataset folder '", root.string(), "' holds the files of ", here.size(),
                     " configurations its README.md declares, and none is the default: ", listed,
                     ". Reading them all would repeat documents; set the dataset path to the folder of the one to read",
                     example.empty() ? std::string() : " (e.g. " + (root / example).string() + ")");
  }
  const std::vector<fs::path> rel = files_of(*chosen);
  if (!chosen->data_dir.empty()) {
    std::vector<fs::path> inside;
    const fs::path dir = fs::path(chosen->data_dir).lexically_normal();
    for (const auto& r : rel)
      if (under(r, chosen->data_dir)) inside.push_back(r.lexically_relative(dir));
    std::vector<fs::path> out;
    for (const auto& r : narrow_to_split(inside, split, root / dir)) out.push_back(dir / r);
    return out;
  }
  const std::vector<std::string>* patterns = nullptr;
  for (const std::string& name : split_names(split)) {
    auto it = chosen->files.find(name);
    if (!patterns && it != chosen->files.end()) patterns = &it->second;
  }
  if (!patterns) {
    std::vector<std::string> splits;
    for (const auto& [name, pats] : chosen->files) splits.push_back(name);
    TITAN_USER_CHECK(false, "dataset folder '", root.string(), "': configuration '", chosen->name,
                     "' of its README.md has no ", split, " split (it has ", joined(splits),
                     "): set the dataset path to the ", split, " data");
  }
  std::vector<fs::path> out;
  for (const auto& r : rel)
    if (std::any_of(patterns->begin(), patterns->end(),
                    [&](const std::string& p) { return hub_pattern_matches(p, r.generic_string()); }))
      out.push_back(r);
  TITAN_USER_CHECK(!out.empty(), "dataset folder '", root.string(), "': configuration '", chosen->name,
                   "' of its README.md names ", joined(*patterns), " for the ", split,
                   " split and no data file here matches (an incomplete download?): ", kAccepted);
  return out;
}

// The data files under root/sub (relative to root, as found: links not resolved). Folders whose
// names start with '.' are skipped and each folder is entered once, however many links lead to it (a
// link to root, sub or a folder between them ends there). An unreadable folder is an error. With
// `first` (a presence check), stops at the first file for which `first` returns true, and takes
// files by their names; without, a data file's link to a missing file is an error.
std::vector<fs::path> walk_data_files(const fs::path& root, const fs::path& sub,
                                      const std::function<bool(const fs::path&)>& first = {}) {
  std::vector<fs::path> rel;
  std::error_code ec;
  const fs::path top = sub.empty() ? root : root / sub;
  std::set<fs::path> entered = {fs::weakly_canonical(root, ec)};
  fs::path between = root;
  for (const auto& part : sub) entered.insert(fs::weakly_canonical(between /= part, ec));
  auto fail = [](const fs::path& where, const std::error_code& e) {
    TITAN_USER_CHECK(false, "cannot list the dataset folder '", where.string(), "': ", e.message(),
                     ": make it readable, or set the dataset path to the files to read");
  };
  fs::recursive_directory_iterator it(top, fs::directory_options::follow_directory_symlink, ec), end;
  if (ec) fail(top, ec);
  for (; it != end; it.increment(ec)) {
    if (ec) fail(top, ec);
    const std::string name = it->path().filename().string();
    if (!name.empty() && name[0] == '.') {  // .git, .cache/huggingface, ...
      if (it->is_directory(ec)) it.disable_recursion_pending();
      continue;
    }
    if (it->is_directory(ec)) {
      if (!entered.insert(fs::weakly_canonical(it->path(), ec)).second) it.disable_recursion_pending();
      continue;
    }
    if (!is_data_file(name)) continue;
    const fs::path r = it->path().lexically_relative(root);  // not fs::relative, which resolves links
    if (first) {
      if (first(r)) return {r};
      continue;
    }
    // A data file's link into a missing blob (a cache cleaned up, a partial copy) would drop its data.
    TITAN_USER_CHECK(it->is_regular_file(ec), "dataset file '", it->path().string(), "' is ",
                     it->is_symlink(ec) ? "a link to a missing file" : "not a regular file",
                     " (in a Hugging Face cache: a deleted blob; download the dataset again)");
    rel.push_back(r);
  }
  if (ec) fail(top, ec);
  return rel;
}

}  // namespace

std::vector<std::string> list_data_files(const std::string& path, const std::string& split) {
  std::error_code ec;
  TITAN_USER_CHECK(fs::exists(path, ec), "dataset path '", path,
                   "' does not exist: set training.dataset_path to a data file or a folder of them (", kAccepted, ")");
  if (!fs::is_directory(path)) return {path};

  fs::path root = hub_snapshot(fs::path(path));
  // The snapshots/ folder of a Hub cache holds one folder per revision: reading them all repeats data.
  TITAN_USER_CHECK(!(root.filename() == "snapshots" && (fs::is_directory(root.parent_path() / "blobs", ec) ||
                                                         fs::is_directory(root.parent_path() / "refs", ec))),
                   "dataset path '", path, "' is the snapshots/ folder of a Hugging Face cache, one folder per revision: "
                   "set it to the cache folder (", root.parent_path().string(), ", read at refs/main) or to one snapshot");
  // A README that declares configurations whose files all lie in folders of their own (allenai/c4:
  // en/, en.noclean/, realnewslike/, ...; fineweb-edu: data/, sample/10BT/, ...): each configuration
  // is looked for in its folders up to its first file, and only the chosen one's folders are read
  // whole, not every variant's files (tens of thousands, listed by every rank).
  const std::vector<HubConfig> configs = read_hub_configs((root / "README.md").string());
  bool by_folder = !configs.empty();
  for (const auto& c : configs)
    for (const auto& f : c.problem.empty() ? config_folders(c) : std::set<std::string>{})
      if (f.empty() || f.rfind("..", 0) == 0 || fs::path(f).is_absolute()) by_folder = false;
  std::vector<fs::path> rel;
  std::optional<std::vector<fs::path>> chosen;  // the chosen configuration's, when the README names one
  bool c4 = false;
  if (by_folder) {
    // Each folder a configuration names is walked once, until every configuration that looks there
    // has a file.
    std::map<std::string, std::vector<const HubConfig*>> looking;
    for (const auto& c : configs)
      if (c.problem.empty())
        for (const auto& f : config_folders(c)) looking[f].push_back(&c);
    std::set<const HubConfig*> found;
    for (const auto& entry : looking) {
      const std::string& folder = entry.first;
      const std::vector<const HubConfig*>& cs = entry.second;  // (named: clang before 16 cannot capture structured bindings)
      auto all_found = [&] {
        return std::all_of(cs.begin(), cs.end(), [&](const HubConfig* c) { return found.count(c) > 0; });
      };
      if (std::error_code e; all_found() || !fs::is_directory(root / folder, e)) continue;
      walk_data_files(root, folder, [&](const fs::path& r) {
        for (const HubConfig* c : cs)
          if (belongs(*c, r)) found.insert(c);
        return all_found();
      });
    }
    auto files_of = [&](const HubConfig& c) {
      std::set<fs::path> all;
      for (const auto& f : config_folders(c))
        if (std::error_code e; fs::is_directory(root / f, e))
          for (auto& r : walk_data_files(root, f)) all.insert(std::move(r));
      return std::vector<fs::path>(all.begin(), all.end());
    };
    auto is_here = [&](const HubConfig& c) { return found.count(&c) > 0; };
    // allenai/c4: files named en/c4-* (as below).
    c4 = fs::is_directory(root / "en", ec) && !walk_data_files(root, "en", [](const fs::path& r) {
                                                  return r.generic_string().rfind("en/c4-", 0) == 0;
                                                }).empty();
    chosen = hub_files(root, configs, is_here, files_of, split, c4);
  }
  if (!chosen) {
    rel = walk_data_files(root, "");
    TITAN_USER_CHECK(!rel.empty(), "dataset folder '", root.string(), "' holds no data file: ", kAccepted);
    // allenai/c4 layout: en/c4-train.00000-of-01024.json.gz, en/c4-validation.*, plus other variants.
    c4 = std::any_of(rel.begin(), rel.end(), [](const fs::path& r) { return r.generic_string().rfind("en/c4-", 0) == 0; });
    if (!by_folder && !configs.empty()) {
      auto is_here = [&](const HubConfig& c) {
        return std::any_of(rel.begin(), rel.end(), [&](const fs::path& r) { return belongs(c, r); });
      };
      chosen = hub_files(root, configs, is_here, [&](const HubConfig&) { return rel; }, split, c4);
    }
  }
  if (chosen) {
    rel = std::move(*chosen);
  } else if (c4) {
    const std::string prefix = "en/c4-" + split + ".";
    std::vector<fs::path> of_split;
    for (const auto& r : rel)
      if (r.generic_string().rfind(prefix, 0) == 0) of_split.push_back(r);
    TITAN_USER_CHECK(!of_split.empty(), "dataset folder '", (root / "en").string(), "' holds no data file named c4-",
                     split, ".*: ", kAccepted);
    rel = std::move(of_split);
  } else {
    // Narrowed to the split's files where some belong to it (train/, data/train-00000-of-00002.parquet, ...).
    // A folder whose files are named for other splits only is refused: reading them all would validate
    // on training data (or train on the test set) without a word.
    rel = narrow_to_split(std::move(rel), split, root);
  }
  std::sort(rel.begin(), rel.end(), [](const fs::path& a, const fs::path& b) { return a.string() < b.string(); });
  std::vector<std::string> files;
  for (const auto& r : rel) files.push_back((root / r).string());
  return files;
}

// ---------------------------------------------------------------------------------------------
// Decompressed byte streams: plain, gzip (zlib, concatenated members too) and zstd (any number of frames).

struct LineReader::Stream {
  enum Kind { kPlain, kGzip, kZstd } kind = kPlain;
  std::string path;
  std::FILE* file = nullptr;
  gzFile gz = nullptr;
  ZSTD_DCtx* zctx = nullptr;
  std::vector<char> zin;
  ZSTD_inBuffer zbuf{nullptr, 0, 0};
  size_t zlast = 0;  // last ZSTD_decompressStream result: 0 when a frame just ended
  bool zeof = false;

  explicit Stream(const std::string& p) : path(p) {
    std::FILE* f = std::fopen(p.c_str(), "rb");
    TITAN_USER_CHECK(f, "cannot open dataset file '", p, "': ", std::strerror(errno));
    unsigned char magic[4] = {0, 0, 0, 0};
    size_t n = std::fread(magic, 1, 4, f);
    if (n >= 2 && magic[0] == 0x1f && magic[1] == 0x8b) {
      kind = kGzip;
      std::fclose(f);
      gz = gzopen(p.c_str(), "rb");
      TITAN_USER_CHECK(gz, "cannot open gzip file '", p, "'");
      gzbuffer(gz, kChunk);
    } else if (n == 4 && magic[0] == 0x28 && magic[1] == 0xb5 && magic[2] == 0x2f && magic[3] == 0xfd) {
      kind = kZstd;
      std::rewind(f);
      file = f;
      zctx = ZSTD_createDCtx();
      TITAN_ASSERT(zctx, "ZSTD_createDCtx failed");
      zin.resize(ZSTD_DStreamInSize());
    } else {
      std::rewind(f);
      file = f;
    }
  }
  ~Stream() {
    if (file) std::fclose(file);
    if (gz) gzclose(gz);
    if (zctx) ZSTD_freeDCtx(zctx);
  }

  // Reads up to `cap` decompressed bytes into `out`; 0 at end of file.
  size_t read(char* out, size_t cap) {
    if (kind == kPlain) {
      size_t n = std::fread(out, 1, cap, file);
      TITAN_USER_CHECK(n > 0 || !std::ferror(file), "read error in dataset file '", path, "'");
      return n;
    }
    if (kind == kGzip) {
      int n = gzread(gz, out, static_cast<unsigned>(cap));
      if (n < 0) {
        int err = 0;
        const char* msg = gzerror(gz, &err);
        TITAN_USER_CHECK(false, "dataset file '", path, "' is not valid gzip data: ", msg);
      }
      return static_cast<size_t>(n);
    }
    ZSTD_outBuffer ob{out, cap, 0};
    while (ob.pos == 0) {
      if (zbuf.pos == zbuf.size) {
        if (zeof) break;
        zbuf.size = std::fread(zin.data(), 1, zin.size(), file);
        zbuf.src = zin.data();
        zbuf.pos = 0;
        if (zbuf.size == 0) {
          zeof = true;
          break;
        }
      }
      zlast = ZSTD_decompressStream(zctx, &ob, &zbuf);
      TITAN_USER_CHECK(!ZSTD_isError(zlast), "dataset file '", path, "' is not valid zstd data: ",
                       ZSTD_getErrorName(zlast));
    }
    TITAN_USER_CHECK(ob.pos > 0 || zlast == 0, "dataset file '", path, "' is truncated (its last zstd frame is incomplete)");
    return ob.pos;
  }
};

LineReader::LineReader(const std::string& path) : path_(path), stream_(std::make_unique<Stream>(path)) {}
LineReader::~LineReader() = default;

bool LineReader::fill() {
  if (eof_) return false;
  // Drop consumed bytes, then append a chunk.
  buf_offset_ += static_cast<int64_t>(pos_);
  buf_.erase(0, pos_);
  pos_ = 0;
  size_t old = buf_.size();
  buf_.resize(old + kChunk);
  size_t n = stream_->read(buf_.data() + old, kChunk);
  buf_.resize(old + n);
  if (n == 0) eof_ = true;
  return n > 0;
}

bool LineReader::next(std::string& line, int64_t& offset, int64_t& line_no) {
  size_t scan = pos_;
  while (true) {
    size_t nl = buf_.find('\n', scan);
    if (nl != std::string::npos) {
      offset = buf_offset_ + static_cast<int64_t>(pos_);
      line_no = line_no_;
      line.assign(buf_, pos_, nl - pos_);
      pos_ = nl + 1;
      ++line_no_;
      break;
    }
    scan = buf_.size() - pos_;  // relative: fill() moves the unread bytes to the front
    if (!fill()) {
      if (pos_ == buf_.size()) return false;
      offset = buf_offset_ + static_cast<int64_t>(pos_);
      line_no = line_no_;
      line.assign(buf_, pos_, std::string::npos);  // last line without '\n'
      pos_ = buf_.size();
      ++line_no_;
      break;
    }
  }
  if (!line.empty() && line.back() == '\r') line.pop_back();
  return true;
}

void LineReader::seek(int64_t offset, int64_t line_no) {
  TITAN_USER_CHECK(offset >= 0, "bad dataset offset ", offset, " for '", path_, "'");
  if (offset < buf_offset_ + static_cast<int64_t>(pos_)) {  // backwards: start over
    stream_ = std::make_unique<Stream>(path_);
    buf_.clear();
    pos_ = 0;
    buf_offset_ = 0;
    eof_ = false;
  }
  if (stream_->kind == Stream::kPlain && offset > buf_offset_ + static_cast<int64_t>(buf_.size())) {
    TITAN_USER_CHECK(std::fseek(stream_->file, offset, SEEK_SET) == 0, "cannot seek to byte ", offset, " of '", path_, "'");
    buf_.clear();
    pos_ = 0;
    buf_offset_ = offset;
    eof_ = false;
  } else {
    while (offset > buf_offset_ + static_cast<int64_t>(buf_.size())) {
      pos_ = buf_.size();
      TITAN_USER_CHECK(fill(), "dataset file '", path_, "' is shorter than the saved position (byte ", offset,
                       "): was it changed since the checkpoint was written?");
    }
    pos_ = static_cast<size_t>(offset - buf_offset_);
  }
  line_no_ = line_no;
}

// ---------------------------------------------------------------------------------------------

DocumentReader::DocumentReader(std::vector<std::string> files, std::string text_field)
    : files_(std::move(files)), field_(std::move(text_field)) {
  TITAN_USER_CHECK(!files_.empty(), "no dataset files given");
  TITAN_USER_CHECK(!field_.empty(), "the dataset text field name is empty (training.dataset_text_field, validation.dataset_text_field)");
  for (const auto& f : files_) table_.push_back(is_table_file(f));
}

DocumentReader::~DocumentReader() = default;

void DocumentReader::rewind(int64_t epoch) {
  reader_.reset();
  table_reader_.reset();
  file_ = 0;
  epoch_ = epoch;
}

void DocumentReader::seek(const DocPos& pos) {
  TITAN_USER_CHECK(pos.file >= 0 && pos.file < static_cast<int64_t>(files_.size()), "saved dataset position names file #",
                   pos.file, " but the dataset has ", files_.size(), " files: was the dataset changed?");
  epoch_ = pos.epoch;
  file_ = pos.file;
  reader_.reset();
  table_reader_.reset();
  if (table_[file_]) {
    table_reader_ = std::make_unique<TableReader>(files_[file_], field_);
    table_reader_->seek(pos.offset);
  } else {
    reader_ = std::make_unique<LineReader>(files_[file_]);
    reader_->seek(pos.offset, pos.line);
  }
}

bool DocumentReader::next_line(std::string& line, DocPos& pos) {
  while (file_ < static_cast<int64_t>(files_.size())) {
    if (table_[file_]) {
      if (!table_reader_) table_reader_ = std::make_unique<TableReader>(files_[file_], field_);
      int64_t row = 0;
      if (!table_reader_->next(line, row)) {
        table_reader_.reset();
        ++file_;
        continue;
      }
      pos = DocPos{epoch_, file_, row, row + 1};
      return true;
    }
    if (!reader_) reader_ = std::make_unique<LineReader>(files_[file_]);
    int64_t offset = 0, line_no = 0;
    if (!reader_->next(line, offset, line_no)) {
      reader_.reset();
      ++file_;
      continue;
    }
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank line
    pos = DocPos{epoch_, file_, offset, line_no};
    return true;
  }
  return false;
}

std::string DocumentReader::text_of(const std::string& line, const DocPos& pos) const {
  if (table_[static_cast<size_t>(pos.file)]) return line;  // a row's text as it is
  const std::string& path = files_[static_cast<size_t>(pos.file)];
  const int64_t line_no = pos.line;
  nlohmann::json obj;
  try {
    obj = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& e) {  // parse errors, and numbers beyond a double's range
    TITAN_USER_CHECK(false, path, ":", line_no, ": malformed JSON (", e.what(),
                     "); each line must be one JSON object (JSON Lines). Fix or remove that line.");
  }
  TITAN_USER_CHECK(obj.is_object(), path, ":", line_no, ": expected a JSON object per line, found a ", obj.type_name(),
                   obj.is_array() && line_no == 1 ? " (a file holding one JSON array is not supported: write one "
                                                    "object per line)"
                                                  : "");
  auto it = obj.find(field_);
  if (it == obj.end()) {
    std::string keys;
    for (auto k = obj.begin(); k != obj.end(); ++k) keys += (keys.empty() ? "" : ", ") + k.key();
    TITAN_USER_CHECK(false, path, ":", line_no, ": no text field '", field_, "' (fields: ", keys,
                     "); set training.dataset_text_field (validation.dataset_text_field for validation data; in a dataset_mix entry, text_field=FIELD after the path) to the one holding the text");
  }
  TITAN_USER_CHECK(it->is_string(), path, ":", line_no, ": field '", field_, "' is a ", it->type_name(),
                   ", expected a string");
  return it->get<std::string>();
}

bool DocumentReader::next(std::string& text, DocPos& pos) {
  if (!next_line(line_, pos)) return false;
  if (table_[static_cast<size_t>(pos.file)])
    text.swap(line_);
  else
    text = text_of(line_, pos);
  return true;
}

}  // namespace titan::data
