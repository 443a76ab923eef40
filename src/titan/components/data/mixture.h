// Weighted mixtures of data sources (training.dataset_mix): sample k of the global stream is a window
// of one source, chosen by the mixture's rule from k alone, so every data-parallel layout reads the
// same global batches.
//
// The rule is the greedy one of Megatron-LM's blending: sample k goes to the source furthest behind its
// share, the largest weight_i * (k + 1) - taken_i (ties to the first), so after any number of samples
// each source's count stays close to its weight's share (within about one sample). Each source keeps its own stream and
// position (a text source's documents, a shard folder's windows) and loops over its epochs on its own.
#pragma once

#include "titan/components/data/window_source.h"

#include <memory>
#include <string>
#include <vector>

namespace titan::data {

// One entry of training.dataset_mix: "WEIGHT LOCATION" or "WEIGHT NAME=LOCATION", where LOCATION is a
// dataset path (any kind the data loader reads) or a dataset name with a default location (c4_test,
// titan_corpus); NAME (default: the location's last path component) names the source in metrics. A
// last word "text_field=FIELD" (or text_field="FIELD", quoted when the name holds blanks, ending the
// entry) names the JSON field or table column of this source's text (text sources only; default: the
// section's dataset_text_field).
struct MixtureEntry {
  std::string name;
  double weight = 0;      // as given; the mixture normalizes the weights
  std::string location;
  std::string text_field;  // empty: the section's dataset_text_field
};

// Parses the entries; throws UserError naming `key` and the entry for a bad weight (not a positive
// finite number), a missing location, an empty text_field, or two entries of one name.
std::vector<MixtureEntry> parse_dataset_mix(const std::vector<std::string>& entries, const std::string& key);

class MixtureWindowSource : public WindowSource {
 public:
  struct Source {
    MixtureEntry entry;
    std::unique_ptr<WindowSource> source;
  };
  // Every source's window_len must be the same.
  explicit MixtureWindowSource(std::vector<Source> sources);

  void read(int32_t* out) override;
  void skip(int64_t n) override;
  int64_t window_len() const override { return window_len_; }
  // The smallest epoch among the sources: every source has been read whole that many times.
  int64_t epoch() const override;
  std::string kind() const override { return "mixture"; }
  // {"samples": k, "sources": [{"name", "weight", "windows", "kind", "state"}, ...]}; loading checks the
  // names and weights (another mixture gives other batches) and each source's own state.
  nlohmann::json state() const override;
  void load_state(const nlohmann::json& state) override;

  // The samples of the global stream each source has served so far, by name, in the config's order.
  std::vector<std::pair<std::string, int64_t>> samples_by_source() const;

 private:
  size_t choose() const;  // the source of sample samples_

  std::vector<Source> sources_;
  std::vector<double> shares_;     // normalized weights
  std::vector<int64_t> taken_;     // samples served by each source
  int64_t samples_ = 0;            // samples of the global stream read or skipped
  int64_t window_len_ = 0;
};

}  // namespace titan::data
