#include "titan/components/data/mixture.h"

#include "titan/common/error.h"
#include "titan/common/json_integer.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <set>

namespace titan::data {

std::vector<MixtureEntry> parse_dataset_mix(const std::vector<std::string>& entries, const std::string& key) {
  std::vector<MixtureEntry> out;
  std::set<std::string> names;
  for (const std::string& text : entries) {
    const size_t start = text.find_first_not_of(" \t");
    const size_t space = text.find_first_of(" \t", start);
    const size_t rest = space == std::string::npos ? std::string::npos : text.find_first_not_of(" \t", space);
    TITAN_USER_CHECK(start != std::string::npos && rest != std::string::npos, key, " entry '", text,
                     "' needs a weight and a dataset: \"WEIGHT PATH\" or \"WEIGHT NAME=PATH\", e.g. \"0.7 ",
                     "fineweb=data/fineweb\"");
    const std::string weight_text = text.substr(start, space - start);
    char* end = nullptr;
    const double weight = std::strtod(weight_text.c_str(), &end);
    TITAN_USER_CHECK(end && *end == '\0' && std::isfinite(weight) && weight > 0, key, " entry '", text,
                     "': the weight '", weight_text, "' is not a positive number");
    std::string location = text.substr(rest);
    while (!location.empty() && (location.back() == ' ' || location.back() == '\t')) location.pop_back();
    MixtureEntry e;
    e.weight = weight;
    std::error_code ec;
    auto exists = [&ec](const std::string& path) {
      return std::filesystem::exists(path, ec) || std::filesystem::exists(path + ".bin", ec);
    };
    // A last word "text_field=FIELD", or text_field="FIELD" (in double quotes, which may hold blanks)
    // ending the entry, unless the whole text is a path that exists.
    static const std::string kField = "text_field=";
    auto blank = [](char c) { return c == ' ' || c == '\t'; };
    if (!exists(location)) {
      size_t begin = std::string::npos;  // where "text_field=" starts
      const size_t q = location.rfind(kField + '"');
      const bool quoted = q != std::string::npos && q > 0 && blank(location[q - 1]);
      const size_t open = quoted ? q + kField.size() : 0, close = quoted ? location.find('"', open + 1) : 0;
      if (quoted && location.back() == '"') {
        TITAN_USER_CHECK(close == location.size() - 1, key, " entry '", text,
                         "': a quoted text_field=\"FIELD\" holds no double quote");
        begin = q;
        e.text_field = location.substr(open + 1, close - open - 1);
      } else if (const size_t word = location.find_last_of(" \t");
                 word != std::string::npos && location.compare(word + 1, kField.size(), kField) == 0) {
        begin = word + 1;
        e.text_field = location.substr(begin + kField.size());
      } else {
        TITAN_USER_CHECK(!quoted || close != std::string::npos, key, " entry '", text,
                         "': text_field=\" needs its closing quote, ending the entry: text_field=\"FIELD\"");
      }
      if (begin != std::string::npos) {
        TITAN_USER_CHECK(!e.text_field.empty(), key, " entry '", text,
                         "': text_field= names no field (give the JSON field or column of this source's text)");
        location.erase(location.find_last_not_of(" \t", begin - 1) + 1);
      }
    }
    TITAN_USER_CHECK(location.compare(0, kField.size(), kField) != 0 || exists(location), key, " entry '", text,
                     "' names a text field but no dataset: \"WEIGHT [NAME=]PATH text_field=FIELD\"");
    // NAME=PATH, unless the whole text is a path that exists (a Hive-style folder such as
    // "data/lang=en", or a Megatron-LM prefix "x=y/corpus" beside its .bin and .idx).
    const bool whole_path = exists(location);
    if (const size_t eq = location.find('='); !whole_path && eq != std::string::npos && location.find('/') > eq) {
      e.name = location.substr(0, eq);
      e.location = location.substr(eq + 1);
    } else {
      e.location = location;
      std::filesystem::path p(location);
      while (!p.empty() && p.filename().empty()) p = p.parent_path();  // "data/fineweb/" names fineweb
      e.name = p.filename().string();
    }
    TITAN_USER_CHECK(!e.name.empty() && !e.location.empty(), key, " entry '", text, "' names no dataset");
    TITAN_USER_CHECK(names.insert(e.name).second, key, " has two sources named '", e.name,
                     "': name them apart with \"WEIGHT NAME=PATH\"");
    out.push_back(std::move(e));
  }
  return out;
}

MixtureWindowSource::MixtureWindowSource(std::vector<Source> sources) : sources_(std::move(sources)) {
  TITAN_ASSERT(!sources_.empty(), "a mixture of no sources");
  double total = 0;
  for (const auto& s : sources_) total += s.entry.weight;
  window_len_ = sources_[0].source->window_len();
  for (const auto& s : sources_) {
    TITAN_ASSERT(s.source->window_len() == window_len_, "mixture sources of different window lengths");
    shares_.push_back(s.entry.weight / total);
  }
  taken_.assign(sources_.size(), 0);
}

size_t MixtureWindowSource::choose() const {
  size_t best = 0;
  double best_gap = 0;
  const double k = static_cast<double>(samples_ + 1);
  for (size_t i = 0; i < sources_.size(); ++i) {
    const double gap = shares_[i] * k - static_cast<double>(taken_[i]);
    if (i == 0 || gap > best_gap) {
      best = i;
      best_gap = gap;
    }
  }
  return best;
}

void MixtureWindowSource::read(int32_t* out) {
  const size_t i = choose();
  sources_[i].source->read(out);
  ++taken_[i];
  ++samples_;
}

void MixtureWindowSource::skip(int64_t n) {
  // Consecutive samples of one source skip together (a shard source skips in O(1), a text source
  // tokenizes what it passes).
  while (n > 0) {
    const size_t i = choose();
    int64_t run = 0;
    while (n > 0 && choose() == i) {
      ++taken_[i];
      ++samples_;
      ++run;
      --n;
    }
    sources_[i].source->skip(run);
  }
}

int64_t MixtureWindowSource::epoch() const {
  int64_t e = sources_[0].source->epoch();
  for (const auto& s : sources_) e = std::min(e, s.source->epoch());
  return e;
}

nlohmann::json MixtureWindowSource::state() const {
  nlohmann::json list = nlohmann::json::array();
  for (size_t i = 0; i < sources_.size(); ++i)
    list.push_back({{"name", sources_[i].entry.name},
                    {"weight", sources_[i].entry.weight},
                    {"windows", taken_[i]},
                    {"kind", sources_[i].source->kind()},
                    {"state", sources_[i].source->state()}});
  return {{"samples", samples_}, {"sources", list}};
}

void MixtureWindowSource::load_state(const nlohmann::json& s) {
  try {
    const auto& list = s.at("sources");
    std::string saved, mine;
    for (const auto& e : list) saved += " " + e.at("weight").dump() + " " + e.at("name").get<std::string>();
    for (const auto& src : sources_) mine += " " + nlohmann::json(src.entry.weight).dump() + " " + src.entry.name;
    TITAN_USER_CHECK(saved == mine, "the data loader state was saved for the mixture", saved,
                     ", this run mixes", mine, ": resume with the same training.dataset_mix, or start the data stream "
                     "afresh with --checkpoint.exclude_from_loading dataloader");
    int64_t total = 0;
    for (size_t i = 0; i < sources_.size(); ++i) {
      const auto& e = list.at(i);
      TITAN_USER_CHECK(e.at("kind") == sources_[i].source->kind(), "mixture source '", sources_[i].entry.name,
                       "': the data loader state is for ", e.at("kind"), " data, the source is ",
                       sources_[i].source->kind(), " data: resume with the same data");
      sources_[i].source->load_state(e.at("state"));
      taken_[i] = json_integer<int64_t>(e.at("windows"));
      TITAN_USER_CHECK(taken_[i] >= 0, "bad mixture data loader state: ", s.dump());
      total += taken_[i];
    }
    samples_ = json_integer<int64_t>(s.at("samples"));
    TITAN_USER_CHECK(samples_ == total, "bad mixture data loader state (", samples_, " samples, but the sources served ",
                     total, "): ", s.dump());
  } catch (const nlohmann::json::exception& e) {
    TITAN_USER_CHECK(false, "bad mixture data loader state (", e.what(), "): ", s.dump());
  }
}

std::vector<std::pair<std::string, int64_t>> MixtureWindowSource::samples_by_source() const {
  std::vector<std::pair<std::string, int64_t>> out;
  for (size_t i = 0; i < sources_.size(); ++i) out.emplace_back(sources_[i].entry.name, taken_[i]);
  return out;
}

}  // namespace titan::data
