// JobConfig: defaults, both generations of torchtitan TOML, the shipped configs, the dump, --help.
#include "config_test_util.h"
#include "test_util.h"

#include "titan/config/legacy.h"

#include <filesystem>

namespace titan::test {
namespace {

// Defaults as torchtitan v0.2.2 declares them (torchtitan/config/job_config.py), written as TOML
// literals. model.hf_assets_path is the one deliberate difference (titan's test tokenizer lives
// in ./assets/tokenizer, torchtitan's in ./tests/assets/tokenizer).
TEST(ConfigDefaults, MatchTorchtitan) {
  const std::vector<std::pair<std::string, std::string>> torchtitan = {
      {"job.dump_folder", "\"./outputs\""},
      {"job.description", "\"default job\""},
      {"profiling.enable_profiling", "false"},
      {"profiling.save_traces_folder", "\"profile_traces\""},
      {"profiling.profile_freq", "10"},
      {"profiling.profiler_warmup", "3"},
      {"metrics.log_freq", "10"},
      {"metrics.save_tb_folder", "\"tb\""},
      {"model.name", "\"llama3\""},
      {"model.flavor", "\"debugmodel\""},
      {"model.converters", "[]"},
      {"optimizer.name", "\"AdamW\""},
      {"optimizer.lr", "0.0008"},
      {"optimizer.beta1", "0.9"},
      {"optimizer.beta2", "0.95"},
      {"optimizer.eps", "1e-08"},
      {"optimizer.weight_decay", "0.1"},
      {"optimizer.implementation", "\"fused\""},
      {"lr_scheduler.warmup_steps", "200"},
      {"lr_scheduler.total_steps", "none"},
      {"lr_scheduler.decay_ratio", "none"},
      {"lr_scheduler.decay_type", "\"linear\""},
      {"lr_scheduler.min_lr_factor", "0.0"},
      {"training.dataset", "\"c4_test\""},
      {"training.local_batch_size", "8"},
      {"training.global_batch_size", "-1"},
      {"training.seq_len", "2048"},
      {"training.max_norm", "1.0"},
      {"training.steps", "10000"},
      {"training.dtype", "\"float32\""},
      {"training.mixed_precision_param", "\"bfloat16\""},
      {"parallelism.data_parallel_replicate_degree", "1"},
      {"parallelism.data_parallel_shard_degree", "-1"},
      {"parallelism.tensor_parallel_degree", "1"},
      {"parallelism.pipeline_parallel_schedule", "\"1F1B\""},
      {"parallelism.pipeline_parallel_microbatch_size", "1"},
      {"parallelism.context_parallel_degree", "1"},
      {"parallelism.context_parallel_rotate_method", "\"allgather\""},
      {"checkpoint.enable", "false"},
      {"checkpoint.folder", "\"checkpoint\""},
      {"checkpoint.interval", "500"},
      {"checkpoint.last_save_model_only", "true"},
      {"checkpoint.export_dtype", "\"float32\""},
      {"checkpoint.async_mode", "\"disabled\""},
      {"checkpoint.keep_latest_k", "10"},
      {"checkpoint.load_step", "-1"},
      {"activation_checkpoint.mode", "\"selective\""},
      {"activation_checkpoint.selective_ac_option", "\"2\""},
      {"compile.enable", "false"},
      {"compile.components", "[\"model\", \"loss\"]"},
      {"compile.backend", "\"inductor\""},
      {"quantize.linear.float8.filter_fqns", "[]"},
      {"comm.init_timeout_seconds", "300"},
      {"comm.train_timeout_seconds", "100"},
      {"validation.dataset", "\"c4_validation\""},
      {"validation.freq", "10"},
      {"validation.steps", "-1"},
  };
  const JobConfig defaults;
  for (const auto& [path, expected] : torchtitan) EXPECT_EQ(value_of(defaults, path), expected) << path;
  EXPECT_EQ(parse({}), defaults);
}

// Each older-generation file from the seeds equals its hand-written newer-generation translation.
TEST(ConfigGenerations, OlderAndNewerSpellingsGiveTheSameConfig) {
  for (const char* name : {"seed003_old_debug", "seed000_old_8b", "seed000_old_8b_h100", "seed000_old_hsdp_tp",
                           "seed000_old_4d", "torchtitan_2024_2025_keys", "torchtitan_0_2_keys"}) {
    SCOPED_TRACE(name);
    const JobConfig older = parse({"--job.config_file", fixture(std::string(name) + ".toml")});
    const JobConfig newer = parse({"--job.config_file", fixture(std::string(name) + ".as_new.toml")});
    JobConfig a = older, b = newer;
    a.job.config_file = b.job.config_file = "";
    if (a != b) ADD_FAILURE() << "older:\n" << to_toml(a) << "\nnewer:\n" << to_toml(b);
  }
}

// Values read straight from the seed files' text.
TEST(ConfigGenerations, OlderKeysLandOnTheNewerOptions) {
  const JobConfig debug = parse({"--job.config_file", fixture("seed003_old_debug.toml")});
  EXPECT_EQ(debug.training.local_batch_size, 8);          // [training] batch_size = 8
  EXPECT_EQ(debug.lr_scheduler.warmup_steps, 2);          // [training] warmup_steps = 2
  EXPECT_EQ(debug.model.hf_assets_path, "./test/assets/test_tiktoken.model");  // tokenizer_path
  EXPECT_FALSE(debug.metrics.disable_color_printing);     // enable_color_printing = true
  EXPECT_FALSE(debug.checkpoint.last_save_model_only);    // model_weights_only = false
  EXPECT_EQ(debug.checkpoint.interval, 5);
  EXPECT_TRUE(debug.model.converters.empty());            // enable_float8_linear = false

  const JobConfig h100 = parse({"--job.config_file", fixture("seed000_old_8b_h100.toml")});
  EXPECT_EQ(h100.parallelism.data_parallel_shard_degree, 8);
  EXPECT_EQ(h100.model.converters, std::vector<std::string>{config::kFloat8Converter});  // enable_float8_linear = true

  const JobConfig eight = parse({"--job.config_file", fixture("seed000_old_8b.toml")});
  EXPECT_TRUE(eight.parallelism.disable_loss_parallel);  // enable_loss_parallel = false
  EXPECT_TRUE(eight.checkpoint.enable);                  // enable_checkpoint = true

  const JobConfig mid = parse({"--job.config_file", fixture("torchtitan_2024_2025_keys.toml")});
  EXPECT_FALSE(mid.checkpoint.last_save_model_only);     // last_save_model_weights_only = false
  EXPECT_FALSE(mid.checkpoint.initial_load_model_only);  // initial_load_model_weights_only = false
  EXPECT_EQ(mid.profiling.profile_freq, 50);             // profile_every_x_iter = 50
  EXPECT_EQ(mid.parallelism.data_parallel_shard_degree, 4);  // [training] data_parallel_degree = 4
  EXPECT_TRUE(mid.validation.enable);                    // [validation] enabled = true
  // Strings where lists go: split on commas.
  EXPECT_EQ(mid.model.converters, std::vector<std::string>{config::kFloat8Converter});  // converters = "float8"
  EXPECT_EQ(mid.float8.filter_fqns, (std::vector<std::string>{"output", "layers.0.attention.wk"}));
  EXPECT_EQ(mid.parallelism.pipeline_parallel_split_points, std::vector<std::string>{"layers.1"});

  // torchtitan 0.2's keys that titan implements, with torchtitan's defaults when absent.
  const JobConfig v02 = parse({"--job.config_file", fixture("torchtitan_0_2_keys.toml")});
  EXPECT_EQ(v02.activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns,
            (std::vector<std::string>{"moe.router.gate", "shared_experts.w1"}));
  EXPECT_EQ(v02.activation_checkpoint.determinism_check, "none");
  EXPECT_EQ(v02.comm.trace_buf_size, 0);
  EXPECT_EQ(v02.comm.save_traces_folder, "fr");
  EXPECT_EQ(v02.comm.save_traces_file_prefix, "trace_");
  const JobConfig defaults;
  EXPECT_EQ(defaults.activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns,
            std::vector<std::string>{"moe.router.gate"});
  EXPECT_EQ(defaults.activation_checkpoint.determinism_check, "default");
  EXPECT_EQ(defaults.comm.trace_buf_size, 20000);
  EXPECT_EQ(defaults.comm.save_traces_folder, "comm_traces");
  EXPECT_EQ(defaults.comm.save_traces_file_prefix, "rank_");

  const JobConfig four_d = parse({"--job.config_file", fixture("seed000_old_4d.toml")});
  EXPECT_EQ(four_d.parallelism.pipeline_parallel_degree, 8);  // [experimental] pipeline_parallel_degree
  EXPECT_EQ(four_d.parallelism.data_parallel_replicate_degree, 4);
}

TEST(ConfigGenerations, NewerSeedSnippetsParse) {
  const JobConfig custom = parse({"--job.config_file", fixture("seed002_new_8b_custom.toml")});
  EXPECT_EQ(custom.model.hf_assets_path, "./assets/hf/Llama-3.1-8B");
  EXPECT_EQ(custom.training.local_batch_size, 2);
  EXPECT_EQ(custom.training.seq_len, 8192);
  EXPECT_EQ(custom.lr_scheduler.warmup_steps, 200);
  EXPECT_DOUBLE_EQ(custom.optimizer.lr, 3e-4);
  EXPECT_EQ(custom.activation_checkpoint.selective_ac_option, "op");

  const JobConfig f8 = parse({"--job.config_file", fixture("seed002_new_float8_compile.toml")});
  EXPECT_EQ(f8.model.converters, std::vector<std::string>{"quantize.linear.float8"});
  EXPECT_TRUE(f8.float8.enable_fsdp_float8_all_gather);
  EXPECT_TRUE(f8.float8.precompute_float8_dynamic_scale_for_fsdp);
  EXPECT_EQ(f8.float8.filter_fqns, std::vector<std::string>{"output"});
  EXPECT_TRUE(f8.compile.enable);

  const JobConfig filter = parse({"--job.config_file", fixture("seed002_new_float8_filter.toml")});
  EXPECT_EQ(filter.float8.filter_fqns,
            (std::vector<std::string>{"attention.wk", "attention.wv", "output", "auto_filter_small_kn"}));

  const JobConfig pp = parse({"--job.config_file", fixture("seed002_new_405b_4d.toml")});
  EXPECT_EQ(pp.parallelism.pipeline_parallel_degree, 8);
  EXPECT_EQ(pp.training.local_batch_size, 32);
  EXPECT_EQ(parse({"--job.config_file", fixture("seed002_new_70b_parallelism.toml")}).parallelism.tensor_parallel_degree, 8);
  EXPECT_EQ(parse({"--job.config_file", fixture("seed002_new_ac_full.toml")}).activation_checkpoint.mode, "full");
  EXPECT_EQ(parse({"--job.config_file", fixture("seed002_new_grad_accum.toml")}).training.global_batch_size, 32);
}

// Every key of every TOML snippet in the seeds parses (all fixtures) and every shipped config does.
TEST(ConfigFiles, EveryFixtureAndShippedConfigParses) {
  namespace fs = std::filesystem;
  int files = 0;
  for (const char* folder : {"/tests/unit/config/fixtures", "/configs"}) {
    for (const auto& entry : fs::directory_iterator(std::string(TITAN_SOURCE_DIR) + folder)) {
      if (entry.path().extension() != ".toml") continue;
      SCOPED_TRACE(entry.path().string());
      EXPECT_NO_THROW(parse({"--job.config_file", entry.path().string()}));
      ++files;
    }
  }
  EXPECT_GE(files, 21);
}

TEST(ConfigFiles, DebugModelConfigHasTheDebugRecipeAndRuns) {
  const JobConfig cfg = parse({"--job.config_file", std::string(TITAN_SOURCE_DIR) + "/configs/llama3_debugmodel.toml"});
  EXPECT_EQ(cfg.model.flavor, "debugmodel");
  EXPECT_EQ(cfg.model.hf_assets_path, "./assets/tokenizer");
  EXPECT_EQ(cfg.training.dataset, "c4_test");
  EXPECT_EQ(cfg.training.local_batch_size, 8);
  EXPECT_EQ(cfg.training.seq_len, 2048);
  EXPECT_EQ(cfg.training.steps, 10);
  EXPECT_DOUBLE_EQ(cfg.optimizer.lr, 8e-4);
  EXPECT_EQ(cfg.lr_scheduler.warmup_steps, 2);
  EXPECT_EQ(cfg.lr_scheduler.decay_ratio, 0.8);
  EXPECT_DOUBLE_EQ(cfg.training.max_norm, 1.0);
  EXPECT_EQ(cfg.metrics.log_freq, 1);
  EXPECT_NO_THROW(check_supported(cfg, 1));
  EXPECT_TRUE(config_warnings(cfg).empty());
  // The 8B file runs on one process as far as the gate is concerned; 70B/405B ask for TP 8.
  EXPECT_NO_THROW(check_supported(parse({"--job.config_file", std::string(TITAN_SOURCE_DIR) + "/configs/llama3_8b.toml"})));
}

TEST(ConfigDump, ToTomlParsesBackToTheSameConfig) {
  JobConfig cfg = parse({"--job.config_file", fixture("seed000_old_8b.toml"), "--lr_scheduler.decay_ratio", "0.25",
                         "--training.max_norm", "0.1", "--optimizer.eps", "1e-15", "--job.description",
                         "quote \" backslash \\ tab \t newline \n end", "--model.converters", "a,b",
                         "--debug.seed", "-7", "--parallelism.module_fqns_per_model_part",
                         "tok_embeddings,layers.0;layers.1,norm,output"});
  const std::string text = to_toml(cfg);
  EXPECT_EQ(parse_config_text(text, "dump.toml"), cfg) << text;
  EXPECT_NE(text.find("\nmodule_fqns_per_model_part = [[\"tok_embeddings\", \"layers.0\"], [\"layers.1\", \"norm\", "
                      "\"output\"]]\n"), std::string::npos) << text;
  // Defaults too (unset optionals are comments).
  EXPECT_EQ(parse_config_text(to_toml(JobConfig{})), JobConfig{});
  EXPECT_NE(to_toml(JobConfig{}).find("# total_steps is unset"), std::string::npos);
  EXPECT_NE(to_toml(JobConfig{}).find("\nmodule_fqns_per_model_part = []\n"), std::string::npos);
}

// torchtitan's list[list[str]] key, as a TOML file writes it (names with escapes survive the dump).
TEST(ConfigFiles, ModuleFqnsPerModelPartIsAListOfLists) {
  using Parts = std::vector<std::vector<std::string>>;
  const JobConfig cfg = parse_config_text(
      "[parallelism]\npipeline_parallel_degree = 2\n"
      "module_fqns_per_model_part = [[\"tok_embeddings\", \"layers.0\"],\n  [\"layers.1\", \"norm\", \"output\"]]\n");
  EXPECT_EQ(cfg.parallelism.module_fqns_per_model_part,
            (Parts{{"tok_embeddings", "layers.0"}, {"layers.1", "norm", "output"}}));
  EXPECT_EQ(value_of(cfg, "parallelism.module_fqns_per_model_part"),
            "[[\"tok_embeddings\", \"layers.0\"], [\"layers.1\", \"norm\", \"output\"]]");
  EXPECT_TRUE(parse_config_text("[parallelism]\nmodule_fqns_per_model_part = []\n").parallelism.module_fqns_per_model_part.empty());
  const JobConfig odd = parse_config_text("[parallelism]\nmodule_fqns_per_model_part = [[\"a\\\"b\", \"c,d;e\"], [\"\\\\\"]]\n");
  EXPECT_EQ(odd.parallelism.module_fqns_per_model_part, (Parts{{"a\"b", "c,d;e"}, {"\\"}}));
  EXPECT_EQ(parse_config_text(to_toml(odd)), odd) << to_toml(odd);
}

TEST(ConfigHelp, ListsEveryKeyWithItsDefaultAndEveryOlderSpelling) {
  const std::string help = config_help();
  JobConfig defaults;
  for (const auto& f : config::fields_of(defaults)) {
    const std::string line = "\n  --" + f.path() + " ";
    const size_t at = help.find(line);
    ASSERT_NE(at, std::string::npos) << f.path();
    const std::string rest = help.substr(at + 1, help.find('\n', at + 1) - at - 1);
    EXPECT_NE(rest.find("(default: " + config::format_value(f.value) + ")"), std::string::npos) << rest;
  }
  for (const auto& s : config::sections()) EXPECT_NE(help.find("[" + s.name + "]"), std::string::npos) << s.name;
  for (const auto& l : config::legacy_keys())
    EXPECT_NE(help.find("[" + std::string(l.section) + "] " + l.key + ":"), std::string::npos) << l.key;
  EXPECT_TRUE(help_requested({"--training.steps", "3", "--help"}));
  EXPECT_TRUE(help_requested({"-h"}));
  EXPECT_FALSE(help_requested({"--training.steps", "3"}));
}

TEST(ConfigHelp, ASectionOrKeyPrefixShowsOnlyItsOptions) {
  auto count = [](const std::string& text) {
    size_t n = 0;
    for (size_t at = text.find("\n  --"); at != std::string::npos; at = text.find("\n  --", at + 1)) ++n;
    return n + (text.rfind("  --", 0) == 0);
  };
  JobConfig defaults;
  size_t in_training = 0;
  for (const auto& f : config::fields_of(defaults)) in_training += f.section == "training";
  for (const std::string topic : {"training", "[training]"}) {
    const std::string help = config_help(topic);
    EXPECT_EQ(help.rfind("[training]  ", 0), 0u) << help;
    EXPECT_EQ(count(help), in_training) << help;
    EXPECT_NE(help.find("--training.seq_len INT  (default: 2048)"), std::string::npos) << help;
    EXPECT_EQ(help.find("--job."), std::string::npos) << help;
    EXPECT_EQ(help.find("Older torchtitan spellings"), std::string::npos) << help;
  }
  // A key prefix, with or without the dashes; a dotted section; a word inside key names.
  EXPECT_EQ(count(config_help("training.seq")), 1u) << config_help("training.seq");
  EXPECT_EQ(config_help("--training.seq_len"), config_help("training.seq"));
  EXPECT_NE(config_help("quantize.linear.float8").find("--quantize.linear.float8.recipe_name"), std::string::npos);
  const std::string word = config_help("preemption");
  EXPECT_NE(word.find("--job.preemption_signals"), std::string::npos) << word;
  EXPECT_NE(word.find("--job.preemption_grace_seconds"), std::string::npos) << word;
  EXPECT_EQ(word.find("--job.dump_folder"), std::string::npos) << word;
  // Nothing matches: the error names the nearest section and lists them.
  const std::string e = error_of([] { config_help("trainig"); });
  EXPECT_NE(e.find("--help trainig: no section or option matches (did you mean training?)"), std::string::npos) << e;
  EXPECT_NE(e.find("the sections are job, "), std::string::npos) << e;
  EXPECT_EQ(help_topic({"--help", "training"}), "training");
  EXPECT_EQ(help_topic({"--help=checkpoint"}), "checkpoint");
  EXPECT_EQ(help_topic({"--help", "--training.steps", "3"}), "");
  EXPECT_EQ(help_topic({"--training.steps", "3", "-h"}), "");
  EXPECT_TRUE(help_requested({"--help=training"}));
}

}  // namespace
}  // namespace titan::test
