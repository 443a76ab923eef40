// Fuzz target: a Hugging Face dataset repository's README.md (its front matter's configs, read by
// titan's YAML subset) and the files list_data_files picks by it. Input: the README. The folder holds
// data files of a full set and two samples, train and validation, so that configurations match some.
#include "fuzz_util.h"

#include "titan/components/data/document_reader.h"
#include "titan/components/data/hub_configs.h"

#include <filesystem>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace titan;
  const std::string dir = fuzz::fresh_dir();
  for (const char* f : {"data/a/0.jsonl", "data/b/0.jsonl", "sample/10BT/0.jsonl", "eval/validation-0.jsonl"}) {
    std::filesystem::create_directories(std::filesystem::path(dir + "/" + f).parent_path());
    fuzz::write_file(dir + "/" + f, "{\"text\": \"x\"}\n");
  }
  fuzz::write_file(dir + "/README.md", std::string_view(reinterpret_cast<const char*>(data), size));
  return fuzz::run_one("hub_readme", [&] {
    const auto configs = data::read_hub_configs(dir + "/README.md");
    for (const auto& c : configs) TITAN_FUZZ_CHECK(!c.name.empty(), "a configuration without a name");
    for (const char* split : {"train", "validation"}) {
      const auto files = data::list_data_files(dir, split);
      TITAN_FUZZ_CHECK(!files.empty(), "no file listed for ", split);
      for (const auto& f : files) TITAN_FUZZ_CHECK(f.rfind(dir + "/", 0) == 0, "a file outside the folder: ", f);
    }
  });
}
