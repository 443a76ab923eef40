// Float8 training of the debug model through the real binary (model.converters =
// ["quantize.linear.float8"], real float8 matmuls on the CPU).
//
// Against fp32: 100 steps of every recipe track the fp32 run's losses within 1% at every step and
// never diverge. The bound: each float8 cast rounds to 3 mantissa bits (e4m3; e5m2 keeps 2 for
// gradients), a relative error of at most 2^-4 per element; summed over a matmul's K terms these
// errors mostly cancel, leaving the layers' outputs within a few percent and the loss, an average
// over 256 tokens, within well under 1% (0.1% measured over these 100 steps on this model); a
// mistake in a cast or a scale (a wrong axis, a missing reciprocal) moves it by far more.
//
// Across layouts: under rowwise_with_gw_hp every scale belongs to one token's row or to a whole
// weight (the weight's gradient is in high precision), so the casts do not depend on how the batch
// is split: FSDP 2, PP 2, CP 2 and per-operator activation checkpointing (the float8 matmuls'
// outputs kept) train as one process does. Not within fp32 rounding, though: the layouts sum in
// other orders (gradients over ranks, ring attention), and a value a rounding error away from a
// float8 rounding boundary lands on the other side, one float8 step (up to 2^-3 relative) away.
// The losses stay within 1e-4 relative at every step (1.6e-5 measured), 10 times closer than the
// float8 run is to fp32's; the weights are not compared (Adam turns a flipped rounding in a tiny
// gradient into a whole step). (tensorwise and rowwise take scales over a rank's tokens, which
// differ from one process's.)
#include "launched_training.h"
#include "test_util.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace titan {
namespace {

const std::string kSource = TITAN_SOURCE_DIR;

std::vector<std::string> train_args(const std::string& dump, int steps, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"train", "--job.config_file", kSource + "/configs/llama3_debugmodel.toml",
                                   "--job.dump_folder", dump, "--training.seq_len", "32", "--training.local_batch_size",
                                   "8", "--training.global_batch_size", "8", "--training.steps", std::to_string(steps),
                                   "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "50"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

std::vector<std::string> float8(const std::string& recipe) {
  return {"--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name", recipe};
}

TEST(Float8Training, EveryRecipeTracksTheFp32RunFor100StepsAndNeverDiverges) {
  constexpr int kSteps = 100;
  test::TempDir ref_dir;
  const test::LaunchedRun ref = test::run_titan(1, train_args(ref_dir.path(), kSteps), ref_dir);
  ASSERT_EQ(ref.exit_code, 0);
  const at::Tensor want = ref.weights.at("__losses__");
  for (const std::string recipe : {"tensorwise", "rowwise", "rowwise_with_gw_hp"}) {
    SCOPED_TRACE(recipe);
    test::TempDir dir;
    const test::LaunchedRun r = test::run_titan(1, train_args(dir.path(), kSteps, float8(recipe)), dir);
    ASSERT_EQ(r.exit_code, 0);
    // The shipped debug config keeps the output layer in high precision (filter_fqns = ["output"]).
    EXPECT_NE(r.output.find("float8 linear layers (recipe " + recipe + "): 42 converted; kept in high precision: "
                            "output (filter_fqns \"output\")"),
              std::string::npos)
        << r.output;
    const at::Tensor have = r.weights.at("__losses__");
    ASSERT_EQ(have.numel(), kSteps);
    EXPECT_TRUE(at::isfinite(have).all().item<bool>());
    const at::Tensor relative = ((have - want) / want).abs();
    EXPECT_LT(relative.max().item<double>(), 0.01) << relative;
    EXPECT_GT(relative[0].item<double>(), 1e-6) << "the first step equals fp32's: no float8 rounding";
    EXPECT_LT(have[kSteps - 1].item<double>(), have[0].item<double>() - 1.0);  // it learns
    std::printf("[float8 %s] largest relative loss difference to fp32 over %d steps: %.2e\n", recipe.c_str(), kSteps,
                relative.max().item<double>());
  }
}

TEST(Float8Training, RowwiseWithHighPrecisionWeightGradientsTrainsAsOneProcessUnderEveryLayout) {
  constexpr int kSteps = 10;
  const std::vector<std::string> f8 = float8("rowwise_with_gw_hp");
  test::TempDir ref_dir;
  const test::LaunchedRun ref = test::run_titan(1, train_args(ref_dir.path(), kSteps, f8), ref_dir);
  ASSERT_EQ(ref.exit_code, 0);
  struct Layout {
    std::string name;
    std::vector<std::string> args;
    int nproc;
  };
  const std::vector<Layout> layouts = {
      {"fsdp2", {"--training.local_batch_size", "4"}, 2},
      {"pp2", {"--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"}, 2},
      {"cp2", {"--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"}, 2},
      {"per_operator_ac", {"--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"}, 1},
  };
  for (const Layout& l : layouts) {
    SCOPED_TRACE(l.name);
    test::TempDir dir;
    std::vector<std::string> extra = f8;
    extra.insert(extra.end(), l.args.begin(), l.args.end());
    const test::LaunchedRun r = test::run_titan(l.nproc, train_args(dir.path(), kSteps, extra), dir,
                                                {{"TITAN_P2P_ORDER_MATCHED", "1"}});
    if (r.exit_code != 0) continue;
    const at::Tensor want = ref.weights.at("__losses__"), have = r.weights.at("__losses__");
    ASSERT_EQ(have.numel(), kSteps);
    EXPECT_LT(((have - want) / want).abs().max().item<double>(), 1e-4) << have << want;
  }
}

TEST(Float8Training, TensorParallelLayersCastAsOneDevice) {
  // Under TP every rank holds all the tokens (sequence parallel gathers them into the regions), and
  // the amaxes of split operands are taken over the tp ranks (column-wise: the weight, the output
  // gradient; row-wise: the input, the weight), so every cast is one process's (checked exactly,
  // layer by layer, by Float8Linear.SplitLayersCastAsOneDevice). Here the whole model under TP 2,
  // with sequence parallel and without: the losses within 1e-4 relative of one process's (float8
  // roundings moved by reordered sums, as above).
  constexpr int kSteps = 10;
  for (const std::string recipe : {"tensorwise", "rowwise"}) {
    SCOPED_TRACE(recipe);
    test::TempDir ref_dir;
    const test::LaunchedRun ref = test::run_titan(1, train_args(ref_dir.path(), kSteps, float8(recipe)), ref_dir);
    ASSERT_EQ(ref.exit_code, 0);
    for (const std::string sp : recipe == "tensorwise" ? std::vector<std::string>{"true", "false"}
                                                        : std::vector<std::string>{"true"}) {
      SCOPED_TRACE("sequence parallel " + sp);
      test::TempDir dir;
      std::vector<std::string> extra = float8(recipe);
      extra.insert(extra.end(), {"--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel", sp});
      const test::LaunchedRun r = test::run_titan(2, train_args(dir.path(), kSteps, extra), dir);
      if (r.exit_code != 0) continue;
      const at::Tensor want = ref.weights.at("__losses__"), have = r.weights.at("__losses__");
      const double worst = ((have - want) / want).abs().max().item<double>();
      EXPECT_LT(worst, 1e-4) << have << want;
      std::printf("[float8 %s, TP 2, sequence parallel %s] largest relative loss difference to one process: %.2e\n",
                  recipe.c_str(), sp.c_str(), worst);
    }
  }
}

// FSDP's float8 all-gather (enable_fsdp_float8_all_gather, and with precompute_float8_dynamic_scale_
// for_fsdp): each float8 weight's shard is cast with the scale of the whole weight before the
// all-gather. On the CPU FSDP gathers fp32 (param_dtype), and the layer without the all-gather
// casts the gathered fp32 weight with the same amax (the largest shard amax), so the bytes it
// multiplies are the same: the runs equal the float8 runs without the all-gather bit for bit, under
// FSDP, FSDP + TP (amaxes also over the tp ranks) with full activation checkpointing (the layer
// recomputed in backward from the re-gathered float8 weight), and PP + FSDP (units kept gathered
// across micro-batches). The bytes: every float8 weight element moves 1 byte instead of 4 (on a GPU,
// instead of bf16's 2), the rest of each unit as before, one all-gather per unit as before; the
// scales cost one all-reduce per unit and micro-batch (at its first gather; the backward's gather
// reuses them), or with precomputation one per step after the first.
TEST(Float8Training, FsdpFloat8AllGatherMovesOneBytePerWeightElementAndTrainsAsTheLayersOwnCasts) {
  constexpr int kSteps = 4;
  const std::vector<std::string> all_gather = {"--quantize.linear.float8.enable_fsdp_float8_all_gather"};
  const std::vector<std::string> precompute = {"--quantize.linear.float8.enable_fsdp_float8_all_gather",
                                               "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"};
  struct Layout {
    std::string name;
    std::vector<std::string> args;
    int nproc;
    std::vector<std::vector<std::string>> variants;
  };
  const std::vector<std::string> dp2 = {"--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"};
  std::vector<std::string> tp_ac = dp2, pp = dp2;
  tp_ac.insert(tp_ac.end(), {"--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "full"});
  pp.insert(pp.end(), {"--parallelism.pipeline_parallel_degree", "2"});
  const std::vector<Layout> layouts = {{"fsdp2", dp2, 2, {all_gather, precompute}},
                                       {"fsdp2_tp2_full_ac", tp_ac, 4, {all_gather, precompute}},
                                       {"pp2_fsdp2", pp, 4, {precompute}}};
  for (const Layout& l : layouts) {
    SCOPED_TRACE(l.name);
    std::vector<std::string> base_args = float8("tensorwise");
    base_args.insert(base_args.end(), l.args.begin(), l.args.end());
    test::TempDir base_dir;
    const test::LaunchedRun base = test::run_titan(l.nproc, train_args(base_dir.path(), kSteps, base_args), base_dir,
                                                   {{"TITAN_P2P_ORDER_MATCHED", "1"}});
    ASSERT_EQ(base.exit_code, 0);
    for (const auto& variant : l.variants) {
      const bool precomputed = variant.size() == 2;
      SCOPED_TRACE(precomputed ? "precomputed scales" : "scales at each gather");
      std::vector<std::string> args = base_args;
      args.insert(args.end(), variant.begin(), variant.end());
      test::TempDir dir;
      const test::LaunchedRun r =
          test::run_titan(l.nproc, train_args(dir.path(), kSteps, args), dir, {{"TITAN_P2P_ORDER_MATCHED", "1"}});
      if (r.exit_code != 0) continue;
      EXPECT_NE(r.output.find("float8 all-gather: FSDP gathers"), std::string::npos) << r.output;
      ASSERT_EQ(r.weights.size(), base.weights.size());
      for (const auto& [name, want] : base.weights) {
        ASSERT_TRUE(r.weights.count(name)) << name;
        EXPECT_TRUE(at::equal(r.weights.at(name), want)) << name << " differs from the run without the float8 all-gather";
      }
      if (l.name != "fsdp2") continue;
      // The debug model's blocks: wq, wk, wv, wo 256 x 256, w1, w3 768 x 256, w2 256 x 768 float8.
      // Per step 11 block gathers (6 in forward, 5 again in backward: the last block stays
      // gathered), each of F elements over the 2 ranks; 6 of them (the forward's) reduce amaxes.
      const int64_t F = 4 * 256 * 256 + 3 * 768 * 256, gathers = 11, blocks = 6, per_weight = 7;
      for (size_t rank = 0; rank < r.comm.size(); ++rank) {
        const nlohmann::json &have = r.comm[rank], &want = base.comm[rank];
        EXPECT_EQ(test::comm_bytes_per_step(want, "dp_shard_cp", "all_gather") -
                      test::comm_bytes_per_step(have, "dp_shard_cp", "all_gather"),
                  gathers * F * (4 - 1));
        EXPECT_EQ(have["calls"]["dp_shard_cp"]["all_gather"], want["calls"]["dp_shard_cp"]["all_gather"]);
        const int64_t extra_all_reduces = have["calls"]["dp_shard_cp"]["all_reduce"].get<int64_t>() -
                                          want["calls"]["dp_shard_cp"]["all_reduce"].get<int64_t>();
        const int64_t extra_all_reduce_bytes = have["bytes"]["dp_shard_cp"]["all_reduce"].get<int64_t>() -
                                               want["bytes"]["dp_shard_cp"]["all_reduce"].get<int64_t>();
        if (precomputed) {  // the first step's, then one all-reduce of the 42 amaxes per step
          EXPECT_EQ(extra_all_reduces, blocks + kSteps);
          EXPECT_EQ(extra_all_reduce_bytes, 4 * (blocks * per_weight + kSteps * blocks * per_weight));
        } else {
          EXPECT_EQ(extra_all_reduces, kSteps * blocks);
          EXPECT_EQ(extra_all_reduce_bytes, 4 * kSteps * blocks * per_weight);
        }
      }
    }
  }
}

// MoE experts in float8 ("quantize.grouped_mm.float8", fqns = ["experts"]), on the small Qwen3-MoE:
// 30 steps track the fp32 run within 1% at every step and learn. Under expert parallelism (EP 2 over
// FSDP 2) each expert's token group holds the tokens every rank routed to it, those of one process,
// so its jagged scales are one process's; with the dense layers under rowwise_with_gw_hp (whose
// scales never span a rank's tokens) the run trains as one process does, within 1e-4 of its losses
// at every step (float8 roundings moved by reordered sums, as above).
TEST(Float8Training, MoeExpertsInFloat8TrackFp32AndTrainUnderExpertParallelismAsOneProcess) {
  const std::vector<std::string> moe = {"--job.config_file", kSource + "/configs/qwen3_debugmodel.toml", "--model.flavor",
                                        test::qwen3_moe_config().dump()};
  const std::vector<std::string> grouped = {"--model.converters", "quantize.grouped_mm.float8",
                                            "--quantize.grouped_mm.float8.fqns", "experts"};
  auto args = [&](const std::string& dump, int steps, std::vector<std::string> extra) {
    std::vector<std::string> a = train_args(dump, steps, moe);
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  {
    constexpr int kSteps = 30;
    test::TempDir ref_dir, dir;
    const test::LaunchedRun ref = test::run_titan(1, args(ref_dir.path(), kSteps, {}), ref_dir);
    const test::LaunchedRun r = test::run_titan(1, args(dir.path(), kSteps, grouped), dir);
    ASSERT_EQ(ref.exit_code, 0);
    ASSERT_EQ(r.exit_code, 0);
    EXPECT_NE(r.output.find("float8 grouped matmuls (rowwise) of MoE experts: layers.1.moe.experts, layers.2.moe.experts"),
              std::string::npos)
        << r.output;
    const at::Tensor want = ref.weights.at("__losses__"), have = r.weights.at("__losses__");
    ASSERT_EQ(have.numel(), kSteps);
    const at::Tensor relative = ((have - want) / want).abs();
    EXPECT_LT(relative.max().item<double>(), 0.01) << relative;
    EXPECT_GT(relative.max().item<double>(), 1e-7) << "no float8 rounding";
    // It learns as fp32 does (this small model's loss falls by ~0.06 over these steps).
    EXPECT_LT(have[kSteps - 1].item<double>(), have[0].item<double>() - 0.03) << have;
    std::printf("[float8 MoE experts] largest relative loss difference to fp32 over %d steps: %.2e\n", kSteps,
                relative.max().item<double>());
  }
  constexpr int kSteps = 10;
  std::vector<std::string> both = {"--model.converters", "quantize.linear.float8,quantize.grouped_mm.float8",
                                   "--quantize.grouped_mm.float8.fqns", "experts",
                                   "--quantize.linear.float8.recipe_name", "rowwise_with_gw_hp"};
  test::TempDir ref_dir, dir;
  const test::LaunchedRun ref = test::run_titan(1, args(ref_dir.path(), kSteps, both), ref_dir);
  ASSERT_EQ(ref.exit_code, 0);
  std::vector<std::string> ep = both;
  ep.insert(ep.end(), {"--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2",
                       "--training.local_batch_size", "4"});
  const test::LaunchedRun r = test::run_titan(2, args(dir.path(), kSteps, ep), dir);
  ASSERT_EQ(r.exit_code, 0);
  EXPECT_NE(r.output.find("float8 grouped matmuls (rowwise) of MoE experts"), std::string::npos) << r.output;
  const at::Tensor want = ref.weights.at("__losses__"), have = r.weights.at("__losses__");
  const double worst = ((have - want) / want).abs().max().item<double>();
  EXPECT_LT(worst, 1e-4) << have << want;
  std::printf("[float8 MoE experts, EP 2] largest relative loss difference to one process: %.2e\n", worst);
}

// Checkpoints hold the high-precision weights: a float8 run stopped at step 3 and resumed under
// float8 trains as the uninterrupted float8 run did (losses within 1e-5, the weights within 1e-6),
// and resumed without float8 (or a run saved without float8 resumed under it) continues from the
// same weights: its losses stay within float8's 1% of the float8 run's.
TEST(Float8Training, CheckpointsHoldHighPrecisionWeightsAndResumeWithOrWithoutFloat8) {
  const std::vector<std::string> ckpt = {"--lr_scheduler.total_steps", "6", "--checkpoint.enable", "--checkpoint.interval",
                                         "3", "--checkpoint.last_save_model_only", "false"};
  auto args = [&](const std::string& dump, int steps, bool f8) {
    std::vector<std::string> extra = ckpt;
    if (f8) {
      const std::vector<std::string> c = float8("tensorwise");
      extra.insert(extra.end(), c.begin(), c.end());
    }
    return train_args(dump, steps, extra);
  };
  test::TempDir straight_dir;
  const test::LaunchedRun straight = test::run_titan(1, args(straight_dir.path(), 6, true), straight_dir);
  ASSERT_EQ(straight.exit_code, 0);
  for (const auto& [first, then] : std::vector<std::pair<bool, bool>>{{true, true}, {true, false}, {false, true}}) {
    SCOPED_TRACE(std::string("saved ") + (first ? "under float8" : "without float8") + ", resumed " +
                 (then ? "under float8" : "without"));
    test::TempDir dir;
    ASSERT_EQ(test::run_titan(1, args(dir.path(), 3, first), dir).exit_code, 0);
    const test::LaunchedRun resumed = test::run_titan(1, args(dir.path(), 6, then), dir);
    ASSERT_EQ(resumed.exit_code, 0);
    EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
    EXPECT_NE(resumed.output.find("continuing at step 4"), std::string::npos) << resumed.output;
    const at::Tensor have = resumed.weights.at("__losses__"), want = straight.weights.at("__losses__").slice(0, 3);
    ASSERT_EQ(have.numel(), 3);
    if (first && then) {
      test::expect_same_training(straight.weights, resumed.weights, 1e-6, 4);
    } else {
      const double worst = ((have - want) / want).abs().max().item<double>();
      EXPECT_LT(worst, 0.01) << have << want;
      EXPECT_GT(worst, 1e-7) << "a run without float8 equals the float8 run";
    }
  }
}

TEST(Float8Training, BadConvertersAndOptionsAreRefusedAtStartUp) {
  auto refused = [](std::vector<std::string> extra, const std::string& says, int nproc = 1) {
    SCOPED_TRACE(says);
    test::TempDir dir;
    std::vector<std::string> argv = {std::string(TITAN_BINARY_DIR) + "/titan"};
    if (nproc > 1) argv.insert(argv.end(), {"launch", "--nproc-per-node", std::to_string(nproc), "--master-port", "0", "--"});
    for (const auto& a : train_args(dir.path(), 2, extra)) argv.push_back(a);
    const test::ProcessResult r = test::run_process(argv, {{"OMP_NUM_THREADS", "1"}});
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find(says), std::string::npos) << r.output;
  };
  refused({"--model.converters", "quantize.linear.int4"}, "model.converters \"quantize.linear.int4\" is not a model converter");
  refused({"--model.converters", "quantize.linear.mx"}, "MX formats (MXFP8, MXFP4) are not supported");
  refused({"--model.converters", "quantize.linear.float8,quantize.grouped_mm.float8"},
          "converts the MoE modules named in quantize.grouped_mm.float8.fqns, which is empty");
  refused({"--model.converters", "quantize.grouped_mm.float8", "--quantize.grouped_mm.float8.fqns", "experts"},
          "converted no MoE experts: the model has no mixture-of-experts layer");
  refused({"--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name", "blockwise"},
          "\"blockwise\" is not one of \"\", \"tensorwise\", \"rowwise\", \"rowwise_with_gw_hp\"");
  refused({"--model.converters", "float8", "--quantize.linear.float8.filter_fqns", "layers,output,tok"},
          "converted no linear layer");
  refused({"--model.converters", "float8", "--parallelism.tensor_parallel_degree", "2",
           "--parallelism.enable_async_tensor_parallel"},
          "with parallelism.enable_async_tensor_parallel are not supported yet", 2);
  refused({"--model.converters", "float8", "--quantize.linear.float8.enable_fsdp_float8_all_gather",
           "--quantize.linear.float8.recipe_name", "rowwise"},
          "enable_fsdp_float8_all_gather needs the tensorwise recipe");
  refused({"--model.converters", "float8", "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"},
          "set enable_fsdp_float8_all_gather = true as well");
  refused({"--model.converters", "float8", "--quantize.linear.float8.recipe_name", "rowwise_with_gw_hp",
           "--quantize.linear.float8.filter_fqns", "auto_filter_small_kn"},
          "has size rules for the tensorwise and rowwise recipes only");
  {
    // DeepSeek-V3's latent projection under TP (its output gradient a partial sum over the ranks).
    test::TempDir dir;
    std::vector<std::string> argv = {std::string(TITAN_BINARY_DIR) + "/titan", "launch", "--nproc-per-node", "2",
                                     "--master-port", "0", "--", "train", "--job.config_file",
                                     kSource + "/configs/deepseek_v3_debugmodel.toml", "--job.dump_folder", dir.path(),
                                     "--training.seq_len", "32", "--training.steps", "1", "--model.converters", "float8",
                                     "--parallelism.tensor_parallel_degree", "2"};
    const test::ProcessResult r = test::run_process(argv, {{"OMP_NUM_THREADS", "1"}});
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("float8 linear layer layers.0.attention.wkv_a under tensor parallelism"), std::string::npos)
        << r.output;
  }
}

TEST(Float8Training, FilterFqnsKeepLayersInHighPrecisionAndThePrintedTreeSaysWhich) {
  test::TempDir dir;
  const test::LaunchedRun r = test::run_titan(
      1, train_args(dir.path(), 1, {"--model.converters", "quantize.linear.float8", "--quantize.linear.float8.filter_fqns",
                                    "output,feed_forward.w2", "--model.print_after_conversion"}),
      dir);
  ASSERT_EQ(r.exit_code, 0);
  // 6 layers x (4 attention + 3 feed-forward) + output = 43 linears; output and 6 w2 kept.
  EXPECT_NE(r.output.find("float8 linear layers (recipe tensorwise): 36 converted; kept in high precision: "
                          "layers.0.feed_forward.w2 (filter_fqns \"feed_forward.w2\")"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("output (filter_fqns \"output\")"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("      wq: Linear weight(256, 256) float8 tensorwise"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("      w2: Linear weight(256, 768)\n"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace titan
