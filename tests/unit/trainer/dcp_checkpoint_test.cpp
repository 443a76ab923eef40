// torchtitan checkpoints in: a torch.distributed.checkpoint folder written by PyTorch
// (tests/reference/torchtitan_dcp.py: torchtitan's keys, the optimizer flattened by
// get_optimizer_state_dict, FSDP-style chunks over two ranks) is continued by titan, through
// checkpoint.initial_load_path and through `titan convert from-dcp`, with the losses PyTorch computes
// continuing from the same state; titan's own pickle reader against Python's pickles; damaged folders.
//
// Tolerance: 1e-5 relative per loss (fp32 on the CPU on both sides; the model is written independently
// on each side, the parity tests' 1e-6 agreement, and AdamW over 3 steps).
#include "test_util.h"

#include "distributed/launched_training.h"
#include "models/llama3_reference_config.h"
#include "titan/common/error.h"
#include "titan/components/checkpoint/checkpoint.h"
#include "titan/components/checkpoint/dcp.h"
#include "titan/components/checkpoint/pickle.h"
#include "titan/components/checkpoint/safetensors.h"
#include "titan/components/data/dataloader.h"
#include "titan/components/optimizer/lr_scheduler.h"
#include "titan/components/tokenizer/tokenizer.h"
#include "titan/config/job_config.h"
#include "titan/models/llama3/args.h"
#include "titan/trainer/trainer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace titan {
namespace {

namespace fs = std::filesystem;
const std::string kSource = TITAN_SOURCE_DIR;
const std::string kTitan = std::string(TITAN_BINARY_DIR) + "/titan";
constexpr int kSaved = 3, kContinued = 3, kBatch = 4, kSeqLen = 32;

std::vector<std::string> run_args(const std::string& dump, const std::string& load_path) {
  std::vector<std::string> a = {"--job.config_file", kSource + "/configs/llama3_debugmodel.toml", "--job.dump_folder", dump,
                                "--model.hf_assets_path", kSource + "/assets/tokenizer", "--training.seq_len",
                                std::to_string(kSeqLen), "--training.local_batch_size", std::to_string(kBatch),
                                "--training.steps", std::to_string(kSaved + kContinued), "--metrics.log_freq", "1",
                                "--checkpoint.enable", "false"};
  if (!load_path.empty())
    a.insert(a.end(), {"--checkpoint.initial_load_path", load_path, "--checkpoint.initial_load_model_only", "false"});
  return a;
}

// For the PyTorch side: the batches of the kContinued steps after the first `skip` of a run with
// `cfg` into `in` (batch.tokens, batch.labels: (kContinued, B, S)), and the reference's configuration:
// the model's (llama3_reference.py's), with a "train" object of the optimizer's, clipping's and
// schedule's settings (total_steps: kSaved + kContinued).
nlohmann::json reference_inputs(const JobConfig& cfg, int skip, safetensors::Tensors& in) {
  auto tokenizer = load_tokenizer(kSource + "/assets/tokenizer");
  auto loader = data::make_dataloader(data::data_config(cfg.training, 0, 1), *tokenizer);
  std::vector<at::Tensor> tokens, labels;
  for (int i = 0; i < skip + kContinued; ++i) {
    data::Batch b = loader->next();
    if (i < skip) continue;
    tokens.push_back(b.inputs);
    labels.push_back(b.labels);
  }
  in["batch.tokens"] = at::stack(tokens);
  in["batch.labels"] = at::stack(labels);
  nlohmann::json mc = test::llama3_reference_config(llama3::flavor(cfg.model.flavor));
  mc["vocab_size"] = in.at("param.tok_embeddings.weight").size(0);
  const auto& o = cfg.optimizer;
  const auto& s = cfg.lr_scheduler;
  EXPECT_EQ(s.decay_type, "linear");
  mc["train"] = {{"lr", o.lr}, {"beta1", o.beta1}, {"beta2", o.beta2}, {"eps", o.eps}, {"weight_decay", o.weight_decay},
                 {"max_norm", cfg.training.max_norm}, {"warmup_steps", s.warmup_steps},
                 {"decay_ratio", s.decay_ratio ? nlohmann::json(*s.decay_ratio) : nlohmann::json()},
                 {"min_lr_factor", s.min_lr_factor}, {"total_steps", kSaved + kContinued}};
  return mc;
}

// Writes the DCP folder `dcp_dir` (saved by `ranks` processes, its data loader's state as `loader_state`:
// "grain", "stateful" or "none", see tests/reference/torchtitan_dcp.py) from this run's initial weights
// and returns PyTorch's losses of the kContinued steps after it, on titan's first batches of the run.
std::vector<double> pytorch_checkpoint_and_continuation(const test::TempDir& dir, const std::string& dcp_dir, int ranks,
                                                        const std::string& loader_state) {
  const JobConfig cfg = parse_config(run_args(dir / "init", ""));
  safetensors::Tensors in;
  {
    Trainer t(cfg);  // the model's names and shapes, initialized
    for (const auto& [name, w] : t.full_parameters()) in["param." + name] = w.contiguous();
  }
  // A checkpoint of torchtitan's carries torchtitan's data position, which titan does not read: the run
  // continues on titan's first batches.
  nlohmann::json mc = reference_inputs(cfg, 0, in);
  mc["train"].update({{"saved_steps", kSaved}, {"ranks", ranks}, {"batch", kBatch}, {"seq_len", kSeqLen},
                      {"loader", loader_state}});
  safetensors::save(dir / "in.safetensors", in, {{"config", mc.dump()}});
  const test::ProcessResult r = test::run_process(
      {test::python(), kSource + "/tests/reference/torchtitan_dcp.py", dir / "in.safetensors", dcp_dir, dir / "out.safetensors"},
      {{"OMP_NUM_THREADS", "1"}}, std::chrono::seconds(300));
  if (r.exit_code != 0) throw std::runtime_error("tests/reference/torchtitan_dcp.py failed:\n" + r.output);
  const at::Tensor losses = safetensors::load(dir / "out.safetensors").tensors.at("losses");
  return std::vector<double>(losses.data_ptr<double>(), losses.data_ptr<double>() + losses.numel());
}

TEST(TorchtitanCheckpoint, TitanContinuesAsPyTorchDoes) {
  test::TempDir dir;
  const std::string dcp_dir = dir / "step-3";
  const std::vector<double> expected = pytorch_checkpoint_and_continuation(dir, dcp_dir, 2, "grain");
  ASSERT_EQ(expected.size(), static_cast<size_t>(kContinued));
  EXPECT_TRUE(fs::exists(fs::path(dcp_dir) / "__0_0.distcp") && fs::exists(fs::path(dcp_dir) / "__1_0.distcp"));

  // What the folder holds, under titan's names.
  checkpoint::DcpSource source(dcp_dir);
  EXPECT_EQ(source.contents(), (std::vector<std::string>{"model", "optimizer", "lr_scheduler", "train_state"}));
  // One rank's token count times the data-parallel degree the data loader recorded (2, as torchtitan's
  // grain loader does), not the one given for folders without that record.
  const nlohmann::json state = source.state(7);
  EXPECT_EQ(state["train_state"]["step"], kSaved);
  EXPECT_EQ(state["train_state"]["ntokens_seen"], kSaved * kBatch * kSeqLen);
  EXPECT_EQ(state["lr_scheduler"]["step"], kSaved);
  ASSERT_TRUE(source.meta("optimizer.layers.0.attention.wq.weight.exp_avg").has_value());
  EXPECT_EQ(source.meta("optimizer.layers.0.attention.wq.weight.step")->shape, std::vector<int64_t>{});
  EXPECT_NE(source.unread_summary().find("dataloader"), std::string::npos) << source.unread_summary();
  EXPECT_NE(source.unread_summary().find("freqs_cis (1 key)"), std::string::npos) << source.unread_summary();

  // titan, loading it through checkpoint.initial_load_path.
  std::vector<double> direct;
  {
    testing::internal::CaptureStdout();
    testing::internal::CaptureStderr();
    Trainer t(parse_config(run_args(dir / "run", dcp_dir)));
    const std::string log = testing::internal::GetCapturedStdout() + testing::internal::GetCapturedStderr();
    EXPECT_NE(log.find("(torch.distributed.checkpoint) (model, optimizer, lr_scheduler, train_state); starting at step 4"),
              std::string::npos) << log;
    EXPECT_NE(log.find("not read: dataloader"), std::string::npos) << log;
    direct = t.train();
  }
  ASSERT_EQ(direct.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    std::printf("[dcp] step %zu: titan %.7f, PyTorch %.7f\n", kSaved + i + 1, direct[i], expected[i]);
    EXPECT_NEAR(direct[i], expected[i], 1e-5 * expected[i]) << "step " << kSaved + i + 1;
  }

  // `titan convert from-dcp`, then loading the titan checkpoint: the same run, bit for bit.
  const std::string converted = dir / "converted/step-3";
  const test::ProcessResult c = test::run_process(
      {kTitan, "convert", "from-dcp", dcp_dir, converted, "--model.flavor", "debugmodel"}, {}, std::chrono::seconds(120));
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_NE(c.output.find("as titan checkpoint " + converted), std::string::npos) << c.output;
  EXPECT_EQ(checkpoint::Reader(converted).state()["train_state"]["ntokens_seen"], kSaved * kBatch * kSeqLen);
  Trainer t(parse_config(run_args(dir / "run2", converted)));
  EXPECT_EQ(t.train(), direct);
  // Another flavor's shapes are refused, naming the tensor.
  const test::ProcessResult wrong = test::run_process(
      {kTitan, "convert", "from-dcp", dcp_dir, dir / "wrong/step-3", "--model.flavor", "1B"}, {}, std::chrono::seconds(120));
  EXPECT_NE(wrong.exit_code, 0);
  EXPECT_NE(wrong.output.find("is --model.flavor (and --model.name) the saving run's?"), std::string::npos) << wrong.output;

  // Two processes (FSDP 2, the same global batch) read their shards of the chunks and train as one did.
  std::vector<std::string> fsdp = run_args(dir / "fsdp", dcp_dir);
  fsdp.insert(fsdp.begin(), "train");
  fsdp.insert(fsdp.end(), {"--training.local_batch_size", std::to_string(kBatch / 2), "--training.global_batch_size",
                           std::to_string(kBatch)});
  test::TempDir fsdp_dir;
  const test::LaunchedRun two = test::run_titan(2, fsdp, fsdp_dir);
  ASSERT_EQ(two.exit_code, 0) << two.output;
  const at::Tensor losses = two.weights.at("__losses__").to(at::kDouble);
  ASSERT_EQ(losses.numel(), kContinued);
  for (int i = 0; i < kContinued; ++i)
    EXPECT_NEAR(losses[i].item<double>(), direct[static_cast<size_t>(i)], 1e-5 * direct[static_cast<size_t>(i)]) << "FSDP 2, step " << kSaved + i + 1;
}

// The model alone (checkpoint.initial_load_model_only, torchtitan's default too): the step, the schedule
// and the optimizer start afresh.
TEST(TorchtitanCheckpoint, ModelOnlyStartsTheRunAfresh) {
  test::TempDir dir;
  const std::string dcp_dir = dir / "step-3";
  pytorch_checkpoint_and_continuation(dir, dcp_dir, 1, "stateful");
  auto args = run_args(dir / "run", dcp_dir);
  args.back() = "true";  // initial_load_model_only
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  Trainer t(parse_config(args));
  const std::string log = testing::internal::GetCapturedStdout() + testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("(torch.distributed.checkpoint) (model); starting at step 1"), std::string::npos) << log;
  EXPECT_EQ(t.train().size(), static_cast<size_t>(kSaved + kContinued));
  // The degree as torchtitan's loader recorded it before 2026-08 (1 here), not the one given.
  EXPECT_EQ(checkpoint::DcpSource(dcp_dir).state(3)["train_state"]["ntokens_seen"], kSaved * kBatch * kSeqLen);
}

// titan out: a run's checkpoint through `titan convert to-dcp` is resumed by PyTorch as torchtitan's
// checkpoint manager resumes (tests/reference/torchtitan_resume.py: its state dict built from an AdamW,
// a LambdaLR and the train state, filled by torch.distributed.checkpoint.load, which fails on any key
// the folder lacks), and PyTorch's next steps give titan's own losses after that checkpoint, with the
// schedule's learning rates; an export of a checkpoint saved before titan recorded the optimizer's
// settings, given the run's configuration, is byte for byte the same folder.
TEST(TorchtitanCheckpoint, PyTorchResumesATitanExportAsTitanDoes) {
  test::TempDir dir;
  auto args = run_args(dir / "run", "");
  args.insert(args.end(), {"--checkpoint.enable", "true", "--checkpoint.interval", std::to_string(kSaved)});
  const JobConfig cfg = parse_config(args);
  safetensors::Tensors in;
  std::vector<double> titan_losses;
  {
    Trainer t(cfg);
    for (const auto& [name, w] : t.full_parameters()) in["param." + name] = w.contiguous();
    titan_losses = t.train();  // uninterrupted, saving step kSaved on the way
  }
  ASSERT_EQ(titan_losses.size(), static_cast<size_t>(kSaved + kContinued));
  const std::string step_dir = dir / ("run/checkpoint/step-" + std::to_string(kSaved));
  const std::string out = dir / "export";
  auto r = test::run_process({kTitan, "convert", "to-dcp", step_dir, out}, {}, std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.output;

  // The batches of the steps after the checkpoint.
  nlohmann::json mc = reference_inputs(cfg, kSaved, in);
  mc["train"]["implementation"] = cfg.optimizer.implementation;
  const auto& o = cfg.optimizer;
  const auto& s = cfg.lr_scheduler;
  safetensors::save(dir / "in.safetensors", in, {{"config", mc.dump()}});
  const test::ProcessResult py = test::run_process(
      {test::python(), kSource + "/tests/reference/torchtitan_resume.py", dir / "in.safetensors", out, dir / "out.json"},
      {{"OMP_NUM_THREADS", "1"}}, std::chrono::seconds(300));
  ASSERT_EQ(py.exit_code, 0) << py.output;
  std::ifstream f(dir / "out.json");
  const nlohmann::json got = nlohmann::json::parse(f);
  EXPECT_EQ(got.at("step"), kSaved);
  EXPECT_EQ(got.at("last_epoch"), kSaved);
  EXPECT_EQ(got.at("ntokens_seen"), kSaved * kBatch * kSeqLen);  // one rank's count: the run had one
  EXPECT_EQ(got.at("group").at("fused"), o.implementation == "fused") << got.dump();
  EXPECT_EQ(got.at("group").at("initial_lr"), o.lr) << got.dump();
  const LRSchedule schedule(lr_schedule_options(s), kSaved + kContinued);
  for (int i = 0; i < kContinued; ++i) {
    const double loss = got.at("losses").at(i).get<double>(), titan = titan_losses[static_cast<size_t>(kSaved + i)];
    std::printf("[to-dcp] step %d: titan %.7f, PyTorch resumed %.7f\n", kSaved + i + 1, titan, loss);
    EXPECT_NEAR(loss, titan, 1e-5 * titan) << "step " << kSaved + i + 1;
    EXPECT_NEAR(got.at("lrs").at(i).get<double>(), o.lr * schedule.factor(kSaved + i), 1e-15) << "step " << kSaved + i + 1;
  }

  // A checkpoint without the record of the optimizer's settings (as titan saved before recording
  // them): the export asks for the run's configuration, and given it writes the same folder.
  checkpoint::Reader reader(step_dir);
  nlohmann::json old_state = reader.state();
  old_state.erase("optimizer");
  old_state["lr_scheduler"].erase("lr");
  old_state["train_state"].erase("dp_degree");
  const std::string old_dir = dir / ("old/checkpoint/step-" + std::to_string(kSaved));
  checkpoint::write_single_process(old_dir, reader.names(), [&](const std::string& name) {
    const std::vector<int64_t> shape = reader.meta(name)->shape;
    return reader.read(name, std::vector<int64_t>(shape.size(), 0), shape);
  }, reader.info(), old_state);
  r = test::run_process({kTitan, "convert", "to-dcp", old_dir, dir / "old-export"}, {}, std::chrono::seconds(120));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("does not record its optimizer's settings (saved by an earlier titan, or converted from a "
                          "folder without them) and no config.toml of its run is beside the checkpoint folder: give "
                          "the run's --job.config_file, or export the model alone with --model-only"),
            std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "old-export"));
  std::vector<std::string> convert = {kTitan, "convert", "to-dcp", old_dir, dir / "old-export"};
  convert.insert(convert.end(), args.begin(), args.end());  // the run's configuration
  r = test::run_process(convert, {}, std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("the optimizer's settings and schedule from --job.config_file"), std::string::npos) << r.output;
  auto bytes_of = [](const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  auto same_folders = [&](const fs::path& a, const fs::path& b) {
    for (const char* file : {".metadata", "__0_0.distcp"}) {
      EXPECT_FALSE(bytes_of(a / file).empty()) << a / file;
      EXPECT_TRUE(bytes_of(a / file) == bytes_of(b / file)) << a / file << " and " << b / file << " differ";
    }
  };
  same_folders(fs::path(dir / "old-export"), fs::path(out));
  // Without the record, the data-parallel degree (torchtitan counts one rank's tokens) is the saving
  // layout's: a checkpoint of FSDP 2 exports as one that records the degree 2.
  nlohmann::json info2 = reader.info(), state2 = reader.state();
  info2["layout"] = "dp_replicate 1, dp_shard 2, cp 1, tp 1, pp 1";
  state2["train_state"]["dp_degree"] = 2;
  old_state["train_state"]["ntokens_seen"] = state2["train_state"]["ntokens_seen"] = 2 * kSaved * kBatch * kSeqLen;
  for (const auto& [name, st] : std::vector<std::pair<std::string, nlohmann::json>>{{"dp2", state2}, {"dp2-old", old_state}}) {
    const std::string d = dir / (name + "/checkpoint/step-3");
    checkpoint::write_single_process(d, reader.names(), [&](const std::string& n) {
      const std::vector<int64_t> shape = reader.meta(n)->shape;
      return reader.read(n, std::vector<int64_t>(shape.size(), 0), shape);
    }, info2, st);
    std::vector<std::string> c = {kTitan, "convert", "to-dcp", d, dir / (name + "-export")};
    c.insert(c.end(), args.begin(), args.end());
    r = test::run_process(c, {}, std::chrono::seconds(120));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  same_folders(fs::path(dir / "dp2-export"), fs::path(dir / "dp2-old-export"));
  const nlohmann::json dp2 = checkpoint::DcpSource(dir / "dp2-export").state(1);  // times the recorded degree
  EXPECT_EQ(dp2["train_state"]["dp_degree"], 2);
  EXPECT_EQ(dp2["train_state"]["ntokens_seen"], 2 * kSaved * kBatch * kSeqLen);

  // The model alone: in another dtype too; a full export is float32 only.
  r = test::run_process({kTitan, "convert", "to-dcp", step_dir, dir / "bf16", "--checkpoint.export_dtype", "bfloat16"},
                        {}, std::chrono::seconds(120));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("checkpoint.export_dtype bfloat16 is for exporting the model alone: a run resumes from "
                          "float32 weights. Add --model-only"),
            std::string::npos) << r.output;
  r = test::run_process({kTitan, "convert", "to-dcp", step_dir, dir / "bf16", "--checkpoint.export_dtype", "bfloat16",
                         "--model-only"}, {}, std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  checkpoint::DcpSource model_only(dir / "bf16");
  EXPECT_EQ(model_only.contents(), std::vector<std::string>{"model"});
  // Back through from-dcp: the same training state as the checkpoint's.
  r = test::run_process({kTitan, "convert", "from-dcp", out, dir / "back/step-3", "--model.flavor", "debugmodel"}, {},
                        std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  checkpoint::Reader back(dir / "back/step-3");
  EXPECT_EQ(back.state().at("train_state"), reader.state().at("train_state"));
  EXPECT_EQ(back.state().at("lr_scheduler"), reader.state().at("lr_scheduler"));
  ASSERT_TRUE(back.state().contains("optimizer"));
  EXPECT_EQ(back.state().at("optimizer"), reader.state().at("optimizer"));  // the settings' record too
  // ... so that it exports again, to the same folder.
  r = test::run_process({kTitan, "convert", "to-dcp", dir / "back/step-3", dir / "again"}, {}, std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  same_folders(fs::path(dir / "again"), fs::path(out));
  for (const std::string& name : reader.names()) {
    if (name.rfind("rng.", 0) == 0) continue;
    const auto meta = back.meta(name);
    ASSERT_TRUE(meta.has_value()) << name;
    const at::Tensor a = back.read(name, std::vector<int64_t>(meta->shape.size(), 0), meta->shape);
    const at::Tensor b = reader.read(name, std::vector<int64_t>(meta->shape.size(), 0), meta->shape);
    EXPECT_TRUE(at::equal(a, b.to(a.scalar_type()))) << name;
  }
}

// Damaged or incomplete folders: errors that name the file, before anything is loaded.
TEST(TorchtitanCheckpoint, DamagedFoldersAreClearErrors) {
  test::TempDir dir;
  const std::string good = dir / "good";
  pytorch_checkpoint_and_continuation(dir, good, 1, "none");
  auto copy = [&](const std::string& name) {
    const std::string to = dir / name;
    fs::copy(good, to, fs::copy_options::recursive);
    return to;
  };
  auto open_error = [](const std::string& d) { return test::error_of([&] { checkpoint::DcpSource s(d); }); };
  // No data file.
  std::string d = copy("no_data");
  fs::remove(fs::path(d) / "__0_0.distcp");
  EXPECT_NE(open_error(d).find("__0_0.distcp is missing"), std::string::npos) << open_error(d);
  // A truncated data file.
  d = copy("short_data");
  fs::resize_file(fs::path(d) / "__0_0.distcp", fs::file_size(fs::path(d) / "__0_0.distcp") / 2);
  EXPECT_NE(open_error(d).find("is truncated"), std::string::npos) << open_error(d);
  // Truncated and garbled metadata.
  d = copy("short_metadata");
  fs::resize_file(fs::path(d) / ".metadata", 100);
  EXPECT_NE(open_error(d).find(".metadata is not a readable pickle"), std::string::npos) << open_error(d);
  d = copy("garbled_metadata");
  {
    std::ofstream f(fs::path(d) / ".metadata", std::ios::binary | std::ios::trunc);
    f << "\x80\x04}.";  // a pickled empty dict
  }
  EXPECT_NE(open_error(d).find("not torch.distributed.checkpoint's Metadata"), std::string::npos) << open_error(d);
  // A damaged chunk: read fails naming the file and the tensor.
  d = copy("bad_chunk");
  {
    checkpoint::DcpSource s(d);
    const std::string name = "model.layers.0.attention.wq.weight";
    const auto shape = s.meta(name)->shape;
    // Every stored blob (a torch.save zip) loses its first record's signature.
    const fs::path f = fs::path(d) / "__0_0.distcp";
    std::string bytes;
    {
      std::ifstream in(f, std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    for (size_t at = 0; (at = bytes.find(std::string("PK\x03\x04", 4), at)) != std::string::npos;) bytes.replace(at, 4, "JUNK");
    std::ofstream(f, std::ios::binary | std::ios::trunc) << bytes;
    const std::string err = test::error_of([&] { s.read(name, std::vector<int64_t>(shape.size(), 0), shape); });
    EXPECT_NE(err.find("__0_0.distcp"), std::string::npos) << err;
    EXPECT_NE(err.find("layers.0.attention.wq.weight"), std::string::npos) << err;
  }
  // Older torchtitan's 0-d tensor step counters are read (the good folder holds them).
  EXPECT_EQ(checkpoint::DcpSource(good).state(1)["train_state"]["step"], kSaved);
  // Its data loader did not record the degree: the token count is taken times the one given.
  EXPECT_EQ(checkpoint::DcpSource(good).state(3)["train_state"]["ntokens_seen"], 3 * kSaved * kBatch * kSeqLen);
  // Chunks that overlap and leave a gap (their sizes still add up to the tensor's).
  d = copy("overlap");
  const test::ProcessResult shift = test::run_process(
      {test::python(), "-c",
       "import pickle, sys, torch\n"
       "p = sys.argv[1] + '/.metadata'\n"
       "md = pickle.load(open(p, 'rb'))\n"
       "from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex\n"
       "m = md.state_dict_metadata['norm.weight']\n"
       "n = m.size[0]\n"
       "info = md.storage_data.pop(MetadataIndex('norm.weight', torch.Size([0])))\n"
       "m.chunks[:] = [ChunkStorageMetadata(torch.Size([0]), torch.Size([n // 2])),\n"
       "               ChunkStorageMetadata(torch.Size([n // 4]), torch.Size([n // 2]))]\n"
       "md.storage_data[MetadataIndex('norm.weight', torch.Size([0]))] = info\n"
       "md.storage_data[MetadataIndex('norm.weight', torch.Size([n // 4]))] = info\n"
       "pickle.dump(md, open(p, 'wb'))\n",
       d});
  ASSERT_EQ(shift.exit_code, 0) << shift.output;
  {
    checkpoint::DcpSource s(d);
    const auto shape = s.meta("model.norm.weight")->shape;
    const std::string err = test::error_of([&] { s.read("model.norm.weight", {0}, shape); });
    EXPECT_NE(err.find("overlap"), std::string::npos) << err;
  }
  // The folder holding a run's step folders, given for one: the error names the latest.
  fs::create_directories(dir / "run_checkpoints");
  fs::copy(good, dir / "run_checkpoints/step-3", fs::copy_options::recursive);
  std::string err = test::error_of([&] { Trainer t(parse_config(run_args(dir / "run", dir / "run_checkpoints"))); });
  EXPECT_NE(err.find("holds checkpoints, not one: give one of its step folders, e.g. " + (dir / "run_checkpoints/step-3")),
            std::string::npos) << err;
  // Not a checkpoint at all.
  const std::string none = dir / "none";
  fs::create_directories(none);
  err = test::error_of([&] { Trainer t(parse_config(run_args(dir / "run", none))); });
  EXPECT_FALSE(err.empty());
}

// titan's pickle reader against what Python's pickle writes, protocols 2 to 5.
TEST(Pickle, ReadsWhatPythonWrites) {
  test::TempDir dir;
  const std::string script =
      "import pickle, sys, collections\n"
      "v = {'small': 7, 'neg': -3, 'big': 2**40, 'negbig': -2**62, 'f': 1.5, 's': 'x' * 300, 'b': b'\\x00\\x01',\n"
      "     'l': [1, [2, 3], (4, 5, 6)], 't1': (1,), 'none': None, 'yes': True, 'no': False,\n"
      "     'od': collections.OrderedDict([('a', 1)]), 'set': {9}, 'shared': None}\n"
      "shared = [42]\n"
      "v['shared'] = (shared, shared)\n"
      "cyclic = []\n"
      "cyclic.append(cyclic)\n"
      "v['cyclic'] = cyclic\n"
      "for p in (2, 3, 4, 5):\n"
      "    open(sys.argv[1] + '/p%d.pkl' % p, 'wb').write(pickle.dumps(v, protocol=p))\n";
  const test::ProcessResult r = test::run_process({test::python(), "-c", script, dir.path()});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int p = 2; p <= 5; ++p) {
    SCOPED_TRACE("protocol " + std::to_string(p));
    std::ifstream f(dir / ("p" + std::to_string(p) + ".pkl"), std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const pickle::Document doc = pickle::parse(bytes);
    const pickle::Value* v = &doc.root();
    ASSERT_EQ(v->kind, pickle::Value::Kind::Dict);
    EXPECT_EQ(v->at("small").as_int(), 7);
    EXPECT_EQ(v->at("neg").as_int(), -3);
    EXPECT_EQ(v->at("big").as_int(), int64_t{1} << 40);
    EXPECT_EQ(v->at("negbig").as_int(), -(int64_t{1} << 62));
    EXPECT_EQ(v->at("f").f, 1.5);
    EXPECT_EQ(v->at("s").as_string(), std::string(300, 'x'));
    EXPECT_EQ(v->at("b").s, std::string("\x00\x01", 2));
    const auto& l = v->at("l").sequence();
    ASSERT_EQ(l.size(), 3u);
    EXPECT_EQ(l[1]->sequence()[1]->as_int(), 3);
    EXPECT_EQ(l[2]->kind, pickle::Value::Kind::Tuple);
    EXPECT_EQ(l[2]->sequence()[2]->as_int(), 6);
    EXPECT_EQ(v->at("t1").sequence().size(), 1u);
    EXPECT_EQ(v->at("none").kind, pickle::Value::Kind::None);
    EXPECT_TRUE(v->at("yes").b);
    EXPECT_FALSE(v->at("no").b);
    EXPECT_EQ(v->at("od").at("a").as_int(), 1);
    EXPECT_EQ(v->at("set").items.at(0)->as_int(), 9);
    const auto& shared = v->at("shared").sequence();
    EXPECT_EQ(shared[0], shared[1]);  // the memo gives the same object twice
    EXPECT_EQ(shared[0]->sequence()[0]->as_int(), 42);
    const pickle::Value& cyclic = v->at("cyclic");  // a list that holds itself (freed with the document)
    EXPECT_EQ(cyclic.sequence().at(0), &cyclic);
    // A pickle that would build far more values than its size is refused, not built: a list of 2000
    // items, then 1000 calls set(list), each copying the list for 18 bytes of input.
    std::string list = "\x80\x04]\x94(";  // EMPTY_LIST, MEMOIZE 0, MARK
    for (int i = 0; i < 2000; ++i) list += "K\x01";
    list += "e";  // APPENDS
    const std::string call("cbuiltins\nset\nh\x00\x85R0", 19);  // GLOBAL, GET 0, TUPLE1, REDUCE, POP
    std::string copies = list, few = list;
    for (int i = 0; i < 1000; ++i) copies += call;
    for (int i = 0; i < 20; ++i) few += call;
    EXPECT_THROW(pickle::parse(copies + "."), std::runtime_error);
    EXPECT_NO_THROW(pickle::parse(few + "."));  // 20 copies are within the budget
    // Every truncation is an error, never a crash or a value.
    for (size_t n = 0; n + 1 < bytes.size(); n += 7)
      EXPECT_THROW(pickle::parse(std::string_view(bytes).substr(0, n)), std::runtime_error) << n;
  }
}

}  // namespace
}  // namespace titan
