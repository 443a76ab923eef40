#include "titan/tools/convert.h"

#include "titan/common/error.h"
#include "titan/components/checkpoint/checkpoint.h"
#include "titan/components/checkpoint/dcp.h"
#include "titan/components/checkpoint/hf.h"
#include "titan/components/checkpoint/pickle.h"
#include "titan/components/optimizer/lr_scheduler.h"
#include "titan/config/job_config.h"
#include "titan/models/model.h"
#include "titan/models/registry.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <iostream>

namespace titan {
namespace fs = std::filesystem;
namespace {

constexpr const char* kModelPrefix = "model.";

at::ScalarType export_dtype(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  throw UserError("checkpoint.export_dtype '" + name + "' is not one of float32, bfloat16, float16");
}

// Opens a checkpoint, pointing at its step folders when given the folder that holds them.
checkpoint::Reader open_checkpoint(const std::string& step_dir) {
  if (fs::is_directory(step_dir) && !fs::exists(fs::path(step_dir) / checkpoint::kIndexFile)) {
    const auto steps = checkpoint::list_checkpoints(step_dir);
    TITAN_USER_CHECK(steps.empty(), step_dir, " holds checkpoints, not one checkpoint: pass one of its step folders, "
                     "e.g. ", steps.empty() ? "" : steps.rbegin()->second, " (the latest)");
  }
  return checkpoint::Reader(step_dir);
}

// The model's tensors of a checkpoint, names without "model.", with their shapes (at least one).
std::vector<std::pair<std::string, std::vector<int64_t>>> model_tensors(checkpoint::Reader& reader,
                                                                       const std::string& step_dir) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const std::string& name : reader.names())
    if (name.rfind(kModelPrefix, 0) == 0)
      out.emplace_back(name.substr(std::string(kModelPrefix).size()), reader.meta(name)->shape);
  TITAN_USER_CHECK(!out.empty(), "checkpoint ", step_dir, " holds no model weights (no model.* tensors)");
  return out;
}

at::Tensor read_model_tensor(checkpoint::Reader& reader, const std::string& name, const std::vector<int64_t>& shape,
                             at::ScalarType dtype) {
  at::Tensor t = reader.read(kModelPrefix + name, std::vector<int64_t>(shape.size(), 0), shape);
  // Weights in the export dtype; integer and other buffers as saved.
  return t.is_floating_point() ? t.to(dtype).contiguous() : t.contiguous();
}

// torchtitan's state dict holds a tied embedding table twice (output.weight is tok_embeddings.weight);
// titan's checkpoint holds it once, as the embedding: the name to add, or "" when the model is untied.
std::string tied_output_name(const std::vector<std::pair<std::string, std::vector<int64_t>>>& tensors) {
  bool embedding = false, output = false;
  for (const auto& [name, shape] : tensors) {
    embedding |= name == "tok_embeddings.weight";
    output |= name == "output.weight";
  }
  return embedding && !output ? "output.weight" : "";
}

// What torchtitan's optimizer parameter groups and LambdaLR schedule hold after `step` steps of a run
// with these settings.
struct OptimizerSettings {
  std::string name = "AdamW", implementation = "fused";
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  double lr_now = 0;  // the learning rate of the next step (the schedule's, after `lr_step` steps)
  int64_t lr_step = 0;
};

OptimizerSettings optimizer_settings(const nlohmann::json& state, const std::function<JobConfig()>& run_config,
                                     const std::string& step_dir) {
  OptimizerSettings s;
  TITAN_USER_CHECK(state.contains("lr_scheduler") && state["lr_scheduler"].contains("step"), "checkpoint ", step_dir,
                   " records no learning-rate schedule step: export the model alone with --model-only");
  s.lr_step = state["lr_scheduler"]["step"].get<int64_t>();
  if (state.contains("optimizer") && state["lr_scheduler"].contains("lr")) {  // recorded by the saving run
    const nlohmann::json& o = state["optimizer"];
    s.name = o.at("name").get<std::string>();
    s.implementation = o.at("implementation").get<std::string>();
    s.lr = o.at("lr").get<double>();
    s.beta1 = o.at("beta1").get<double>();
    s.beta2 = o.at("beta2").get<double>();
    s.eps = o.at("eps").get<double>();
    s.weight_decay = o.at("weight_decay").get<double>();
    s.lr_now = state["lr_scheduler"]["lr"].get<double>();
    return s;
  }
  // A checkpoint of an earlier titan: the settings of the run's configuration.
  const JobConfig cfg = run_config();
  const auto& o = cfg.optimizer;
  s = {o.name, o.implementation, o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, 0, s.lr_step};
  const LRSchedule schedule(lr_schedule_options(cfg.lr_scheduler),
                            cfg.lr_scheduler.total_steps.value_or(cfg.training.steps));
  s.lr_now = o.lr * schedule.factor(s.lr_step);
  return s;
}

// The data-parallel degree of the run that saved a checkpoint, from its layout ("dp_replicate 2,
// dp_shard 4, ...", as every titan checkpoint records it); 1 for another layout (one process).
int64_t layout_dp_degree(const nlohmann::json& info) {
  const std::string layout = info.value("layout", std::string());
  long long replicate = 0, shard = 0;
  if (std::sscanf(layout.c_str(), "dp_replicate %lld, dp_shard %lld", &replicate, &shard) == 2 && replicate >= 1 &&
      shard >= 1 && replicate <= (1 << 24) && shard <= (1 << 24))
    return static_cast<int64_t>(replicate * shard);
  return 1;
}

void write_floats(pickle::Writer& w, std::initializer_list<double> values, bool as_tuple) {
  if (!as_tuple) w.empty_list();
  w.mark();
  for (double v : values) w.real(v);
  if (as_tuple)
    w.tuple();
  else
    w.appends();
}

// The optimizer's state (torchtitan's flattened "optimizer.state.<param>.*" and
// "optimizer.param_groups.<param>.*"), the schedule ("lr_scheduler.*", LambdaLR's state dict) and
// "train_state.*" of a titan checkpoint. Every key a recent PyTorch's AdamW / Adam and LambdaLR state
// dicts hold is written: torch.distributed.checkpoint.load fails on a key the folder lacks and
// ignores those it does not ask for. Returns the number of entries.
int64_t write_training_state(checkpoint::Reader& reader, checkpoint::DcpWriter& writer,
                             const std::vector<std::pair<std::string, std::vector<int64_t>>>& tensors,
                             const std::string& tied, const OptimizerSettings& s) {
  int64_t n = 0;
  auto group = [&](const std::string& param) {
    auto add = [&](const std::string& key, const std::function<void(pickle::Writer&)>& value) {
      writer.add_object({"optimizer", "param_groups." + param + "." + key}, value);
      ++n;
    };
    add("lr", [&](pickle::Writer& w) { w.real(s.lr_now); });
    add("betas", [&](pickle::Writer& w) { write_floats(w, {s.beta1, s.beta2}, /*as_tuple=*/true); });
    add("eps", [&](pickle::Writer& w) { w.real(s.eps); });
    add("weight_decay", [&](pickle::Writer& w) { w.real(s.weight_decay); });
    for (const char* off : {"amsgrad", "maximize", "capturable", "differentiable"})
      add(off, [](pickle::Writer& w) { w.boolean(false); });
    // As torchtitan builds the optimizer from its implementation setting.
    add("foreach", [&](pickle::Writer& w) { w.boolean(s.implementation == "foreach"); });
    add("fused", [&](pickle::Writer& w) { w.boolean(s.implementation == "fused"); });
    add("decoupled_weight_decay", [&](pickle::Writer& w) { w.boolean(s.name == "AdamW"); });
    add("initial_lr", [&](pickle::Writer& w) { w.real(s.lr); });
  };
  int64_t with_state = 0;
  for (const auto& [name, shape] : tensors) {
    const std::string prefix = "optimizer." + name + ".";
    if (!reader.meta(prefix + "exp_avg")) {
      // Buffers (MoE routing biases) have none; every parameter has its state in a titan checkpoint.
      TITAN_USER_CHECK(name.size() >= 11 && name.compare(name.size() - 11, 11, "expert_bias") == 0, "checkpoint ",
                       reader.describe(), " holds no optimizer state for ", name,
                       ": export the model alone with --model-only");
      continue;
    }
    ++with_state;
    for (const char* moment : {"exp_avg", "exp_avg_sq"}) {
      const auto meta = reader.meta(prefix + moment);
      TITAN_USER_CHECK(meta && meta->shape == shape, "checkpoint ", reader.describe(), ": ", prefix, moment,
                       " is missing or not of its parameter's shape");
      writer.add({"optimizer", "state." + name + "." + moment},
                 reader.read(prefix + moment, std::vector<int64_t>(shape.size(), 0), shape).to(at::kFloat));
      ++n;
    }
    const auto step_meta = reader.meta(prefix + "step");
    TITAN_USER_CHECK(step_meta.has_value(), "checkpoint ", reader.describe(), " holds no ", prefix, "step");
    // PyTorch's AdamW keeps its step count as a 0-d float32 tensor.
    writer.add({"optimizer", "state." + name + ".step"},
               reader.read(prefix + "step", std::vector<int64_t>(step_meta->shape.size(), 0), step_meta->shape)
                   .to(at::kFloat)
                   .reshape({}));
    ++n;
    group(name);
  }
  TITAN_USER_CHECK(with_state > 0, "checkpoint ", reader.describe(),
                   " lists the optimizer but holds no optimizer state: export the model alone with --model-only");
  if (!tied.empty() && reader.meta("optimizer.tok_embeddings.weight.exp_avg")) {
    // A tied output projection is the embedding's parameter under its second name, as for the model.
    for (const char* k : {"exp_avg", "exp_avg_sq", "step"})
      writer.add_alias({"optimizer", "state." + tied + "." + k}, std::string("optimizer.state.tok_embeddings.weight.") + k);
    group(tied);
    n += 3;
  }
  // LambdaLR's state dict after lr_step steps (one parameter group).
  auto sched = [&](const std::string& key, const std::function<void(pickle::Writer&)>& value) {
    writer.add_object({"lr_scheduler", key}, value);
    ++n;
  };
  sched("base_lrs", [&](pickle::Writer& w) { write_floats(w, {s.lr}, false); });
  sched("_last_lr", [&](pickle::Writer& w) { write_floats(w, {s.lr_now}, false); });
  sched("last_epoch", [&](pickle::Writer& w) { w.integer(s.lr_step); });
  sched("_step_count", [&](pickle::Writer& w) { w.integer(s.lr_step + 1); });
  for (const char* off : {"_is_initial", "_get_lr_called_within_step", "verbose"})
    sched(off, [](pickle::Writer& w) { w.boolean(false); });
  sched("lr_lambdas", [](pickle::Writer& w) {
    w.empty_list();
    w.mark();
    w.none();
    w.appends();
  });
  // torchtitan counts one data-parallel rank's tokens; its data loader records that degree, which
  // `from-dcp` reads back.
  const nlohmann::json& ts = reader.state().at("train_state");
  const int64_t dp = std::max<int64_t>(1, ts.contains("dp_degree") ? ts["dp_degree"].get<int64_t>()
                                                                      : layout_dp_degree(reader.info()));
  const int64_t step = ts.at("step").get<int64_t>(), tokens = ts.at("ntokens_seen").get<int64_t>() / dp;
  writer.add_object({"train_state", "step"}, [&](pickle::Writer& w) { w.integer(step); });
  writer.add_object({"train_state", "ntokens_seen"}, [&](pickle::Writer& w) { w.integer(tokens); });
  writer.add_object({"dataloader", "dp_world_size"}, [&](pickle::Writer& w) { w.integer(dp); });
  return n + 3;
}

// The config.toml of the run that saved checkpoint step folder `step_dir` (its dump folder's, two
// levels above), or an empty path when there is none.
fs::path run_config_beside(const std::string& step_dir) {
  fs::path step = fs::absolute(step_dir).lexically_normal();
  if (step.filename().empty()) step = step.parent_path();  // a trailing '/'
  const fs::path run_config = step.parent_path().parent_path() / "config.toml";
  std::error_code ec;
  return fs::is_regular_file(run_config, ec) ? run_config : fs::path();
}

// That file's configuration.
JobConfig read_run_config(const fs::path& run_toml) {
  std::ifstream in(run_toml);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse_config_text(text, run_toml.string());
}

}  // namespace

int64_t convert_to_dcp(const std::string& step_dir, const std::string& out_dir, at::ScalarType dtype, bool model_only,
                       const std::function<JobConfig()>& run_config) {
  checkpoint::Reader reader = open_checkpoint(step_dir);
  const auto tensors = model_tensors(reader, step_dir);
  const auto contents = reader.info().value("contents", std::vector<std::string>{});
  auto has = [&](const char* part) { return std::find(contents.begin(), contents.end(), part) != contents.end(); };
  const bool training_state = !model_only && has("optimizer");
  std::optional<OptimizerSettings> settings;
  if (training_state) {
    TITAN_USER_CHECK(dtype == at::kFloat, "checkpoint.export_dtype ", dtype == at::kBFloat16 ? "bfloat16" : "float16",
                     " is for exporting the model alone: a run resumes from float32 weights. Add --model-only, or "
                     "leave checkpoint.export_dtype at float32");
    TITAN_USER_CHECK(has("lr_scheduler") && has("train_state"), "checkpoint ", step_dir,
                     " holds the optimizer but not the schedule and training step: export the model alone with "
                     "--model-only");
    settings = optimizer_settings(reader.state(), run_config, step_dir);
  }
  checkpoint::DcpWriter writer(out_dir);
  for (const auto& [name, shape] : tensors) writer.add(name, read_model_tensor(reader, name, shape, dtype));
  const std::string tied = tied_output_name(tensors);
  if (!tied.empty()) writer.add_alias(tied, "tok_embeddings.weight");
  int64_t n = static_cast<int64_t>(tensors.size() + !tied.empty());
  if (training_state) n += write_training_state(reader, writer, tensors, tied, *settings);
  writer.finish();
  return n;
}

int64_t convert_to_torch(const std::string& step_dir, const std::string& out_file, at::ScalarType dtype) {
  TITAN_USER_CHECK(!fs::path(out_file).filename().empty() && !fs::is_directory(out_file), out_file,
                   " is a folder: give the file to write, e.g. ", (fs::path(out_file) / "model.pt").string());
  TITAN_USER_CHECK(!fs::exists(out_file), out_file, " already exists: choose a new file");
  checkpoint::Reader reader = open_checkpoint(step_dir);
  const auto tensors = model_tensors(reader, step_dir);
  std::vector<checkpoint::TorchSaveEntry> entries;
  for (const auto& [name, shape] : tensors) {
    const at::ScalarType saved = reader.meta(kModelPrefix + name)->dtype;
    entries.push_back({name, at::isFloatingType(saved) ? dtype : saved, shape, std::nullopt});
  }
  if (const std::string tied = tied_output_name(tensors); !tied.empty()) {
    size_t embedding = 0;
    while (entries[embedding].name != "tok_embeddings.weight") ++embedding;
    entries.push_back({tied, entries[embedding].dtype, entries[embedding].shape, embedding});
  }
  std::error_code ec;
  if (fs::path(out_file).has_parent_path()) fs::create_directories(fs::path(out_file).parent_path(), ec);
  const std::string tmp = out_file + ".tmp";
  std::ofstream out(tmp, std::ios::binary);
  TITAN_USER_CHECK(out.good(), "cannot write ", tmp);
  bool write_failed = false;
  try {
    checkpoint::write_torch_save(
        [&](const void* bytes, size_t n) {
          out.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(n));
          write_failed |= !out.good();
          return out.good() ? n : 0;
        },
        entries, /*as_dict=*/true,
        [&](size_t i) { return read_model_tensor(reader, tensors[i].first, tensors[i].second, dtype); });
    out.close();
    TITAN_USER_CHECK(!out.fail(), "writing ", tmp, " failed (disk full?)");
  } catch (const c10::Error& e) {
    out.close();
    fs::remove(tmp, ec);
    throw UserError("cannot write " + out_file + ": " + e.what_without_backtrace());
  } catch (...) {
    out.close();
    fs::remove(tmp, ec);
    if (write_failed) throw UserError("writing " + tmp + " failed (disk full?)");
    throw;
  }
  fs::rename(tmp, out_file);
  return static_cast<int64_t>(entries.size());
}

int64_t convert_to_hf(const std::string& step_dir, const std::string& out_dir, at::ScalarType dtype) {
  checkpoint::Reader reader = open_checkpoint(step_dir);
  std::string model, flavor;
  try {
    model = reader.info().at("model").at("name").get<std::string>();
    const nlohmann::json& m = reader.info().at("model");
    // A flavor read from a Hugging Face config.json is recorded as the model's arguments (hf_config).
    flavor = m.contains("hf_config") ? m.at("hf_config").get<std::string>() : m.at("flavor").get<std::string>();
  } catch (const nlohmann::json::exception&) {
    throw UserError("checkpoint " + step_dir + " does not record its model (info.model.name and .flavor in " +
                    checkpoint::kIndexFile + "), so it cannot be exported");
  }
  checkpoint::HFWriter writer(out_dir, model_spec(model), flavor, dtype);
  const auto tensors = model_tensors(reader, step_dir);  // optimizer state, ... left out
  for (const auto& [name, shape] : tensors)
    writer.add(name, reader.read(kModelPrefix + name, std::vector<int64_t>(shape.size(), 0), shape));
  writer.finish();
  return static_cast<int64_t>(tensors.size());
}

std::string convert_from_hf(const std::string& hf_dir, const std::string& out_step_dir, const std::string& model,
                            const std::string& flavor) {
  const ModelSpec& spec = model_spec(model);
  std::string chosen = flavor;
  if (chosen.empty()) {
    // A registered flavor of the same shape, else the model's own config.json: any size imports.
    const auto matches = checkpoint::matching_hf_flavors(hf_dir, spec);
    chosen = matches.empty() ? (fs::path(hf_dir) / checkpoint::kHFConfigFile).string() : matches.front();
  }
  TITAN_USER_CHECK(!fs::exists(out_step_dir), out_step_dir, " already exists: choose a new checkpoint folder");
  checkpoint::HFSource source(hf_dir, spec, chosen);
  const nlohmann::json info = {{"step", 0},
                               {"model", checkpoint::model_record(spec, chosen)},
                               {"contents", {"model"}},
                               {"world_size", 1},
                               {"layout", "single process"}};
  // One tensor at a time: memory holds at most one output file's worth, whatever the model's size.
  checkpoint::write_single_process(out_step_dir, source.names(), [&](const std::string& name) {
    const std::vector<int64_t> shape = source.meta(name)->shape;
    return source.read(name, std::vector<int64_t>(shape.size(), 0), shape).to(at::kFloat);
  }, info);
  return chosen;
}

int64_t convert_from_dcp(const std::string& dcp_dir, const std::string& out_step_dir, const std::string& model,
                         const std::string& flavor, bool model_only) {
  const ModelSpec& spec = model_spec(model);
  TITAN_USER_CHECK(!fs::exists(out_step_dir), out_step_dir, " already exists: choose a new checkpoint folder");
  TITAN_USER_CHECK(checkpoint::is_dcp_folder(dcp_dir), dcp_dir, " has no ", checkpoint::kDcpMetadataFile,
                   " file: give the step folder of a torch.distributed.checkpoint save (e.g. "
                   "outputs/checkpoint/step-1000 of a torchtitan run)");
  checkpoint::DcpSource source(dcp_dir);
  std::vector<std::string> contents = source.contents();
  if (model_only) contents = {"model"};
  // The model of the flavor (on the meta device: names and shapes only) says what is written: each of
  // its parameters must be in the folder with its shape; names the model does not have are left out.
  const LanguageModel m = spec.build(flavor, at::TensorOptions().device(at::kMeta).dtype(at::kFloat), 2048);
  const bool optimizer = std::find(contents.begin(), contents.end(), "optimizer") != contents.end();
  std::vector<std::string> names;
  auto take = [&](const std::string& name, const std::vector<int64_t>& shape, bool required) {
    const auto meta = source.meta(name);
    if (!meta && !required) return;
    TITAN_USER_CHECK(meta.has_value(), source.describe(), " holds no ", name, ", which ", model, " flavor ", flavor,
                     " has: is --model.flavor (and --model.name) the saving run's?");
    TITAN_USER_CHECK(meta->shape == shape, source.describe(), ": ", name, " has shape ", c10::IntArrayRef(meta->shape),
                     " but ", model, " flavor ", flavor, " has ", c10::IntArrayRef(shape),
                     ": is --model.flavor (and --model.name) the saving run's?");
    names.push_back(name);
  };
  for (const auto& p : m->named_parameters()) {
    take("model." + p.key(), p.value().sizes().vec(), true);
    if (!optimizer) continue;
    take("optimizer." + p.key() + ".exp_avg", p.value().sizes().vec(), true);
    take("optimizer." + p.key() + ".exp_avg_sq", p.value().sizes().vec(), true);
    take("optimizer." + p.key() + ".step", {}, true);
  }
  for (const auto& [prefix, layer] : m->moe_layers())  // routing biases, where the folder has them
    if (layer->expert_bias.defined()) take("model." + prefix + "expert_bias", layer->expert_bias.sizes().vec(), false);
  // torchtitan counts one rank's tokens: times the saving run's data-parallel degree, which its data
  // loader records; without that record, times the saving ranks (exact for FSDP and DDP runs).
  nlohmann::json state = source.state(source.num_files());
  for (auto it = state.begin(); it != state.end();)
    it = std::find(contents.begin(), contents.end(), it.key()) == contents.end() ? state.erase(it) : std::next(it);
  // The optimizer's settings as titan checkpoints record them (for `to-dcp`), where the folder has them.
  if (optimizer) {
    const auto hp = source.optimizer_hyperparameters();
    bool complete = true;
    for (const char* k : {"lr", "beta1", "beta2", "eps", "weight_decay"}) complete = complete && hp.count(k) > 0;
    if (complete && state.contains("lr_scheduler")) {
      auto flag = [&](const char* k, double otherwise) { return hp.count(k) ? hp.at(k) : otherwise; };
      state["optimizer"] = {{"name", flag("decoupled_weight_decay", 1) != 0 ? "AdamW" : "Adam"},
                            {"lr", hp.count("initial_lr") ? hp.at("initial_lr") : hp.at("lr")},
                            {"beta1", hp.at("beta1")}, {"beta2", hp.at("beta2")}, {"eps", hp.at("eps")},
                            {"weight_decay", hp.at("weight_decay")},
                            {"implementation", flag("fused", 1) != 0      ? "fused"
                                               : flag("foreach", 0) != 0 ? "foreach"
                                                                          : "for-loop"}};
      state["lr_scheduler"]["lr"] = hp.at("lr");
    }
  }
  const int64_t step = state.contains("train_state") ? state["train_state"]["step"].get<int64_t>() : 0;
  const nlohmann::json info = {{"step", step},
                               {"model", checkpoint::model_record(spec, flavor)},
                               {"contents", contents},
                               {"world_size", 1},
                               {"layout", "torch.distributed.checkpoint"}};
  // One tensor at a time, in the dtype it was saved in.
  checkpoint::write_single_process(out_step_dir, names, [&](const std::string& name) {
    const std::vector<int64_t> shape = source.meta(name)->shape;
    return source.read(name, std::vector<int64_t>(shape.size(), 0), shape);
  }, info, state);
  return static_cast<int64_t>(names.size());
}

std::string convert_usage() {
  return "usage:\n"
         "  titan convert to-hf CHECKPOINT_STEP_DIR OUT_DIR [--checkpoint.export_dtype float32|bfloat16|float16]\n"
         "      a titan checkpoint (e.g. outputs/checkpoint/step-1000) to a Hugging Face model folder\n"
         "      (config.json + safetensors, for transformers' from_pretrained); optimizer state is left out\n"
         "  titan convert to-dcp CHECKPOINT_STEP_DIR OUT_DIR [--model-only [--checkpoint.export_dtype ...]]\n"
         "      a titan checkpoint as a torch.distributed.checkpoint folder (torchtitan's names): the model,\n"
         "      the AdamW state, the schedule and the step; torchtitan resumes from it with\n"
         "      --checkpoint.initial_load_path OUT_DIR --checkpoint.no_initial_load_model_only\n"
         "      --checkpoint.exclude_from_loading dataloader (or starts from its model alone)\n"
         "  titan convert to-torch CHECKPOINT_STEP_DIR OUT_FILE.pt [--checkpoint.export_dtype ...]\n"
         "      the model as one torch.save file (a dict of name -> tensor) for torch.load\n"
         "  titan convert from-hf HF_DIR OUT_CHECKPOINT_DIR [--model.name llama3] [--model.flavor F]\n"
         "      a Hugging Face model folder to a new titan checkpoint holding the model (fp32); without\n"
         "      --model.flavor, the flavor whose shape matches config.json\n"
         "  titan convert from-dcp DCP_STEP_DIR OUT_CHECKPOINT_DIR --model.flavor F [--model.name llama3]\n"
         "      [--model-only]\n"
         "      a torch.distributed.checkpoint folder (a torchtitan run's checkpoint/step-N) to a new titan\n"
         "      checkpoint: the model, the AdamW state, the learning-rate schedule's and the training step\n"
         "      (torchtitan's names); put it at <dump_folder>/checkpoint/step-N to resume there\n";
}

int run_convert(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::fputs(convert_usage().c_str(), args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  const std::string& direction = args[0];
  TITAN_USER_CHECK(direction == "to-hf" || direction == "from-hf" || direction == "from-dcp" || direction == "to-dcp" ||
                       direction == "to-torch",
                   "unknown conversion '", direction, "': use to-hf, from-hf, to-dcp, from-dcp or to-torch\n",
                   convert_usage());
  std::vector<std::string> options(args.begin() + std::min<size_t>(args.size(), 3), args.end());
  // from-dcp's and to-dcp's own flag: the model alone.
  const bool model_only =
      (direction == "from-dcp" || direction == "to-dcp") && std::erase(options, std::string("--model-only")) > 0;
  if (help_requested(args)) {
    std::cout << convert_usage();
    return 0;
  }
  TITAN_USER_CHECK(args.size() >= 3 && args[1].rfind("--", 0) != 0 && args[2].rfind("--", 0) != 0,
                   "titan convert ", direction, " needs two folders before any option\n", convert_usage());
  const JobConfig cfg = parse_config(options);
  if (direction == "to-torch") {
    const int64_t n = convert_to_torch(args[1], args[2], export_dtype(cfg.checkpoint.export_dtype));
    std::printf("wrote %lld tensors (%s) to %s\n", static_cast<long long>(n), cfg.checkpoint.export_dtype.c_str(),
                args[2].c_str());
    return 0;
  }
  if (direction == "to-dcp") {
    const bool config_given = std::any_of(options.begin(), options.end(),
                                          [](const std::string& o) { return o.rfind("--job.config_file", 0) == 0; });
    std::string settings_from;
    // Only for a checkpoint that does not record its optimizer's settings: the run's configuration.
    auto run_config = [&]() -> JobConfig {
      if (config_given) {
        settings_from = "the optimizer's settings and schedule from --job.config_file";
        return cfg;
      }
      const fs::path run_toml = run_config_beside(args[1]);
      TITAN_USER_CHECK(!run_toml.empty(), "checkpoint ", args[1], " does not record its optimizer's settings (saved by "
                       "an earlier titan, or converted from a folder without them) and no config.toml of its run is "
                       "beside the checkpoint folder: give the run's --job.config_file, or export the model alone "
                       "with --model-only");
      settings_from = "the optimizer's settings and schedule from " + run_toml.string();
      return read_run_config(run_toml);
    };
    const int64_t n = convert_to_dcp(args[1], args[2], export_dtype(cfg.checkpoint.export_dtype), model_only, run_config);
    std::printf("wrote %lld entries (%s) to %s\n", static_cast<long long>(n), cfg.checkpoint.export_dtype.c_str(),
                args[2].c_str());
    if (!settings_from.empty()) std::printf("%s\n", settings_from.c_str());
    return 0;
  }
  if (direction == "to-hf") {
    const int64_t n = convert_to_hf(args[1], args[2], export_dtype(cfg.checkpoint.export_dtype));
    std::printf("wrote %lld tensors (%s) and config.json to %s\n", static_cast<long long>(n),
                cfg.checkpoint.export_dtype.c_str(), args[2].c_str());
    // The tokenizer: the one named here, else the one of the run that saved the checkpoint (its
    // dump folder's config.toml, two levels above the step folder).
    std::string assets;
    for (const auto& o : options)
      if (o.rfind("--model.hf_assets_path", 0) == 0 || o.rfind("--job.config_file", 0) == 0) assets = cfg.model.hf_assets_path;
    const fs::path run_config = run_config_beside(args[1]);
    std::string note;
    try {
      if (assets.empty() && !run_config.empty()) assets = read_run_config(run_config).model.hf_assets_path;
      note = assets.empty() ? "no tokenizer exported: give the run's tokenizer with --model.hf_assets_path (no "
                              "config.toml of the run beside the checkpoint folder)"
                            : checkpoint::export_hf_tokenizer(assets, args[2]);
    } catch (const std::exception& e) {  // the weights are written: the tokenizer is an addition
      note = std::string("no tokenizer exported: ") + e.what() + "; give it with --model.hf_assets_path";
    }
    std::printf("%s\n", note.c_str());
    return 0;
  }
  // The flavor counts as given when named on the command line or by a config file.
  bool flavor_given = false;
  for (const auto& o : options)
    flavor_given |= o.rfind("--model.flavor", 0) == 0 || o.rfind("--job.config_file", 0) == 0;
  if (direction == "from-dcp") {
    TITAN_USER_CHECK(flavor_given, "titan convert from-dcp needs the model's flavor (--model.flavor, or the run's "
                     "--job.config_file): a torch.distributed.checkpoint does not record its model's configuration");
    const int64_t n = convert_from_dcp(args[1], args[2], cfg.model.name, cfg.model.flavor, model_only);
    std::printf("wrote %lld tensors of %s flavor %s as titan checkpoint %s\n", static_cast<long long>(n),
                cfg.model.name.c_str(), cfg.model.flavor.c_str(), args[2].c_str());
    return 0;
  }
  const std::string flavor = convert_from_hf(args[1], args[2], cfg.model.name, flavor_given ? cfg.model.flavor : "");
  std::printf("wrote %s flavor %s as titan checkpoint %s\n", cfg.model.name.c_str(), flavor.c_str(), args[2].c_str());
  return 0;
}

}  // namespace titan
