// Command-line overrides: precedence, booleans, --key=value, lists, older spellings.
#include "config_test_util.h"

#include "test_util.h"

#include <fstream>

namespace titan::test {
namespace {

std::string write(const TempDir& dir, const std::string& name, const std::string& text) {
  const std::string path = dir / name;
  std::ofstream(path) << text;
  return path;
}

TEST(ConfigCli, CommandLineOverridesFileOverridesDefaults) {
  TempDir dir;
  const std::string file = write(dir, "c.toml", "[training]\nsteps = 20\nseq_len = 512\n");
  const JobConfig cfg = parse({"--training.steps", "30", "--job.config_file", file});
  EXPECT_EQ(cfg.training.steps, 30);            // command line, although given before the file
  EXPECT_EQ(cfg.training.seq_len, 512);         // file
  EXPECT_EQ(cfg.training.local_batch_size, 8);  // default
  EXPECT_EQ(cfg.job.config_file, file);
  // The last of repeated options wins.
  EXPECT_EQ(parse({"--training.steps", "5", "--training.steps=6"}).training.steps, 6);
}

TEST(ConfigCli, EqualsFormAndDashesInNames) {
  const JobConfig cfg = parse({"--training.seq_len=4096", "--optimizer.lr=1.5e-4", "--job.dump-folder=/tmp/x",
                               "--parallelism.data_parallel_shard_degree", "-1"});
  EXPECT_EQ(cfg.training.seq_len, 4096);
  EXPECT_DOUBLE_EQ(cfg.optimizer.lr, 1.5e-4);
  EXPECT_EQ(cfg.job.dump_folder, "/tmp/x");
  EXPECT_EQ(cfg.parallelism.data_parallel_shard_degree, -1);
}

TEST(ConfigCli, BareBooleansAndExplicitValues) {
  EXPECT_TRUE(parse({"--compile.enable"}).compile.enable);
  EXPECT_TRUE(parse({"--compile.enable", "--training.steps", "3"}).compile.enable);
  EXPECT_FALSE(parse({"--compile.enable", "false"}).compile.enable);
  EXPECT_FALSE(parse({"--compile.enable=false"}).compile.enable);
  EXPECT_TRUE(parse({"--compile.enable=true"}).compile.enable);
  EXPECT_FALSE(parse({"--compile.enable", "--compile.no_enable"}).compile.enable);
  EXPECT_FALSE(parse({"--checkpoint.no-initial-load-model-only"}).checkpoint.initial_load_model_only);
  // A word after a bare boolean that is not true/false is an error of its own.
  EXPECT_NE(user_error([] { parse({"--compile.enable", "model"}); }).find("unexpected argument 'model'"),
            std::string::npos);
  EXPECT_NE(user_error([] { parse({"--compile.enable=maybe"}); }).find("expected a boolean"), std::string::npos);
}

TEST(ConfigCli, ListsAreCommaSeparated) {
  EXPECT_EQ(parse({"--compile.components", "model"}).compile.components, std::vector<std::string>{"model"});
  EXPECT_EQ(parse({"--checkpoint.exclude_from_loading=optimizer,lr_scheduler, dataloader"}).checkpoint.exclude_from_loading,
            (std::vector<std::string>{"optimizer", "lr_scheduler", "dataloader"}));
  EXPECT_TRUE(parse({"--compile.components="}).compile.components.empty());
  // Integer lists (no torchtitan option has one yet; the type is supported for when one comes).
  std::vector<int64_t> ints;
  config::FieldRef f{"t", "ints", "", {}, config::ValuePtr(&ints)};
  config::set_from_string(f, "1, -2,3", "test");
  EXPECT_EQ(ints, (std::vector<int64_t>{1, -2, 3}));
  EXPECT_THROW(config::set_from_string(f, "1,x", "test"), UserError);
}

// Lists of lists (parallelism.module_fqns_per_model_part): ';' separates the lists, ',' the names.
TEST(ConfigCli, ListsOfListsAreSemicolonSeparated) {
  using Parts = std::vector<std::vector<std::string>>;
  const std::string key = "--parallelism.module_fqns_per_model_part";
  EXPECT_EQ(parse({key, "tok_embeddings,layers.0;layers.1,norm,output"}).parallelism.module_fqns_per_model_part,
            (Parts{{"tok_embeddings", "layers.0"}, {"layers.1", "norm", "output"}}));
  EXPECT_EQ(parse({key + "= layers.0 ; layers.1 , output"}).parallelism.module_fqns_per_model_part,
            (Parts{{"layers.0"}, {"layers.1", "output"}}));
  EXPECT_TRUE(parse({key + "="}).parallelism.module_fqns_per_model_part.empty());
  // The command line replaces the file's lists, it does not add to them.
  TempDir dir;
  const std::string file = write(dir, "c.toml", "[parallelism]\nmodule_fqns_per_model_part = [[\"a\"], [\"b\"]]\n");
  EXPECT_EQ(parse({"--job.config_file", file}).parallelism.module_fqns_per_model_part, (Parts{{"a"}, {"b"}}));
  EXPECT_EQ(parse({"--job.config_file", file, key, "x,y"}).parallelism.module_fqns_per_model_part, (Parts{{"x", "y"}}));
  EXPECT_TRUE(parse({"--job.config_file", file, key + "="}).parallelism.module_fqns_per_model_part.empty());
}

TEST(ConfigCli, OptionalValues) {
  EXPECT_EQ(parse({"--lr_scheduler.total_steps", "50"}).lr_scheduler.total_steps, 50);
  EXPECT_FALSE(parse({"--lr_scheduler.decay_ratio", "0.5", "--lr_scheduler.decay_ratio=none"}).lr_scheduler.decay_ratio);
}

// The seeds' own command lines.
TEST(ConfigCli, SeedCommandLines) {
  const JobConfig f8 = parse({"--model.converters=quantize.linear.float8",
                              "--quantize.linear.float8.enable_fsdp_float8_all_gather", "--compile.enable"});
  EXPECT_EQ(f8.model.converters, std::vector<std::string>{"quantize.linear.float8"});
  EXPECT_TRUE(f8.float8.enable_fsdp_float8_all_gather);
  EXPECT_TRUE(f8.compile.enable);

  const JobConfig seed = parse({"--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                                "--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree",
                                "1", "--parallelism.pipeline_parallel_degree", "1"});
  EXPECT_TRUE(seed.checkpoint.enable && seed.checkpoint.create_seed_checkpoint);
  EXPECT_EQ(seed.parallelism.data_parallel_shard_degree, 1);

  const JobConfig older = parse({"--job.config_file", fixture("seed000_old_8b.toml"), "--training.tensor_parallel_degree",
                                 "4", "--training.data_parallel_shard_degree", "2"});
  EXPECT_EQ(older.parallelism.tensor_parallel_degree, 4);
  EXPECT_EQ(older.parallelism.data_parallel_shard_degree, 2);
}

TEST(ConfigCli, OlderSpellingOnCommandLineOverridesNewerInFile) {
  TempDir dir;
  const std::string file = write(dir, "c.toml", "[training]\nlocal_batch_size = 4\n[metrics]\ndisable_color_printing = true\n");
  const JobConfig cfg = parse({"--job.config_file", file, "--training.batch_size", "16", "--metrics.enable_color_printing"});
  EXPECT_EQ(cfg.training.local_batch_size, 16);
  EXPECT_FALSE(cfg.metrics.disable_color_printing);
  EXPECT_TRUE(parse({"--float8.enable_float8_linear"}).model.converters == std::vector<std::string>{"quantize.linear.float8"});
}

TEST(ConfigCli, Errors) {
  std::string e = user_error([] { parse({"--training.batch_sise", "4"}); });
  EXPECT_NE(e.find("unknown option '--training.batch_sise'"), std::string::npos) << e;
  EXPECT_NE(e.find("--training.local_batch_size"), std::string::npos) << e;

  e = user_error([] { parse({"--trainig.steps", "4"}); });
  EXPECT_NE(e.find("did you mean --training.steps?"), std::string::npos) << e;

  // An older key under the newer table: point to where it lives now.
  e = user_error([] { parse({"--parallelism.batch_size", "4"}); });
  EXPECT_NE(e.find("did you mean --training.local_batch_size?"), std::string::npos) << e;
  e = user_error([] { parse({"--training.pipeline_parallel_degree", "2"}); });
  EXPECT_NE(e.find("did you mean --parallelism.pipeline_parallel_degree?"), std::string::npos) << e;

  e = user_error([] { parse({"--training.steps", "ten"}); });
  EXPECT_NE(e.find("training.steps at command-line argument '--training.steps ten': expected an integer"),
            std::string::npos) << e;
  e = user_error([] { parse({"--training.steps"}); });
  EXPECT_NE(e.find("needs a value"), std::string::npos) << e;
  e = user_error([] { parse({"steps=3"}); });
  EXPECT_NE(e.find("unexpected argument 'steps=3'"), std::string::npos) << e;
  e = user_error([] { parse({"--steps", "3"}); });
  EXPECT_NE(e.find("names no table"), std::string::npos) << e;
  e = user_error([] { parse({"--lr_scheduler.decay_type", "cosin"}); });
  EXPECT_NE(e.find("did you mean \"cosine\"?"), std::string::npos) << e;
  e = user_error([] { parse({"--job.config_file", "/nonexistent/x.toml"}); });
  EXPECT_NE(e.find("config file '/nonexistent/x.toml' (given by --job.config_file) does not exist"), std::string::npos)
      << e;
}

}  // namespace
}  // namespace titan::test
