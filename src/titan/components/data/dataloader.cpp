#include "titan/components/data/dataloader.h"

#include "titan/common/assets.h"

#include "titan/common/error.h"
#include "titan/components/data/document_reader.h"
#include "titan/components/data/mixture.h"
#include "titan/components/data/text_windows.h"
#include "titan/components/data/token_shards.h"
#include "titan/distributed/mesh.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>

namespace titan::data {
namespace fs = std::filesystem;

DataConfig data_config(const config::Training& t, int dp_rank, int dp_world) {
  DataConfig dc;
  dc.dataset = t.dataset;
  dc.dataset_path = t.dataset_path;
  dc.dataset_mix = t.dataset_mix;
  dc.text_field = t.dataset_text_field;
  dc.local_batch_size = t.local_batch_size;
  dc.seq_len = t.seq_len;
  dc.dp_rank = dp_rank;
  dc.dp_world = dp_world;
  return dc;
}

DataConfig data_config(const config::Validation& v, int dp_rank, int dp_world) {
  DataConfig dc;
  dc.dataset = v.dataset;
  dc.dataset_path = v.dataset_path;
  dc.text_field = v.dataset_text_field;
  dc.local_batch_size = v.local_batch_size;
  dc.seq_len = v.seq_len;
  dc.dp_rank = dp_rank;
  dc.dp_world = dp_world;
  dc.section = "validation";
  return dc;
}

TokenizeTogether tokenize_together(dist::Group& group) {
  TokenizeTogether t;
  t.rank = group.rank();
  t.size = group.size();
  dist::Group* g = &group;
  t.all_gather = [g](const std::vector<int32_t>& mine) {
    // The lengths first, then every part padded to the longest.
    at::Tensor length = at::tensor({static_cast<int64_t>(mine.size())}, at::kLong);
    at::Tensor lengths = at::empty({g->size()}, at::kLong);
    g->all_gather(lengths, length).wait();
    const int64_t longest = lengths.max().item<int64_t>();
    at::Tensor padded = at::zeros({longest}, at::kInt);
    std::copy(mine.begin(), mine.end(), padded.data_ptr<int32_t>());
    at::Tensor parts = at::empty({g->size() * longest}, at::kInt);
    g->all_gather(parts, padded).wait();
    std::vector<std::vector<int32_t>> out(static_cast<size_t>(g->size()));
    const int32_t* p = parts.data_ptr<int32_t>();
    for (int m = 0; m < g->size(); ++m)
      out[static_cast<size_t>(m)].assign(p + m * longest, p + m * longest + lengths[m].item<int64_t>());
    return out;
  };
  return t;
}

namespace {
constexpr const char* kCorpus = "assets/corpus/corpus.jsonl.zst";
constexpr const char* kC4Test = "assets/c4_test";
}  // namespace

ResolvedDataset resolve_dataset(const std::string& name_in, const std::string& dataset_path, const std::string& section) {
  const std::string path_key = section + ".dataset_path";
  std::string name = name_in;
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  ResolvedDataset r;
  r.split = name == "c4_validation" ? "validation" : "train";
  if (name == "c4_test" || name == "titan_corpus") {
    r.path = dataset_path;
    if (r.path.empty() && name == "c4_test") r.path = find_asset(kC4Test);
    if (r.path.empty()) r.path = find_asset(kCorpus);
    TITAN_USER_CHECK(!r.path.empty(), "dataset '", name, "': the bundled corpus ", kCorpus,
                     " was not found (looked in the current folder and beside the titan binary): run titan from the "
                     "repository, or set ", path_key, " to a local data file or folder");
  } else if (name == "c4" || name == "c4_validation") {
    TITAN_USER_CHECK(!dataset_path.empty(), "dataset '", name, "' has no default location (titan downloads nothing at run "
                     "time): set ", path_key, " to a local copy of allenai/c4 (the folder holding en/, en/ "
                     "itself, or its Hugging Face cache folder datasets--allenai--c4), to JSON Lines, Parquet or "
                     "Arrow files with a 'text' field, or to token shards from `titan tokenize`");
    r.path = dataset_path;
  } else {
    TITAN_USER_CHECK(false, "unknown dataset '", name_in,
                     "': supported are c4_test, c4, c4_validation, titan_corpus (each reads local files; see ",
                     path_key, ")");
  }
  TITAN_USER_CHECK(names_existing_data(r.path), "dataset '", name, "': path '", r.path,
                   "' does not exist: set ", path_key, " to a local .jsonl/.json file (optionally .gz/.zst), "
                   "a .parquet or .arrow file, a folder of them (Hugging Face cache and save_to_disk folders "
                   "included), a token shard folder, a Megatron-LM dataset prefix or llm.c token files");
  r.kind = token_file_kind(r.path);
  if (r.kind.empty()) r.kind = "text";
  return r;
}

// ---------------------------------------------------------------------------------------------

DataLoader::DataLoader(const DataConfig& config, std::unique_ptr<WindowSource> source, std::string description)
    : config_(config), source_(std::move(source)), description_(std::move(description)) {
  TITAN_USER_CHECK(config_.local_batch_size >= 1, "local_batch_size must be at least 1, got ", config_.local_batch_size);
  TITAN_USER_CHECK(config_.dp_world >= 1 && config_.dp_rank >= 0 && config_.dp_rank < config_.dp_world,
                   "data-parallel rank ", config_.dp_rank, " is not within world size ", config_.dp_world);
  TITAN_ASSERT(source_ && source_->window_len() == config_.seq_len + 1);
  window_.resize(static_cast<size_t>(source_->window_len()));
}

Batch DataLoader::next() {
  const int64_t B = config_.local_batch_size, S = config_.seq_len;
  const int64_t before = config_.dp_rank * B;                      // samples of lower ranks
  const int64_t after = (config_.dp_world - 1 - config_.dp_rank) * B;  // samples of higher ranks
  at::Tensor inputs = at::empty({B, S}, at::kLong);
  at::Tensor labels = at::empty({B, S}, at::kLong);
  int64_t* in = inputs.data_ptr<int64_t>();
  int64_t* lab = labels.data_ptr<int64_t>();
  source_->skip(before);
  for (int64_t b = 0; b < B; ++b) {
    source_->read(window_.data());
    std::copy(window_.begin(), window_.end() - 1, in + b * S);
    std::copy(window_.begin() + 1, window_.end(), lab + b * S);
  }
  source_->skip(after);
  global_samples_ += B * config_.dp_world;
  return {inputs, labels};
}

std::string DataLoader::state() const {
  nlohmann::json s = {{"version", 1},
                      {"kind", source_->kind()},
                      {"seq_len", config_.seq_len},
                      {"global_samples", global_samples_},
                      {"source", source_->state()}};
  return s.dump();
}

void DataLoader::load_state(const std::string& text) {
  nlohmann::json s;
  try {
    s = nlohmann::json::parse(text);
    TITAN_USER_CHECK(s.at("version") == 1, "unsupported data loader state version ", s.at("version"));
    TITAN_USER_CHECK(s.at("kind") == source_->kind(), "the data loader state is for ", s.at("kind"),
                     " data but the dataset is ", source_->kind(), " data: resume with the same dataset");
    TITAN_USER_CHECK(s.at("seq_len").get<int64_t>() == config_.seq_len, "the data loader state was saved with seq_len ",
                     s.at("seq_len"), ", this run has ", config_.seq_len, ": resume with the same seq_len, or keep the model and optimizer "
                     "and start the data stream afresh with --checkpoint.exclude_from_loading dataloader");
    source_->load_state(s.at("source"));
    global_samples_ = s.at("global_samples").get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    TITAN_USER_CHECK(false, "bad data loader state (", e.what(), "): ", text.substr(0, 200));
  }
}

namespace {

std::unique_ptr<WindowSource> make_source(const ResolvedDataset& r, const DataConfig& config, const Tokenizer& tokenizer) {
  if (r.kind == "shards") return std::make_unique<ShardWindowSource>(r.path, tokenizer, config.seq_len);
  if (r.kind == "megatron") return std::make_unique<MegatronWindowSource>(r.path, tokenizer.vocab_size(), config.seq_len);
  if (r.kind == "llmc") return std::make_unique<LlmcWindowSource>(r.path, tokenizer.vocab_size(), config.seq_len);
  return std::make_unique<TextWindowSource>(list_data_files(r.path, r.split), config.text_field, tokenizer, config.seq_len,
                                            config.together);
}

std::string together_note(const TokenizeTogether& t) {
  return "; tokenized together by " + std::to_string(t.size) + " ranks, each encoding 1/" + std::to_string(t.size) +
         " of the documents";
}

const std::string& kind_description(const std::string& kind) {
  static const std::map<std::string, std::string> kKinds = {
      {"shards", "token shards"}, {"megatron", "Megatron-LM indexed dataset"}, {"llmc", "llm.c token files"},
      {"text", "text"}};
  return kKinds.at(kind);
}

}  // namespace

std::vector<std::pair<MixtureEntry, ResolvedDataset>> resolve_mixture(const std::vector<std::string>& entries,
                                                                      const std::string& section) {
  const std::string key = section + ".dataset_mix";
  std::vector<std::pair<MixtureEntry, ResolvedDataset>> out;
  for (MixtureEntry& e : parse_dataset_mix(entries, key)) {
    std::string lower = e.location;
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    try {
      ResolvedDataset r = lower == "c4_test" || lower == "titan_corpus" ? resolve_dataset(lower, "", section)
                                                                         : resolve_dataset("c4", e.location, section);
      out.emplace_back(std::move(e), std::move(r));
    } catch (const UserError& err) {
      throw UserError(key + " source '" + e.name + "': " + err.what());
    }
  }
  return out;
}

std::unique_ptr<DataLoader> make_dataloader(const DataConfig& config, const Tokenizer& tokenizer) {
  if (!config.dataset_mix.empty()) {
    TITAN_USER_CHECK(config.dataset_path.empty(), config.section, ".dataset_mix and ", config.section,
                     ".dataset_path are both set: the mixture names its datasets' paths; clear one of them");
    std::vector<MixtureWindowSource::Source> sources;
    std::string description = "mixture of";
    bool text = false;
    for (auto& [entry, r] : resolve_mixture(config.dataset_mix, config.section)) {
      text = text || r.kind == "text";
      char weight[32];
      std::snprintf(weight, sizeof weight, "%g", entry.weight);
      description += std::string(sources.empty() ? " " : ", ") + entry.name + " (weight " + weight + ", " +
                     kind_description(r.kind) + " from " + r.path +
                     (entry.text_field.empty() ? "" : ", field " + entry.text_field) + ")";
      TITAN_USER_CHECK(entry.text_field.empty() || r.kind == "text", config.section, ".dataset_mix source '",
                       entry.name, "' (", kind_description(r.kind), ") is already tokenized: text_field=",
                       entry.text_field, " applies to text sources only; remove it");
      DataConfig source_config = config;
      if (!entry.text_field.empty()) source_config.text_field = entry.text_field;
      try {
        sources.push_back({entry, make_source(r, source_config, tokenizer)});
      } catch (const UserError& err) {
        throw UserError(config.section + ".dataset_mix source '" + entry.name + "': " + err.what());
      }
    }
    if (text && config.together.size > 1) description += together_note(config.together);
    return std::make_unique<DataLoader>(config, std::make_unique<MixtureWindowSource>(std::move(sources)),
                                        std::move(description));
  }
  ResolvedDataset r = resolve_dataset(config.dataset, config.dataset_path, config.section);
  std::unique_ptr<WindowSource> source = make_source(r, config, tokenizer);
  std::string description = config.dataset + ": " + kind_description(r.kind) + " from " + r.path;
  if (r.kind == "text" && config.together.size > 1) description += together_note(config.together);
  return std::make_unique<DataLoader>(config, std::move(source), std::move(description));
}

std::vector<std::pair<std::string, int64_t>> DataLoader::tokens_by_source() const {
  const auto* mixture = dynamic_cast<const MixtureWindowSource*>(source_.get());
  if (!mixture) return {};
  std::vector<std::pair<std::string, int64_t>> out = mixture->samples_by_source();
  for (auto& [name, n] : out) n *= config_.seq_len;
  return out;
}

}  // namespace titan::data
