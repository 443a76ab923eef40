// The configurations a Hugging Face dataset repository declares in the YAML front matter of its
// README.md (the `configs:` list that datasets.load_dataset reads): each names a subset of the
// repository's files per split, by glob patterns relative to the repository. A clone or cache
// snapshot of such a repository holds every configuration's files (fineweb-edu: data/ and the
// sample/ subsets of the same documents), so reading all of them would repeat documents.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace titan::data {

struct HubConfig {
  std::string name;
  bool is_default = false;  // `default:` true (YAML 1.1: true, yes, on, 1, any case)
  // split -> patterns; a config whose data_files are bare patterns has them all under "train".
  std::map<std::string, std::vector<std::string>> files;
  std::string data_dir;  // without data_files: the folder whose files (split by their names) it reads
  bool infers_files = false;  // neither data_files nor data_dir: load_dataset finds the files by its rules
  std::string problem;   // why titan cannot read the entry (YAML outside its subset, an empty config_name)
};

// The configs README.md's front matter declares (none when the file has no front matter or no
// `configs:` key). Reads the YAML subset these files use: block mappings and sequences (a sequence
// may sit at its key's indentation), plain, single- and double-quoted scalars, flow sequences and
// mappings (over several lines too), block scalars (| and >, skipped), comments. An entry it cannot
// read is returned with its `problem` (its name and `default:` mark as found in its text): an error
// only where load_dataset would read that configuration by default (marked default, named "default"
// or without a name titan can find, or the only one; and no readable one present is marked default).
std::vector<HubConfig> read_hub_configs(const std::string& readme_path);

// Whether `path` (relative, '/'-separated) matches `pattern` as the Hub's data_files do: '*' and '?'
// and [...] within one path segment, '**' any number of segments.
bool hub_pattern_matches(const std::string& pattern, const std::string& path);

}  // namespace titan::data
