// Fuzz target: the Parquet and Arrow IPC readers (Hugging Face datasets, FineWeb, DCLM). Input: one
// byte choosing the format (even: .parquet, odd: .arrow), then the file. Reads every row's text (at
// most 10000), then seeks back to the last few rows (as a resume from a checkpoint does) and checks
// that the same text comes back.
#include "fuzz_util.h"

#include "titan/components/data/table_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace titan;
  if (size < 1) return 0;
  const std::string path = fuzz::fresh_dir() + (data[0] % 2 ? "/data.arrow" : "/data.parquet");
  fuzz::write_file(path, std::string_view(reinterpret_cast<const char*>(data) + 1, size - 1));
  return fuzz::run_one("table", [&] {
    data::TableReader reader(path, "text");
    std::vector<std::pair<std::string, int64_t>> rows;
    std::string text;
    int64_t row = 0;
    while (rows.size() < 10000 && reader.next(text, row)) {
      TITAN_FUZZ_CHECK(row == static_cast<int64_t>(rows.size()), "row ", rows.size(), " came back as row ", row);
      rows.emplace_back(text, row);
    }
    TITAN_FUZZ_CHECK(rows.size() == 10000 || static_cast<int64_t>(rows.size()) == reader.num_rows(),
                     "read ", rows.size(), " rows of ", reader.num_rows());
    for (size_t i = rows.size(); i-- > 0 && i + 4 > rows.size();) {
      reader.seek(static_cast<int64_t>(i));
      TITAN_FUZZ_CHECK(reader.next(text, row), "no row after seeking to row ", i);
      TITAN_FUZZ_CHECK(text == rows[i].first && row == rows[i].second, "seek to row ", i, " read another");
    }
  });
}
