// Tokenizer throughput: encodes a JSON list of documents with titan's tokenizer, single thread.
// Usage: tokenizer_bench <tokenizer path> <documents.json> [passes=3]
// Prints one JSON line: {"mb_per_s": ..., "tokens": ..., "bytes": ..., "checksum": ...}; the first pass
// (cold per-word cache) is reported apart as "cold_mb_per_s". See bench/tokenizer/run.sh.
#include "titan/components/tokenizer/tokenizer.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: tokenizer_bench <tokenizer path> <documents.json> [passes]\n";
    return 2;
  }
  const auto tok = titan::load_tokenizer(argv[1]);
  std::ifstream in(argv[2]);
  const auto docs = nlohmann::json::parse(in).get<std::vector<std::string>>();
  const int passes = argc > 3 ? std::atoi(argv[3]) : 3;
  size_t bytes = 0;
  for (const auto& d : docs) bytes += d.size();

  auto run = [&](size_t& tokens, uint64_t& checksum) {
    const auto t0 = std::chrono::steady_clock::now();
    tokens = 0;
    checksum = 0;
    for (const auto& d : docs) {
      const auto ids = tok->encode(d);
      tokens += ids.size();
      for (int32_t id : ids) checksum = checksum * 1000003 + static_cast<uint64_t>(id);
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  size_t tokens = 0;
  uint64_t checksum = 0;
  const double cold = run(tokens, checksum);
  double total = 0;
  for (int p = 0; p < passes; ++p) total += run(tokens, checksum);
  const double mb = bytes / 1e6;
  std::printf("{\"mb_per_s\": %.3f, \"cold_mb_per_s\": %.3f, \"tokens\": %zu, \"bytes\": %zu, \"checksum\": %llu}\n",
              mb * passes / total, mb / cold, tokens, bytes, static_cast<unsigned long long>(checksum));
  return 0;
}
