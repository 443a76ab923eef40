// TOML errors: unknown keys and tables with file:line and a suggestion, wrong types, conflicts.
#include "config_test_util.h"

#include "titan/config/suggest.h"
#include "test_util.h"

#include <fstream>

namespace titan::test {
namespace {

std::string error_of_file(const std::string& text) {
  TempDir dir;
  const std::string path = dir / "bad.toml";
  std::ofstream(path) << text;
  std::string e = user_error([&] { parse({"--job.config_file", path}); });
  // Name the file by its base name so the expectations below do not depend on the temp folder.
  if (auto at = e.find(path); at != std::string::npos) e.replace(at, path.size(), "bad.toml");
  return e;
}

TEST(ConfigErrors, UnknownKeyNamesFileLineAndNearestKey) {
  const std::string e = error_of_file("[training]\nsteps = 3\nseq_lenn = 128\n");
  EXPECT_NE(e.find("unknown key 'seq_lenn' in [training] at bad.toml:3:1"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean [training] seq_len?"), std::string::npos) << e;
}

// Every value must be writable back as TOML (config.toml in the dump folder): a command-line value
// that is not UTF-8 is refused up front, valid multi-byte text is kept.
TEST(ConfigErrors, CommandLineValuesMustBeUtf8) {
  for (const std::string bad : {"mod\xed" "el", "\xff", "\xc0\xaf", "\xed\xa0\x80", "\xe2\x82"}) {
    const std::string e = user_error([&] { parse({"--training.steps", "3", "--job.description", bad}); });
    EXPECT_NE(e.find("command-line argument 4 is not valid UTF-8"), std::string::npos) << e;
  }
  const JobConfig cfg = parse({"--job.description", "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x9a\x80"});
  EXPECT_EQ(cfg.job.description, "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x9a\x80");
  EXPECT_EQ(parse_config_text(to_toml(cfg)).job.description, cfg.job.description);
}

TEST(ConfigErrors, OlderKeyInTheWrongTableSuggestsItsNewHome) {
  std::string e = error_of_file("[parallelism]\nbatch_size = 4\n");
  EXPECT_NE(e.find("at bad.toml:2:1"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean [training] local_batch_size? ([training] batch_size is its older spelling)"),
            std::string::npos) << e;
  e = error_of_file("[training]\npipeline_parallel_degree = 2\n");
  EXPECT_NE(e.find("did you mean [parallelism] pipeline_parallel_degree?"), std::string::npos) << e;
  e = error_of_file("[lr_scheduler]\nlocal_batch_sizee = 2\n");
  EXPECT_NE(e.find("did you mean [training] local_batch_size?"), std::string::npos) << e;
  // A typo of an older key: suggest the newer spelling.
  e = error_of_file("[training]\nbatch_sizes = 2\n");
  EXPECT_NE(e.find("did you mean [training] local_batch_size?"), std::string::npos) << e;
}

TEST(ConfigErrors, UnknownTablesAndStrayKeys) {
  std::string e = error_of_file("[trainig]\nsteps = 3\n");
  EXPECT_NE(e.find("unknown table [trainig] at bad.toml:1"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean [training]?"), std::string::npos) << e;
  e = error_of_file("[quantize.linear.float9]\nemulate = true\n");
  EXPECT_NE(e.find("unknown table [quantize.linear.float9]"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean [quantize.linear.float8]?"), std::string::npos) << e;
  e = error_of_file("steps = 3\n[training]\n");
  EXPECT_NE(e.find("key 'steps' at bad.toml:1:1 is outside any table"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean [training] steps?"), std::string::npos) << e;
}

// torchtitan's MX formats are refused with the reason, in a file and on the command line, not as an
// unknown key with a far-fetched suggestion.
TEST(ConfigErrors, TheMxFormatsAreRefusedWithTheReason) {
  std::string e = error_of_file("[quantize.linear.mx]\nrecipe_name = \"mxfp8_cublas\"\n");
  EXPECT_NE(e.find("[quantize.linear.mx] at bad.toml:1"), std::string::npos) << e;
  EXPECT_NE(e.find("the MX formats (torchtitan's block-scaled mxfp8 and mxfp4 matmuls, which need Blackwell GPUs) "
                   "are not supported: use quantize.linear.float8"),
            std::string::npos) << e;
  e = user_error([] { parse({"--quantize.grouped_mm.mx.fqns", "experts"}); });
  EXPECT_NE(e.find("--quantize.grouped_mm.mx.fqns (command-line argument '--quantize.grouped_mm.mx.fqns experts'): "
                   "the MX formats"),
            std::string::npos) << e;
  e = user_error([] { parse({"--quantize.linear.mxx", "1"}); });  // not the MX table: an unknown option
  EXPECT_NE(e.find("unknown option '--quantize.linear.mxx'"), std::string::npos) << e;
}

TEST(ConfigErrors, WrongTypeNamesKeyFileLineAndTypes) {
  std::string e = error_of_file("[job]\ndescription = \"x\"\n[training]\nsteps = \"ten\"\n");
  EXPECT_NE(e.find("training.steps at bad.toml:4:1: expected an integer, got a string (\"ten\")"), std::string::npos) << e;
  e = error_of_file("[compile]\ncomponents = 3\n");
  EXPECT_NE(e.find("compile.components at bad.toml:2:1: expected a list of strings, got an integer"),
            std::string::npos) << e;
  e = error_of_file("[compile]\ncomponents = [\"model\", 3]\n");
  EXPECT_NE(e.find("compile.components at bad.toml:2:1: expected a list of strings, got an array holding an integer"),
            std::string::npos) << e;
  e = error_of_file("[compile]\nenable = 1\n");
  EXPECT_NE(e.find("expected a boolean, got an integer"), std::string::npos) << e;
  e = error_of_file("[training]\nsteps = 10.5\n");
  EXPECT_NE(e.find("expected an integer, got a float"), std::string::npos) << e;
  // Older spellings are named as written.
  e = error_of_file("[training]\nbatch_size = \"8\"\n");
  EXPECT_NE(e.find("training.batch_size at bad.toml:2:1: expected an integer"), std::string::npos) << e;
  e = error_of_file("[model]\nnorm_type = \"layernorm\"\n");
  EXPECT_NE(e.find("model.norm_type at bad.toml:2:1: \"layernorm\" is not one of \"rmsnorm\", \"fused_rmsnorm\", "
                   "\"compiled_rmsnorm\" (Llama 3 uses RMSNorm"),
            std::string::npos) << e;
  // torchtitan's keys accepted only at their default: anything else is refused, saying why.
  e = error_of_file("[parallelism]\nenable_compiled_autograd = true\n");
  EXPECT_NE(e.find("parallelism.enable_compiled_autograd at bad.toml:2:1: true is not supported: compiled autograd "
                   "is part of torch.compile"),
            std::string::npos) << e;
  e = error_of_file("[experimental]\nenable_compiled_autograd = true\n");
  EXPECT_NE(e.find("experimental.enable_compiled_autograd at bad.toml:2:1: true is not supported"), std::string::npos)
      << e;
  e = error_of_file("[training]\nenable_compiled_autograd = false\n");  // in a table it never was in
  EXPECT_NE(e.find("did you mean [parallelism] enable_compiled_autograd?"), std::string::npos) << e;
  e = error_of_file("[float8]\nmoe_fqns_prototype = [\"experts\"]\n");
  EXPECT_NE(e.find("float8.moe_fqns_prototype at bad.toml:2:1: [\"experts\"] is not supported: float8 MoE experts "
                   "are converted by the \"quantize.grouped_mm.float8\" converter"),
            std::string::npos) << e;
  e = error_of_file("[float8]\nmoe_fqns = \"experts\"\n");
  EXPECT_NE(e.find("float8.moe_fqns at bad.toml:2:1: [\"experts\"] is not supported"), std::string::npos) << e;
  EXPECT_TRUE(parse({"--debug.moe_force_load_balance", "true"}).debug.moe_force_load_balance);
  EXPECT_TRUE(parse({"--training.debug_moe_force_load_balance", "true"}).debug.moe_force_load_balance);
  EXPECT_NO_THROW(parse({"--training.debug_moe_force_load_balance", "false", "--model.norm_type", "compiled_rmsnorm"}));
  // torchtitan 0.2's keys for what titan does not do: refused with the reason, or a type error.
  e = error_of_file("[activation_checkpoint]\nearly_stop = true\n");
  EXPECT_NE(e.find("activation_checkpoint.early_stop at bad.toml:2:1: true is not supported: titan's recomputation runs "
                   "a checkpointed block's whole body"), std::string::npos) << e;
  e = error_of_file("[checkpoint]\ninitial_load_in_hf_quantized = true\n");
  EXPECT_NE(e.find("true is not supported: reading Hugging Face checkpoints with quantized weights"), std::string::npos) << e;
  e = user_error([] { parse({"--parallelism.expert_parallel_comm_backend", "deepep"}); });
  EXPECT_NE(e.find("\"deepep\" is not one of \"standard\" (titan's expert parallelism exchanges tokens with "
                   "all-to-all collectives; DeepEP's kernels are not supported)"), std::string::npos) << e;
  e = error_of_file("[training.dataloader]\nnum_workers = \"four\"\n");
  EXPECT_NE(e.find("training.dataloader.num_workers at bad.toml:2:1: expected an integer, got a string"),
            std::string::npos) << e;
  e = error_of_file("[fault_tolerance]\nfragment_update_alpha = \"x\"\n");
  EXPECT_NE(e.find("fault_tolerance.fragment_update_alpha at bad.toml:2:1: expected a number"), std::string::npos) << e;
  e = error_of_file("[activation_checkpoint]\ndeterminism_check = \"strict\"\n");
  EXPECT_NE(e.find("\"strict\" is not one of \"default\", \"none\""), std::string::npos) << e;
  e = error_of_file("[mx]\nrecipe_name = \"mxfp8\"\n");
  EXPECT_NE(e.find("[mx] at bad.toml:1:2: the MX formats"), std::string::npos) << e;
  e = user_error([] { parse({"--comm.trace_buf_size", "-1"}); });
  EXPECT_NE(e.find("comm.trace_buf_size must be 0 (no flight recorder) or positive, got -1"), std::string::npos) << e;
  // A list of lists: the outer value, each part and each name are checked.
  e = error_of_file("[parallelism]\nmodule_fqns_per_model_part = \"layers.0\"\n");
  EXPECT_NE(e.find("parallelism.module_fqns_per_model_part at bad.toml:2:1: expected a list of lists of strings, "
                   "got a string (\"layers.0\")"), std::string::npos) << e;
  e = error_of_file("[parallelism]\nmodule_fqns_per_model_part = [\"layers.0\", \"layers.1\"]\n");
  EXPECT_NE(e.find("parallelism.module_fqns_per_model_part at bad.toml:2:1: expected a list of lists of strings, "
                   "got an array holding a string (\"layers.0\")"), std::string::npos) << e;
  e = error_of_file("[parallelism]\nmodule_fqns_per_model_part = [[\"layers.0\"], [\"layers.1\", 2]]\n");
  EXPECT_NE(e.find("parallelism.module_fqns_per_model_part at bad.toml:2:1: expected a list of lists of strings, "
                   "got an array of arrays holding an integer (2)"), std::string::npos) << e;
  // Integers are fine where a number is expected.
  TempDir dir;
  std::ofstream(dir / "ok.toml") << "[optimizer]\nlr = 1\n";
  EXPECT_DOUBLE_EQ(parse({"--job.config_file", dir / "ok.toml"}).optimizer.lr, 1.0);
}

TEST(ConfigErrors, InvalidTomlNamesFileAndLine) {
  const std::string e = error_of_file("[training]\nsteps = = 3\n");
  EXPECT_NE(e.find("bad.toml:2:"), std::string::npos) << e;
  EXPECT_NE(e.find("invalid TOML"), std::string::npos) << e;
}

TEST(ConfigErrors, OlderAndNewerSpellingWithDifferentValues) {
  std::string e = error_of_file("[training]\nbatch_size = 4\nlocal_batch_size = 8\n");
  EXPECT_NE(e.find("two spellings of the same option training.local_batch_size"), std::string::npos) << e;
  EXPECT_NE(e.find("bad.toml:2:1"), std::string::npos) << e;
  EXPECT_NE(e.find("bad.toml:3:1"), std::string::npos) << e;
  e = error_of_file("[training]\ntensor_parallel_degree = 2\n[parallelism]\ntensor_parallel_degree = 4\n");
  EXPECT_NE(e.find("parallelism.tensor_parallel_degree"), std::string::npos) << e;
  e = error_of_file("[metrics]\nenable_color_printing = true\ndisable_color_printing = true\n");
  EXPECT_NE(e.find("metrics.disable_color_printing"), std::string::npos) << e;
  e = user_error([] { parse({"--training.batch_size", "2", "--training.local_batch_size", "3"}); });
  EXPECT_NE(e.find("two spellings"), std::string::npos) << e;
  // The same value twice is fine.
  TempDir dir;
  std::ofstream(dir / "same.toml") << "[training]\nbatch_size = 4\nlocal_batch_size = 4\n"
                                   << "[float8]\nenable_float8_linear = true\n[model]\nconverters = [\"float8\"]\n";
  const JobConfig same = parse({"--job.config_file", dir / "same.toml"});
  EXPECT_EQ(same.training.local_batch_size, 4);
  EXPECT_EQ(same.model.converters, std::vector<std::string>{"quantize.linear.float8"});
}

TEST(ConfigErrors, EditDistance) {
  EXPECT_EQ(config::edit_distance("", "abc"), 3u);
  EXPECT_EQ(config::edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(config::edit_distance("seq_len", "seq_len"), 0u);
  EXPECT_EQ(config::nearest("stpes", {"steps", "seq_len"}), "steps");
  EXPECT_FALSE(config::nearest("completely_unrelated", {"steps", "seq_len"}));
}

}  // namespace
}  // namespace titan::test
