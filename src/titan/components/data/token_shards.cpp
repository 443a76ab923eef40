#include "titan/components/data/token_shards.h"

#include "titan/common/error.h"
#include "titan/common/plain_name.h"
#include "titan/common/json_integer.h"
#include "titan/components/data/document_reader.h"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <limits>
#include <thread>
#include <bit>
#include <optional>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace titan::data {
namespace fs = std::filesystem;

namespace {

constexpr char kMagic[8] = {'T', 'I', 'T', 'A', 'N', 'T', 'O', 'K'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 64;
constexpr const char* kFormat = "titan-token-shards";

struct Header {  // the first 40 bytes of a shard; the rest of the 64 are zero
  char magic[8];
  uint32_t version;
  uint32_t token_bytes;
  uint64_t num_tokens;
  uint64_t num_documents;
  uint64_t vocab_size;
};
static_assert(sizeof(Header) == 40);
static_assert(std::endian::native == std::endian::little, "the shard format is little-endian");

size_t doc_index_offset(uint64_t num_tokens) { return (kHeaderBytes + 4 * num_tokens + 7) / 8 * 8; }

std::string shard_name(int64_t i) {
  char name[32];
  std::snprintf(name, sizeof(name), "shard-%05lld.bin", static_cast<long long>(i));
  return name;
}

nlohmann::json optional_id(std::optional<int32_t> id) { return id ? nlohmann::json(*id) : nlohmann::json(nullptr); }

// Writes one shard: header placeholder, tokens as they come, then the document index and the header.
class ShardFile {
 public:
  ShardFile(const std::string& path, uint64_t vocab_size) : path_(path), vocab_size_(vocab_size) {
    out_.open(path, std::ios::binary | std::ios::trunc);
    TITAN_USER_CHECK(out_.good(), "cannot write token shard '", path, "'");
    char zeros[kHeaderBytes] = {};
    out_.write(zeros, kHeaderBytes);
  }
  void add_document(const std::vector<int32_t>& ids) {
    doc_starts_.push_back(num_tokens_);
    tmp_.assign(ids.begin(), ids.end());
    out_.write(reinterpret_cast<const char*>(tmp_.data()), static_cast<std::streamsize>(4 * tmp_.size()));
    num_tokens_ += ids.size();
  }
  uint64_t num_tokens() const { return num_tokens_; }
  uint64_t num_documents() const { return doc_starts_.size(); }
  void close() {
    size_t end = kHeaderBytes + 4 * num_tokens_;
    char zeros[8] = {};
    out_.write(zeros, static_cast<std::streamsize>(doc_index_offset(num_tokens_) - end));
    out_.write(reinterpret_cast<const char*>(doc_starts_.data()), static_cast<std::streamsize>(8 * doc_starts_.size()));
    Header h{};
    std::memcpy(h.magic, kMagic, 8);
    h.version = kVersion;
    h.token_bytes = 4;
    h.num_tokens = num_tokens_;
    h.num_documents = doc_starts_.size();
    h.vocab_size = vocab_size_;
    out_.seekp(0);
    out_.write(reinterpret_cast<const char*>(&h), sizeof(h));
    out_.close();
    TITAN_USER_CHECK(!out_.fail(), "writing token shard '", path_, "' failed (disk full?)");
  }

 private:
  std::string path_;
  uint64_t vocab_size_;
  std::ofstream out_;
  uint64_t num_tokens_ = 0;
  std::vector<uint64_t> doc_starts_;
  std::vector<uint32_t> tmp_;
};

}  // namespace

bool is_shard_folder(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::is_regular_file(fs::path(path) / "manifest.json", ec);
}

namespace {

// The documents of a text source (JSON Lines, Parquet, Arrow), tokenized with BOS and EOS by `workers`
// threads and handed to `write` in the source's order (so the output does not depend on the number of
// workers). The calling thread reads lines (a table file's rows, as text) and writes shards; the workers
// extract the text (JSON) and encode, a chunk of 256 KiB of text or 128 documents at a time, with at
// most 4 chunks per worker in flight.
void tokenize_in_order(DocumentReader& reader, const Tokenizer& tokenizer, int workers,
                       const std::function<void(const std::vector<int32_t>&)>& write) {
  std::string text;
  DocPos pos;
  if (workers <= 1) {
    while (reader.next(text, pos)) write(tokenizer.encode(text, /*add_bos=*/true, /*add_eos=*/true));
    return;
  }
  struct Chunk {
    std::vector<std::string> lines;  // as read: the workers extract the text (JSON parsing is work too)
    std::vector<DocPos> positions;
    std::vector<std::vector<int32_t>> ids;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<int64_t, std::unique_ptr<Chunk>>> todo;
  std::map<int64_t, std::unique_ptr<Chunk>> done;
  bool stop = false;
  // The earliest chunk that failed, and its error: the first bad document in the source's order is
  // the one reported, whichever worker meets a bad document first. Chunks before it are still
  // encoded and written; chunks after it are skipped.
  int64_t error_chunk = std::numeric_limits<int64_t>::max();
  std::exception_ptr error;
  std::vector<std::thread> threads;
  auto work = [&] {
    for (;;) {
      std::pair<int64_t, std::unique_ptr<Chunk>> job;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || !todo.empty(); });
        if (stop) return;  // all written, or the error reported
        job = std::move(todo.front());
        todo.pop_front();
        if (job.first > error_chunk) continue;
      }
      try {
        Chunk& c = *job.second;
        for (size_t i = 0; i < c.lines.size(); ++i)
          c.ids.push_back(tokenizer.encode(reader.text_of(c.lines[i], c.positions[i]), /*add_bos=*/true,
                                           /*add_eos=*/true));
        c.lines.clear();
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (job.first < error_chunk) {
          error_chunk = job.first;
          error = std::current_exception();
        }
        cv.notify_all();
        continue;
      }
      std::lock_guard<std::mutex> lock(mu);
      done.emplace(job.first, std::move(job.second));
      cv.notify_all();
    }
  };
  struct Join {  // every path out of here, an exception's too, stops and joins the workers
    std::vector<std::thread>& threads;
    std::mutex& mu;
    std::condition_variable& cv;
    bool& stop;
    ~Join() {
      {
        std::lock_guard<std::mutex> lock(mu);
        stop = true;
      }
      cv.notify_all();
      for (auto& t : threads) t.join();
    }
  } join{threads, mu, cv, stop};
  for (int i = 0; i < workers; ++i) threads.emplace_back(work);

  int64_t submitted = 0, written = 0;
  const int64_t max_in_flight = 4 * static_cast<int64_t>(workers);
  // Writes the finished chunks that are next in order; with `wait_for`, first waits until fewer than
  // that many chunks are in flight (or all are written, for 1).
  auto drain = [&](int64_t wait_for) {
    for (;;) {
      std::unique_ptr<Chunk> next;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return written == error_chunk || done.count(written) || submitted - written < wait_for; });
        if (written == error_chunk) std::rethrow_exception(error);
        auto it = done.find(written);
        if (it == done.end()) return;
        next = std::move(it->second);
        done.erase(it);
      }
      for (const auto& ids : next->ids) write(ids);
      ++written;
    }
  };
  auto chunk = std::make_unique<Chunk>();
  size_t chunk_bytes = 0;
  auto submit = [&] {
    drain(max_in_flight);
    {
      std::lock_guard<std::mutex> lock(mu);
      todo.emplace_back(submitted++, std::move(chunk));
    }
    cv.notify_all();
    chunk = std::make_unique<Chunk>();
    chunk_bytes = 0;
  };
  while (reader.next_line(text, pos)) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (error) break;  // no need to read on: drain reports it once the chunks before it are written
    }
    chunk_bytes += text.size() + 64;
    chunk->lines.push_back(std::move(text));
    chunk->positions.push_back(pos);
    if (chunk_bytes >= (size_t{1} << 18) || chunk->lines.size() >= 128) submit();
  }
  if (!chunk->lines.empty()) submit();
  drain(1);  // throws the first error: its chunk is reached before all are written
}

}  // namespace

namespace {

std::string part_name(int process) {
  char name[32];
  std::snprintf(name, sizeof(name), "part-%05d", process);
  return name;
}

// The files of process p of P: a contiguous run of the sorted files, balanced by bytes (file i goes to
// the process whose share holds the middle of its bytes), so that the processes' shards in process
// order hold the same stream as one process's.
std::vector<std::string> files_of_process(const std::vector<std::string>& files, int p, int P) {
  if (P <= 1) return files;
  std::vector<double> sizes;
  double total = 0;
  for (const auto& f : files) {
    std::error_code ec;
    const auto n = fs::file_size(f, ec);
    sizes.push_back(ec ? 1.0 : static_cast<double>(n) + 1.0);
    total += sizes.back();
  }
  std::vector<std::string> out;
  double before = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    const int owner = std::min(P - 1, static_cast<int>(P * (before + sizes[i] / 2) / total));
    if (owner == p) out.push_back(files[i]);
    before += sizes[i];
  }
  return out;
}

void write_json_atomically(const fs::path& path, const nlohmann::json& j) {
  const std::string tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp);
    out << j.dump(2) << "\n";
    out.close();
    TITAN_USER_CHECK(out.good(), "cannot write '", tmp, "'");
  }
  fs::rename(tmp, path);
}

}  // namespace

ShardWriteResult tokenize_to_shards(const std::string& input_path, const Tokenizer& tokenizer, const std::string& out_dir,
                                    const ShardWriteOptions& options) {
  TITAN_USER_CHECK(options.tokens_per_shard >= 1, "tokens_per_shard must be positive");
  const int P = std::max(1, options.processes), me = options.process;
  TITAN_USER_CHECK(me >= 0 && me < P, "process ", me, " of ", P, " is not a process of the job");
  const bool parted = P > 1;
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  TITAN_USER_CHECK(!ec, "cannot create output folder '", out_dir, "': ", ec.message());
  // The folder must be new or empty; under several processes each finds the others' parts there.
  for (const auto& e : fs::directory_iterator(out_dir, ec)) {
    const std::string name = e.path().filename().string();
    const bool others = parted && name.rfind("part-", 0) == 0 && name.rfind(part_name(me), 0) != 0;
    TITAN_USER_CHECK(others, "output folder '", out_dir, "' is not empty (it holds ", name,
                     "): remove it or choose another");
  }

  const std::vector<std::string> all_files = list_data_files(input_path, options.split);
  const std::vector<std::string> files = files_of_process(all_files, me, P);
  const int64_t vocab = tokenizer.vocab_size();
  const std::string prefix = parted ? part_name(me) + "-" : "";

  ShardWriteResult result;
  nlohmann::json shards = nlohmann::json::array();
  std::unique_ptr<ShardFile> shard;
  int64_t shard_index = 0;
  auto close_shard = [&] {
    shard->close();
    shards.push_back({{"file", prefix + shard_name(shard_index)},
                      {"num_tokens", shard->num_tokens()},
                      {"num_documents", shard->num_documents()}});
    ++shard_index;
    shard.reset();
  };
  const int workers = options.workers > 0 ? options.workers
                                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (!files.empty()) {
    DocumentReader reader(files, options.text_field);
    reader.rewind(0);
    tokenize_in_order(reader, tokenizer, workers, [&](const std::vector<int32_t>& ids) {
      for (int32_t id : ids) TITAN_ASSERT(id >= 0 && id < vocab, "token id ", id, " outside the vocabulary of ", vocab);
      if (!shard)
        shard = std::make_unique<ShardFile>((fs::path(out_dir) / (prefix + shard_name(shard_index))).string(), vocab);
      shard->add_document(ids);
      ++result.num_documents;
      result.num_tokens += static_cast<int64_t>(ids.size());
      if (static_cast<int64_t>(shard->num_tokens()) >= options.tokens_per_shard) close_shard();
    });
  }
  if (shard) close_shard();
  result.own_tokens = result.num_tokens;
  result.workers = workers;

  if (parted) {
    // Each process leaves a summary of its part; the first waits for all of them and writes the one
    // manifest (the launcher stops the job, this wait included, when a process fails).
    write_json_atomically(fs::path(out_dir) / (part_name(me) + ".json"),
                          {{"num_tokens", result.num_tokens}, {"num_documents", result.num_documents},
                           {"sources", files}, {"shards", shards}});
    if (me != 0) {
      result.num_shards = shard_index;
      return result;
    }
    shards = nlohmann::json::array();
    result.num_tokens = result.num_documents = 0;
    auto last_said = std::chrono::steady_clock::now();
    for (int p = 0; p < P; ++p) {
      const fs::path part = fs::path(out_dir) / (part_name(p) + ".json");
      while (!fs::exists(part, ec)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        if (std::chrono::steady_clock::now() - last_said > std::chrono::seconds(60)) {
          std::fprintf(stderr, "titan tokenize: waiting for process %d's part (%s)\n", p, part.c_str());
          last_said = std::chrono::steady_clock::now();
        }
      }
      nlohmann::json j;
      try {
        std::ifstream in(part);
        j = nlohmann::json::parse(in);
        result.num_tokens += json_integer<int64_t>(j.at("num_tokens"));
        result.num_documents += json_integer<int64_t>(j.at("num_documents"));
        for (const auto& s : j.at("shards")) shards.push_back(s);
      } catch (const nlohmann::json::exception& e) {
        TITAN_USER_CHECK(false, "'", part.string(), "' is not a part summary of titan tokenize: ", e.what());
      }
    }
  }
  result.num_shards = static_cast<int64_t>(shards.size());
  TITAN_USER_CHECK(result.num_tokens > 0, "'", input_path, "' yields no tokens: nothing to write");

  nlohmann::json manifest = {
      {"format", kFormat},
      {"version", kVersion},
      {"num_tokens", result.num_tokens},
      {"num_documents", result.num_documents},
      {"tokenizer",
       {{"vocab_size", vocab}, {"bos_id", optional_id(tokenizer.bos_id())}, {"eos_id", optional_id(tokenizer.eos_id())},
        {"name", options.tokenizer_name}}},
      {"text_field", options.text_field},
      {"sources", all_files},
      {"shards", shards}};
  write_json_atomically(fs::path(out_dir) / "manifest.json", manifest);
  if (parted)
    for (int p = 0; p < P; ++p) fs::remove(fs::path(out_dir) / (part_name(p) + ".json"), ec);
  return result;
}

// ---------------------------------------------------------------------------------------------

ShardWindowSource::ShardWindowSource(const std::string& dir, const Tokenizer& tokenizer, int64_t seq_len)
    : MappedTokenSource("shards", "token shard", seq_len, tokenizer.vocab_size()) {
  const std::string manifest_path = (fs::path(dir) / "manifest.json").string();
  nlohmann::json m;
  {
    std::ifstream in(manifest_path);
    TITAN_USER_CHECK(in.good(), "no token shard manifest '", manifest_path, "': write the folder with `titan tokenize`");
    try {
      m = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      TITAN_USER_CHECK(false, "'", manifest_path, "' is not valid JSON: ", e.what());
    }
  }
  try {
    TITAN_USER_CHECK(m.at("format") == kFormat && m.at("version") == kVersion, "'", manifest_path,
                     "' is not a version-", kVersion, " titan token shard manifest");
    const auto& t = m.at("tokenizer");
    TITAN_USER_CHECK(json_integer<int64_t>(t.at("vocab_size")) == tokenizer.vocab_size() &&
                         t.at("bos_id") == optional_id(tokenizer.bos_id()) && t.at("eos_id") == optional_id(tokenizer.eos_id()),
                     "the token shards in '", dir, "' were written with another tokenizer (vocab_size ", t.at("vocab_size"),
                     ", bos ", t.at("bos_id"), ", eos ", t.at("eos_id"), "; this one: vocab_size ", tokenizer.vocab_size(),
                     "): re-run `titan tokenize` with the model's tokenizer");
    for (const auto& s : m.at("shards")) {
      const std::string path =
          (fs::path(dir) / plain_file_name(s.at("file").get<std::string>(), "token shard manifest '" + manifest_path + "'"))
              .string();
      const uint64_t n = json_integer<uint64_t>(s.at("num_tokens"));
      const uint64_t docs = json_integer<uint64_t>(s.at("num_documents"));
      const Mapped map = map_file(path);
      const size_t bytes = map.bytes;
      // The manifest's counts are compared with the file's size before any arithmetic on them could overflow.
      TITAN_USER_CHECK(n <= bytes / 4 && docs <= bytes / 8 && doc_index_offset(n) + 8 * docs <= bytes, "token shard '",
                       path, "' has ", bytes, " bytes, too few for the ", n, " tokens and ", docs,
                       " documents of its manifest entry (truncated?)");
      Header h;
      std::memcpy(&h, map.data, sizeof(h));
      TITAN_USER_CHECK(std::memcmp(h.magic, kMagic, 8) == 0 && h.version == kVersion && h.token_bytes == 4 &&
                           h.num_tokens == n,
                       "token shard '", path, "' does not match its manifest entry (bad header)");
      add_segment(path, map.data + kHeaderBytes, TokenType::U32, static_cast<int64_t>(n));
    }
    TITAN_USER_CHECK(num_tokens() == json_integer<int64_t>(m.at("num_tokens")) && num_tokens() > 0, "the token shards in '",
                     dir, "' hold ", num_tokens(), " tokens, the manifest says ", m.at("num_tokens"));
  } catch (const nlohmann::json::exception& e) {
    TITAN_USER_CHECK(false, "'", manifest_path, "' lacks a field or has a wrong type: ", e.what());
  }
}

}  // namespace titan::data
