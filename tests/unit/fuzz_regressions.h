// Inputs the fuzz targets found (tests/fuzz/regressions/<target>/<name>), for unit tests that feed
// them to the parser and expect its clear error. An input that stands for several files holds them
// separated by the line of tests/fuzz/fuzz_util.h.
#pragma once

#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace titan::test {

inline std::vector<std::string> fuzz_regression_files(const std::string& target, const std::string& name) {
  const std::filesystem::path path = std::filesystem::path(TITAN_SOURCE_DIR) / "tests/fuzz/regressions" / target / name;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("no regression input " + path.string());
  std::ostringstream all;
  all << in.rdbuf();
  const std::string text = all.str(), separator = "\n--titan-fuzz-file--\n";
  std::vector<std::string> files;
  size_t from = 0;
  for (size_t at; (at = text.find(separator, from)) != std::string::npos; from = at + separator.size())
    files.push_back(text.substr(from, at - from));
  files.push_back(text.substr(from));
  return files;
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

}  // namespace titan::test
