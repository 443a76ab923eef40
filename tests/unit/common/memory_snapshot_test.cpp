// Memory snapshot files: the CPU breakdown's text and JSON, and the CUDA snapshot (a clear error
// without a GPU; with one, a pickle holding the recorded history).
#include "titan/common/memory_snapshot.h"

#include "test_util.h"
#include "titan/common/error.h"
#include "titan/common/memory_tracker.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

namespace titan::mem {
namespace {

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// Names of the files in `folder` (to see that no temporary file is left behind).
std::vector<std::string> files_in(const std::string& folder) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(folder)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST(MemorySnapshot, CpuBreakdownIsWrittenAsTextAndJson) {
  install_cpu_tracking();
  at::Tensor params;
  {
    PhaseScope setup(Phase::Setup);
    params = at::empty({1 << 20}, at::kFloat);  // 4 MiB
  }
  reset_cpu_peak();
  const PeakBreakdown start = cpu_peak_breakdown();
  {
    PhaseScope forward(Phase::Forward);
    at::Tensor activations = at::empty({3 << 20}, at::kFloat);  // 12 MiB
  }
  const PeakBreakdown b = cpu_peak_breakdown();
  const size_t forward = static_cast<size_t>(Phase::Forward), setup = static_cast<size_t>(Phase::Setup);
  ASSERT_EQ(b.alive_by_phase[forward] - start.alive_by_phase[forward], 12 << 20);
  ASSERT_GE(b.alive_by_phase[setup], 4 << 20);

  test::TempDir dir;
  const std::string folder = dir / "memory_snapshot/iteration_7";  // created on the way
  write_cpu_memory_breakdown(folder + "/rank0_cpu_memory.txt", 7);
  EXPECT_EQ(files_in(folder), (std::vector<std::string>{"rank0_cpu_memory.json", "rank0_cpu_memory.txt"}));

  const std::string text = read_all(folder + "/rank0_cpu_memory.txt");
  EXPECT_EQ(text.rfind("step 7: ", 0), 0u) << text;
  EXPECT_NE(text.find(format_breakdown(b)), std::string::npos) << text;
  EXPECT_NE(text.find("reached during forward"), std::string::npos) << text;
  EXPECT_EQ(text.find("not installed"), std::string::npos) << text;

  const nlohmann::json j = nlohmann::json::parse(read_all(folder + "/rank0_cpu_memory.json"));
  EXPECT_EQ(j.at("step").get<int64_t>(), 7);
  EXPECT_EQ(j.at("peak_bytes").get<int64_t>(), b.peak_bytes);
  EXPECT_EQ(j.at("phase_at_peak").get<std::string>(), "forward");
  EXPECT_EQ(j.at("alive_by_phase").at("forward").get<int64_t>(), b.alive_by_phase[forward]);
  EXPECT_EQ(j.at("alive_by_phase").at("setup").get<int64_t>(), b.alive_by_phase[setup]);

  // Written again (the next snapshot of the same step): replaced, nothing left beside it.
  write_cpu_memory_breakdown(folder + "/rank0_cpu_memory.txt", 8);
  EXPECT_EQ(read_all(folder + "/rank0_cpu_memory.txt").rfind("step 8: ", 0), 0u);
  EXPECT_EQ(files_in(folder).size(), 2u);
}

TEST(MemorySnapshot, CpuBreakdownToAnUnwritablePlaceIsAUserError) {
  test::TempDir dir;
  std::ofstream(dir / "file") << "x";  // a file where a folder should be
  EXPECT_THROW(write_cpu_memory_breakdown(dir / "file/rank0_cpu_memory.txt", 1), UserError);
}

void expect_clear_error(const std::function<void()>& call) {
  try {
    call();
    ADD_FAILURE() << "expected a titan::UserError";
  } catch (const UserError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("--profiling.enable_memory_snapshot false"), std::string::npos) << what;
    EXPECT_TRUE(what.find("GPU") != std::string::npos || what.find("CUDA build") != std::string::npos) << what;
  }
}

TEST(MemorySnapshot, CudaWithoutAGpuIsAClearError) {
  if (cuda_memory_history_supported()) GTEST_SKIP() << "a GPU is present: CudaSnapshotHoldsTheHistory runs instead";
  test::TempDir dir;
  expect_clear_error([] { start_cuda_memory_history(100000); });
  expect_clear_error([] { stop_cuda_memory_history(); });
  expect_clear_error([&] { write_cuda_memory_snapshot(dir / "rank0_memory_snapshot.pickle"); });
  EXPECT_TRUE(files_in(dir.path()).empty());
}

TEST(MemorySnapshot, CudaSnapshotHoldsTheHistory) {
  if (!cuda_memory_history_supported()) GTEST_SKIP() << "needs a CUDA build and a GPU";
  test::TempDir dir;
  const std::string path = dir / "iteration_1/rank0_memory_snapshot.pickle";
  start_cuda_memory_history(100000);
  {
    at::Tensor x = at::empty({1 << 20}, at::device(at::kCUDA).dtype(at::kFloat));
  }
  write_cuda_memory_snapshot(path);
  stop_cuda_memory_history();
  const std::string bytes = read_all(path);
  ASSERT_GE(bytes.size(), 2u);
  EXPECT_EQ(static_cast<unsigned char>(bytes[0]), 0x80);  // pickle's PROTO opcode
  for (const char* key : {"segments", "device_traces", "allocator_settings", "alloc", "free_completed"})
    EXPECT_NE(bytes.find(key), std::string::npos) << key;
  // Python's pickle reads it, and the trace holds our 4 MiB allocation.
  const test::ProcessResult r = test::run_process(
      {test::python(), "-c",
       "import pickle, sys\n"
       "s = pickle.load(open(sys.argv[1], 'rb'))\n"
       "sizes = [e['size'] for t in s['device_traces'] for e in t if e['action'] == 'alloc']\n"
       "assert 4 * 2**20 in sizes, sizes\n"
       "from torch.cuda import _memory_viz\n"  // the reader behind pytorch.org/memory_viz
       "assert len(_memory_viz.trace_plot(s)) > 1000\n"
       "assert len(_memory_viz.segment_plot(s)) > 1000\n",
       path});
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

}  // namespace
}  // namespace titan::mem
