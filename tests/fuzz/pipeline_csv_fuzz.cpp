// Fuzz target: pipeline schedules read from CSV (parallelism.pipeline_parallel_schedule_csv). Input: the
// CSV file. Read as the trainer reads it, then checked for the stages and microbatches it names (the
// completeness and deadlock checks), and a schedule that passes is simulated; a schedule's CSV text
// must read back to the same order.
#include "fuzz_util.h"

#include "titan/distributed/pipeline_schedule.h"

#include <algorithm>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace titan;
  const std::string path = fuzz::fresh_dir() + "/schedule.csv";
  fuzz::write_file(path, std::string_view(reinterpret_cast<const char*>(data), size));
  return fuzz::run_one("pipeline_csv", [&] {
    const dist::PipelineOrder order = dist::read_schedule_csv(path);
    int stages = 0, microbatches = 0;
    for (const auto& row : order)
      for (const auto& a : row)
        if (a) {
          stages = std::max(stages, a->stage + 1);
          microbatches = std::max(microbatches, a->microbatch + 1);
        }
    TITAN_FUZZ_CHECK(dist::parse_schedule_csv(dist::schedule_csv(order)) == order, "the CSV text of a schedule "
                     "does not read back to the same order");
    if (stages == 0) return;
    dist::check_schedule(order, stages, microbatches);
    const dist::ScheduleTiming t = dist::simulate_schedule(order, stages);
    TITAN_FUZZ_CHECK(t.bubble_fraction() >= 0 && t.bubble_fraction() < 1, "bubble fraction ", t.bubble_fraction());
  });
}
