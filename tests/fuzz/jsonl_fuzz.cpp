// Fuzz target: the JSON Lines data reader, plain or compressed (gzip, zstd: recognized by the magic
// bytes, as for real data files). Input: one data file. Reads every document, then seeks back to the
// positions it returned (as a resume from a checkpoint does) and checks that the same text comes back.
#include "fuzz_util.h"

#include "titan/components/data/document_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace titan;
  const std::string path = fuzz::fresh_dir() + "/data.jsonl";
  fuzz::write_file(path, std::string_view(reinterpret_cast<const char*>(data), size));
  return fuzz::run_one("jsonl", [&] {
    data::DocumentReader reader({path}, "text");
    reader.rewind(0);
    std::vector<std::pair<std::string, data::DocPos>> docs;
    std::string text;
    data::DocPos pos;
    while (docs.size() < 10000 && reader.next(text, pos)) docs.emplace_back(text, pos);
    for (size_t i = docs.size(); i-- > 0 && i + 4 > docs.size();) {  // the last few, backwards
      reader.seek(docs[i].second);
      TITAN_FUZZ_CHECK(reader.next(text, pos), "no document after seeking to document ", i);
      TITAN_FUZZ_CHECK(text == docs[i].first && pos == docs[i].second, "seek to document ", i, " read another");
    }
  });
}
