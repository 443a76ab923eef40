// The CUDA paths that only a GPU machine runs (each test skips without a visible GPU):
//   - attention's block kernel (ring attention's per-block computation, used as is at cp 1 and for
//     every block at cp > 1): CUDA's memory-efficient kernel returns a log-sum-exp padded to a
//     multiple of 32 rows, which titan cuts and pads again for backward. Checked against attention
//     written out in float64, forward (output and log-sum-exp) and backward, at a length that is not a
//     multiple of 32, causal and not, grouped heads, and two key blocks merged by their log-sum-exps
//     (what ring attention does) against attention over all keys;
//   - CPU offload on a GPU: the same losses as the run that keeps everything on the GPU, at a lower
//     measured device peak;
//   - a real out-of-memory error in a step (no injection): the run ends with the step named, and the
//     allocator snapshot written at the failure loads with PyTorch's memory_viz.
// Tolerances: fp32 1e-4 relative to the tensor's scale (fp32 kernels; the reference is float64);
// bf16 inputs 2e-2 (bf16's rounding, 3.9e-3, of the output and of every gradient accumulated over
// 40 keys).
#include "test_util.h"

#include "titan/components/metrics/memory_monitor.h"
#include "titan/config/job_config.h"
#include "titan/nn/layers.h"
#include "titan/trainer/trainer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#if __has_include(<c10/cuda/CUDAFunctions.h>) && __has_include(<cuda_runtime_api.h>)
#include <c10/cuda/CUDAFunctions.h>
#define TITAN_HAVE_CUDA_HEADERS 1
#endif

#include <cmath>
#include <cstdio>
#include <filesystem>

namespace titan {
namespace {

namespace fs = std::filesystem;
const std::string kSource = TITAN_SOURCE_DIR;
const std::string kTitan = std::string(TITAN_BINARY_DIR) + "/titan";

#define SKIP_WITHOUT_A_GPU() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible: this check runs only on a GPU machine"

struct Qkv {
  at::Tensor q, k, v;  // (B, H, S, E), (B, KV, S, E), (B, KV, S, E)
};

Qkv random_qkv(int64_t B, int64_t H, int64_t KV, int64_t Sq, int64_t Sk, int64_t E, at::ScalarType dtype, int seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto o = at::TensorOptions().dtype(at::kFloat);
  Qkv x{at::randn({B, H, Sq, E}, gen, o), at::randn({B, KV, Sk, E}, gen, o), at::randn({B, KV, Sk, E}, gen, o)};
  x.q = x.q.to(dtype).to(at::kCUDA);
  x.k = x.k.to(dtype).to(at::kCUDA);
  x.v = x.v.to(dtype).to(at::kCUDA);
  return x;
}

// Attention written out in float64 on the CPU, from the same (rounded) inputs: output, log-sum-exp
// and the gradients of sum(out * dout).
struct Exact {
  at::Tensor out, lse, dq, dk, dv;
};

Exact exact_attention(const Qkv& x, const at::Tensor& dout, bool causal) {
  at::Tensor q = x.q.to(at::kCPU, at::kDouble).requires_grad_(), k = x.k.to(at::kCPU, at::kDouble).requires_grad_(),
             v = x.v.to(at::kCPU, at::kDouble).requires_grad_();
  const int64_t groups = q.size(1) / k.size(1), Sq = q.size(2), Sk = k.size(2);
  at::Tensor kk = k.repeat_interleave(groups, 1), vv = v.repeat_interleave(groups, 1);
  at::Tensor s = at::matmul(q, kk.transpose(-1, -2)) / std::sqrt(static_cast<double>(q.size(-1)));
  if (causal) {  // query i sees keys 0..i (the kernel's top-left causal mask)
    at::Tensor mask = at::ones({Sq, Sk}, at::kBool).triu(1);
    s = s.masked_fill(mask, -INFINITY);
  }
  at::Tensor lse = at::logsumexp(s, -1);
  at::Tensor out = at::matmul(at::exp(s - lse.unsqueeze(-1)), vv);
  (out * dout.to(at::kCPU, at::kDouble)).sum().backward();
  return {out.detach(), lse.detach(), q.grad(), k.grad(), v.grad()};
}

double err(const at::Tensor& actual, const at::Tensor& expected) {
  return test::relative_error(actual.to(at::kCPU, at::kDouble), expected);
}

TEST(CudaAttention, BlockKernelEqualsAttentionWrittenOut) {
  SKIP_WITHOUT_A_GPU();
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const double tol = dtype == at::kFloat ? 1e-4 : 2e-2;
    for (const bool causal : {true, false}) {
      // 40 rows: the kernel's log-sum-exp has 64 (padded to 32), titan's has 40.
      const Qkv x = random_qkv(2, 4, 2, 40, 40, 64, dtype, causal ? 1 : 2);
      const at::Tensor dout = at::randn_like(x.q);
      auto [out, lse] = nn::attention_block_forward(x.q, x.k, x.v, causal);
      ASSERT_EQ(lse.sizes(), at::IntArrayRef({2, 4, 40}));
      auto [dq, dk, dv] = nn::attention_block_backward(dout, x.q, x.k, x.v, out, lse, causal);
      const Exact e = exact_attention(x, dout, causal);
      SCOPED_TRACE(std::string(dtype == at::kFloat ? "fp32" : "bf16") + (causal ? " causal" : " full"));
      std::printf("[block %s %s] out %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n", dtype == at::kFloat ? "fp32" : "bf16",
                  causal ? "causal" : "full", err(out, e.out), err(lse, e.lse), err(dq, e.dq), err(dk, e.dk),
                  err(dv, e.dv));
      EXPECT_LE(err(out, e.out), tol);
      EXPECT_LE(err(lse, e.lse), tol);
      EXPECT_LE(err(dq, e.dq), tol);
      EXPECT_LE(err(dk, e.dk), tol);
      EXPECT_LE(err(dv, e.dv), tol);
      EXPECT_EQ(dk.sizes(), x.k.sizes());  // grouped heads' gradients summed back
    }
  }
}

// Ring attention's merge: the output over keys [0, 24) and the output over keys [24, 40), merged by
// their log-sum-exps in float32, equal attention over all 40 keys; each block's backward against the
// merged output and log-sum-exp gives that block's share of the exact gradients.
TEST(CudaAttention, BlocksMergedByTheirLogSumExpsEqualAttentionOverAllKeys) {
  SKIP_WITHOUT_A_GPU();
  const Qkv x = random_qkv(1, 4, 4, 40, 40, 64, at::kFloat, 3);
  const at::Tensor dout = at::randn_like(x.q);
  const Exact e = exact_attention(x, dout, false);
  const int64_t cut = 24;
  at::Tensor k1 = x.k.narrow(2, 0, cut).contiguous(), v1 = x.v.narrow(2, 0, cut).contiguous();
  at::Tensor k2 = x.k.narrow(2, cut, 40 - cut).contiguous(), v2 = x.v.narrow(2, cut, 40 - cut).contiguous();
  auto [o1, l1] = nn::attention_block_forward(x.q, k1, v1, false);
  auto [o2, l2] = nn::attention_block_forward(x.q, k2, v2, false);
  at::Tensor lse = at::logaddexp(l1.to(at::kFloat), l2.to(at::kFloat));
  at::Tensor out = o1.to(at::kFloat) * at::exp(l1 - lse).unsqueeze(-1) + o2.to(at::kFloat) * at::exp(l2 - lse).unsqueeze(-1);
  EXPECT_LE(err(out, e.out), 1e-4);
  EXPECT_LE(err(lse, e.lse), 1e-4);
  auto [dq1, dk1, dv1] = nn::attention_block_backward(dout, x.q, k1, v1, out, lse, false);
  auto [dq2, dk2, dv2] = nn::attention_block_backward(dout, x.q, k2, v2, out, lse, false);
  std::printf("[merged] out %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n", err(out, e.out), err(lse, e.lse),
              err(dq1 + dq2, e.dq), err(at::cat({dk1, dk2}, 2), e.dk), err(at::cat({dv1, dv2}, 2), e.dv));
  EXPECT_LE(err(dq1 + dq2, e.dq), 1e-4);
  EXPECT_LE(err(at::cat({dk1, dk2}, 2), e.dk), 1e-4);
  EXPECT_LE(err(at::cat({dv1, dv2}, 2), e.dv), 1e-4);
}

JobConfig gpu_config(const test::TempDir& dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--job.config_file", kSource + "/configs/llama3_debugmodel.toml",
                                   "--job.dump_folder", dir.path(),
                                   "--model.hf_assets_path", kSource + "/assets/tokenizer",
                                   "--training.seq_len", "256", "--training.local_batch_size", "4",
                                   "--training.steps", "5", "--metrics.log_freq", "100", "--debug.seed", "3",
                                   "--checkpoint.enable", "false"};
  args.insert(args.end(), extra.begin(), extra.end());
  return parse_config(args);
}

// CPU offload keeps the parameters, gradients and optimizer state in host memory and computes on the
// GPU. In fp32 (mixed_precision_param float32: no bf16 on either side) the losses equal those of the
// run that keeps everything on the GPU to 1e-5 relative (the optimizer steps on the CPU, rounding
// differently from the GPU's AdamW), and the device's measured peak is lower.
TEST(CudaTraining, CpuOffloadTrainsAsTheGpuRunAtALowerDevicePeak) {
  SKIP_WITHOUT_A_GPU();
  test::TempDir a_dir, b_dir;
  metrics::MemoryMonitor monitor(c10::Device(at::kCUDA, 0));
  std::vector<double> on_gpu, offloaded;
  double peak_on_gpu = 0, peak_offloaded = 0;
  {
    Trainer t(gpu_config(a_dir, {"--training.enable_cpu_offload", "false", "--training.mixed_precision_param", "float32"}));
    ASSERT_TRUE(t.device().is_cuda());
    on_gpu = t.train();
    peak_on_gpu = monitor.peak_stats().max_active_gib;
  }
  monitor.reset_peak_stats();
  {
    Trainer t(gpu_config(b_dir, {"--training.enable_cpu_offload", "true", "--training.mixed_precision_param", "float32"}));
    ASSERT_TRUE(t.device().is_cuda());
    offloaded = t.train();
    peak_offloaded = monitor.peak_stats().max_active_gib;
  }
  ASSERT_EQ(on_gpu.size(), offloaded.size());
  for (size_t i = 0; i < on_gpu.size(); ++i)
    EXPECT_NEAR(offloaded[i], on_gpu[i], 1e-5 * on_gpu[i]) << "step " << i + 1;
  std::printf("[offload] losses %.6f..%.6f vs %.6f..%.6f; device peak %.3f GiB offloaded, %.3f GiB on the GPU\n",
              offloaded.front(), offloaded.back(), on_gpu.front(), on_gpu.back(), peak_offloaded, peak_on_gpu);
  EXPECT_LT(peak_offloaded, peak_on_gpu);
}

// On a GPU no step between log steps waits for the device. CUDA's sync debug mode set to error (as
// torch.cuda.set_sync_debug_mode("error")) makes every synchronizing call throw: a device-to-host
// copy or .item(), a copy from pageable host memory, a stream or device synchronize, nonzero. Steps
// 3 and 4 of 5 (log_freq 100: steps 1 and 5 read) run under it, with their data loading, bf16
// autocast, gradient accumulation, clipping and AdamW; for the Llama 3 debug model and for the MoE
// debug model (Qwen3 MoE: routing, grouped matmuls, the load-balancing bias update). (On GPUs without
// ATen's grouped-matmul kernel, before Hopper, its fallback reads the group offsets on the host: a
// wait per MoE layer, which this test reports there.)
TEST(CudaTraining, StepsBetweenLogStepsNeverWaitForTheGpu) {
#ifndef TITAN_HAVE_CUDA_HEADERS
  GTEST_SKIP() << "LibTorch without CUDA";
#else
  SKIP_WITHOUT_A_GPU();
  struct Reset {
    ~Reset() { c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED); }
  } reset;
  // The mode is seen to work: a read of a device value throws under it.
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
  EXPECT_ANY_THROW((void)at::ones({1}, at::kCUDA).sum().item<float>());
  c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  for (const std::string config : {"llama3_debugmodel.toml", "qwen3_debugmodel_moe.toml"}) {
    SCOPED_TRACE(config);
    test::TempDir dir;
    Trainer t(gpu_config(dir, {"--job.config_file", kSource + "/configs/" + config, "--training.global_batch_size", "8"}));
    ASSERT_TRUE(t.device().is_cuda());
    ASSERT_EQ(t.gradient_accumulation_steps(), 2);
    std::vector<int64_t> steps_checked;
    t.set_step_callback([&](int64_t step) {
      if (step == 3 || step == 4) steps_checked.push_back(step);
      c10::cuda::warning_state().set_sync_debug_mode(step == 2 || step == 3 ? c10::cuda::SyncDebugMode::L_ERROR
                                                                            : c10::cuda::SyncDebugMode::L_DISABLED);
    });
    std::vector<double> losses;
    EXPECT_NO_THROW(losses = t.train());
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    EXPECT_EQ(steps_checked, (std::vector<int64_t>{3, 4}));
    ASSERT_EQ(losses.size(), 5u);
    for (double l : losses) EXPECT_TRUE(std::isfinite(l));
  }
#endif
}

// A batch no GPU holds, with the pre-flight memory check off: the allocator's out-of-memory error in
// the first step ends the run with the step named and what to do, and the allocator snapshot written
// at the failure loads with PyTorch's memory_viz (the reader behind pytorch.org/memory_viz).
TEST(CudaTraining, OutOfMemoryInAStepEndsTheRunWithALoadableSnapshot) {
  SKIP_WITHOUT_A_GPU();
  test::TempDir dir;
  const std::vector<std::string> argv = {
      kTitan, "train", "--job.config_file", kSource + "/configs/llama3_debugmodel.toml", "--job.dump_folder",
      dir.path(), "--model.hf_assets_path", kSource + "/assets/tokenizer", "--training.seq_len", "8192",
      "--training.local_batch_size", "512", "--training.steps", "2", "--checkpoint.enable", "false",
      "--activation_checkpoint.mode", "none", "--debug.skip_memory_check", "true",
      "--profiling.enable_memory_snapshot", "true"};
  const test::ProcessResult r = test::run_process(argv, test::with_visible_gpus({{"OMP_NUM_THREADS", "4"}}), std::chrono::seconds(300));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("out of memory at step 1"), std::string::npos) << r.output;
  const std::string snapshot = dir / "memory_snapshot/iteration_1_exit/rank0_memory_snapshot.pickle";
  EXPECT_NE(r.output.find(snapshot), std::string::npos) << r.output;
  ASSERT_TRUE(fs::exists(snapshot)) << r.output;
  const test::ProcessResult viz = test::run_process(
      {test::python(), "-c",
       "import pickle, sys\n"
       "from torch.cuda import _memory_viz\n"
       "s = pickle.load(open(sys.argv[1], 'rb'))\n"
       "assert s['segments'], 'no segments'\n"
       "html = _memory_viz.trace_plot(s)\n"
       "assert len(html) > 1000, len(html)\n"
       "print('memory_viz: %d segments, %d trace entries' % (len(s['segments']), sum(len(t) for t in s['device_traces'])))\n",
       snapshot});
  EXPECT_EQ(viz.exit_code, 0) << viz.output;
  std::printf("%s", viz.output.c_str());
}

}  // namespace
}  // namespace titan
