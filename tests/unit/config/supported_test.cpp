// The feature gate and the sanity checks.
#include "config_test_util.h"

namespace titan::test {
namespace {

// A config the gate accepts: torchtitan's defaults with activation checkpointing off.
JobConfig runnable() { return parse({"--activation_checkpoint.mode", "none"}); }

TEST(ConfigSupported, DefaultsPassTheGate) {
  // torchtitan's defaults: selective activation checkpointing of every 2nd block.
  EXPECT_NO_THROW(check_supported(JobConfig{}));
  EXPECT_NO_THROW(check_supported(runnable()));
  EXPECT_NO_THROW(check_supported(parse({"--activation_checkpoint.mode", "full"})));
  EXPECT_NO_THROW(check_supported(parse({"--activation_checkpoint.selective_ac_option", "3"})));
  EXPECT_NO_THROW(check_supported(parse({"--activation_checkpoint.mode", "memory_budget"})));  // without compile
  EXPECT_NO_THROW(check_supported(parse({"--parallelism.pipeline_parallel_degree", "2"})));
  EXPECT_NO_THROW(check_supported(parse({"--parallelism.context_parallel_degree", "2"})));
}

TEST(ConfigSupported, EachGatedFeatureIsAnErrorNamingItsKey) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--compile.enable"}, "--compile.enable false"},
      {{"--training.compile"}, "compile.enable = true"},
      {{"--metrics.enable_wandb"}, "--metrics.enable_wandb false; the same metrics go to TensorBoard files"},
      {{"--metrics.enable_wandb"}, "`titan report DUMP_FOLDER`"},
      {{"--fault_tolerance.enable"}, "fault_tolerance.enable"},
      {{"--experimental.custom_import", "my.models"}, "experimental.custom_import = \"my.models\""},
  };
  for (const auto& [args, expected] : cases) {
    std::vector<std::string> all = {"--activation_checkpoint.mode", "none"};
    all.insert(all.end(), args.begin(), args.end());
    const JobConfig cfg = parse(all);
    const std::string e = user_error([&] { check_supported(cfg); });
    EXPECT_NE(e.find(expected), std::string::npos) << args[0] << ": " << e;
    EXPECT_NE(e.find("not supported yet"), std::string::npos) << e;
  }
}

TEST(ConfigSupported, Float8IsNotGated) {
  // The float8 converter (both generations) passes the gate; its options are checked when the run
  // starts (docs/float8.md, tests/unit/distributed/float8_train_test.cpp).
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--model.converters", "float8"},
                                               std::vector<std::string>{"--float8.enable_float8_linear"}}) {
    const JobConfig cfg = parse(args);
    EXPECT_EQ(cfg.model.converters, std::vector<std::string>{"quantize.linear.float8"});
    EXPECT_NO_THROW(check_supported(cfg)) << args[0];
  }
}

TEST(ConfigSupported, AllProblemsAreListedAtOnce) {
  const JobConfig cfg = parse({"--compile.enable", "--fault_tolerance.enable", "--metrics.enable_wandb"});
  const std::string e = user_error([&] { check_supported(cfg); });
  for (const char* key : {"metrics.enable_wandb", "compile.enable", "fault_tolerance.enable"})
    EXPECT_NE(e.find(key), std::string::npos) << key;
}

TEST(ConfigSupported, ProfilingMemorySnapshotsAndValidationAreSupported) {
  EXPECT_NO_THROW(check_supported(parse({"--profiling.enable_profiling", "--profiling.enable_memory_snapshot",
                                         "--validation.enable"}),
                                  2));
}

TEST(ConfigSupported, TensorParallelismIsSupported) {
  EXPECT_NO_THROW(check_supported(parse({"--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_async_tensor_parallel",
                                         "--parallelism.enable_sequence_parallel", "--parallelism.disable_loss_parallel"}),
                                  2));
  // Async TP without TP does nothing: a warning says so.
  const auto warnings = config_warnings(parse({"--parallelism.enable_async_tensor_parallel"}));
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("no effect without tensor parallelism"), std::string::npos) << warnings[0];
}

TEST(ConfigSupported, CheckpointsAreSupported) {
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"--checkpoint.enable"}, {"--checkpoint.enable_checkpoint"}, {"--checkpoint.enable", "--checkpoint.create_seed_checkpoint"}}) {
    std::vector<std::string> all = {"--activation_checkpoint.mode", "none"};
    all.insert(all.end(), args.begin(), args.end());
    EXPECT_NO_THROW(check_supported(parse(all))) << args[0];
  }
}

TEST(ConfigSupported, DataParallelismIsSupported) {
  // FSDP, HSDP and DDP exist: the data-parallel degrees pass the gate at any world size, and so do
  // gradient accumulation and TensorBoard.
  const JobConfig cfg = runnable();  // data_parallel_shard_degree = -1
  EXPECT_NO_THROW(check_supported(cfg, 1));
  EXPECT_NO_THROW(check_supported(cfg, 4));
  EXPECT_NO_THROW(check_supported(parse({"--activation_checkpoint.mode", "none", "--parallelism.data_parallel_replicate_degree",
                                         "2", "--training.global_batch_size", "32", "--metrics.enable_tensorboard"}),
                                  4));
}

TEST(ConfigValidate, SanityChecks) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--training.steps", "0"}, "training.steps must be positive, got 0"},
      {{"--training.local_batch_size", "-2"}, "training.local_batch_size must be positive"},
      {{"--training.batch_size", "0"}, "training.local_batch_size must be positive"},
      {{"--training.seq_len", "0"}, "training.seq_len must be positive"},
      {{"--training.global_batch_size", "12"}, "must be a multiple of training.local_batch_size"},
      {{"--lr_scheduler.warmup_steps", "-1"}, "lr_scheduler.warmup_steps must not be negative"},
      {{"--lr_scheduler.decay_ratio", "1.5"}, "lr_scheduler.decay_ratio must be between 0 and 1"},
      {{"--parallelism.data_parallel_shard_degree", "0"}, "must be -1 (the ranks left over) or at least 1"},
      {{"--parallelism.tensor_parallel_degree", "0"}, "parallelism.tensor_parallel_degree must be positive"},
      {{"--checkpoint.keep_latest_k", "1"}, "checkpoint.keep_latest_k must be 0"},
      {{"--activation_checkpoint.selective_ac_option", "every"}, "must be 'op' or a positive integer"},
      {{"--activation_checkpoint.per_op_policy", "all_matmuls"},
       "activation_checkpoint.per_op_policy 'all_matmuls' chooses what the per-operator policy keeps, which runs only "
       "with mode = \"selective\" and selective_ac_option = \"op\""},
      {{"--metrics.log_freq", "0"}, "metrics.log_freq must be positive"},
      {{"--model.moe_aux_loss_coeff", "-0.01"}, "model.moe_aux_loss_coeff must be a finite number >= 0"},
      {{"--validation.steps", "0"}, "validation.steps must be positive or -1"},
      {{"--parallelism.module_fqns_per_model_part", "layers.0;"},
       "parallelism.module_fqns_per_model_part: model part 1 is empty"},
      {{"--parallelism.module_fqns_per_model_part", "layers.0;layers.1,,output"},
       "parallelism.module_fqns_per_model_part: model part 1 has an empty module name"},
  };
  for (const auto& [args, expected] : cases) {
    const std::string e = user_error([&] { parse(args); });
    EXPECT_NE(e.find(expected), std::string::npos) << args[0] << ": " << e;
  }
}

TEST(ConfigValidate, WarmupLongerThanTheRunIsClampedWithAWarning) {
  // torchtitan shortens warmup to the total steps (and then the decay) instead of failing.
  const JobConfig cfg = parse({"--training.steps", "10", "--lr_scheduler.warmup_steps", "20"});
  const auto warnings = config_warnings(cfg);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("warmup is shortened to 10 steps"), std::string::npos) << warnings[0];
  const auto wsd = config_warnings(parse({"--training.steps", "10", "--lr_scheduler.warmup_steps", "5",
                                          "--lr_scheduler.decay_ratio", "0.8"}));
  ASSERT_EQ(wsd.size(), 1u);
  EXPECT_NE(wsd[0].find("decay is shortened to 5 steps"), std::string::npos) << wsd[0];
  EXPECT_TRUE(config_warnings(parse({"--training.steps", "10", "--lr_scheduler.warmup_steps", "2",
                                     "--lr_scheduler.decay_ratio", "0.8"})).empty());
}

}  // namespace
}  // namespace titan::test
