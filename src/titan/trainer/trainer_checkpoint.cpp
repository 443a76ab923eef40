// The trainer's side of checkpoints: what a checkpoint holds, when it is saved, and resuming.
//
// Contents (names as in the checkpoint index, docs/checkpoint.md):
//   model.<param>                                     every parameter, by its global name, and the
//                                                     routing bias of each MoE layer (layers.N.moe.expert_bias)
//   optimizer.<param>.exp_avg / .exp_avg_sq / .step   AdamW state, placed like its parameter
//   rng.cpu (rng.cuda)                                the default generators' states
//   state: train_state {step, ntokens_seen}, lr_scheduler {step}, dataloader (global stream position)
// Every piece is global (placements, the global sample stream), so any layout resumes any checkpoint.
#include "titan/common/error.h"
#include "titan/common/trace.h"
#include "titan/components/checkpoint/dcp.h"
#include "titan/components/checkpoint/file_io.h"
#include "titan/components/checkpoint/hf.h"
#include "titan/trainer/trainer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>

#include <unistd.h>

namespace titan {
namespace {

const std::vector<std::string> kParts = {"model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng"};

bool has(const std::vector<std::string>& v, const std::string& x) { return std::find(v.begin(), v.end(), x) != v.end(); }

// The parts a checkpoint holds (its info's contents), in kParts order, less the excluded ones.
std::vector<std::string> parts_to_load(const checkpoint::Reader& r, const std::vector<std::string>& exclude) {
  const auto contents = r.info().at("contents").get<std::vector<std::string>>();
  std::vector<std::string> out;
  for (const auto& p : kParts)
    if (has(contents, p) && !has(exclude, p)) out.push_back(p);
  return out;
}

}  // namespace

// What a torch.distributed.checkpoint's optimizer ran with, where it differs from this run's
// [optimizer] (titan continues with its own settings). torchtitan's groups hold the scheduled lr
// and the base lr as initial_lr.
std::string Trainer::dcp_optimizer_note(const std::map<std::string, double>& saved) const {
  const auto& o = cfg_.optimizer;
  const std::vector<std::pair<std::string, double>> ours = {
      {"initial_lr", o.lr}, {"eps", o.eps}, {"weight_decay", o.weight_decay}, {"beta1", o.beta1}, {"beta2", o.beta2}};
  std::string out;
  for (const auto& [key, value] : ours) {
    auto it = saved.find(key);
    if (it == saved.end() || std::abs(it->second - value) <= 1e-12 * std::abs(value)) continue;
    out += (out.empty() ? "" : ", ") + (key == "initial_lr" ? std::string("lr") : key) + " " + std::to_string(it->second) +
           " (this run: " + std::to_string(value) + ")";
  }
  return out.empty() ? "" : "the checkpoint's optimizer ran with " + out + "; training continues with this run's [optimizer]";
}

namespace {

at::ScalarType export_dtype(const std::string& name) {
  return name == "bfloat16" ? at::kBFloat16 : name == "float16" ? at::kHalf : at::kFloat;
}

}  // namespace

std::vector<dist::PlacedTensor> Trainer::checkpoint_tensors(const std::vector<std::string>& parts, bool saving) {
  std::vector<dist::PlacedTensor> out;
  // A copy of a parameter another pipeline stage holds too (tied embeddings) is loaded like the
  // primary but written by the primary's ranks only.
  auto skipped = [&](const dist::PlacedTensor& p) { return saving && is_shared_copy(p.name); };
  if (has(parts, "model")) {
    for (const auto& p : params_)
      if (!skipped(p)) out.push_back({"model." + p.name, p.local, p.placement});
    // Routing biases (buffers, equal on every rank of a pipeline stage): part of the model, as in
    // torchtitan's state dict.
    for (const auto& [prefix, layer] : moe_layers_)
      if (layer->expert_bias.defined())
        out.push_back({"model." + prefix + "expert_bias", layer->expert_bias,
                       dist::whole(layer->expert_bias, dims_->tp() > 1 ? std::vector<std::string>{"dp_cp", "tp"}
                                                                       : std::vector<std::string>{"dp_cp"})});
  }
  if (has(parts, "optimizer")) {
    const auto state = optimizer_->state_dict();  // aliases of the live state
    for (const auto& p : params_) {
      if (skipped(p)) continue;
      out.push_back({"optimizer." + p.name + ".exp_avg", state.at(p.name + ".exp_avg"), p.placement});
      out.push_back({"optimizer." + p.name + ".exp_avg_sq", state.at(p.name + ".exp_avg_sq"), p.placement});
      // The step count is the same on every piece: written once, by the first shard's primary copy.
      bool first = p.placement.primary;
      for (const auto& s : p.placement.shards) first = first && s.offset == 0;
      const at::Tensor step = state.at(p.name + ".step");
      out.push_back({"optimizer." + p.name + ".step", step, dist::whole(step, {}, first)});
    }
  }
  if (has(parts, "rng")) {
    // Every rank draws from the same seeded generators; rank 0's state is written.
    at::Tensor cpu = at::detail::getDefaultCPUGenerator().get_state();
    out.push_back({"rng.cpu", cpu, dist::whole(cpu, {}, env_.rank == 0)});
    if (device_.is_cuda()) {
      at::Tensor cuda = at::globalContext().defaultGenerator(device_).get_state();
      out.push_back({"rng.cuda", cuda, dist::whole(cuda, {}, env_.rank == 0)});
    }
  }
  return out;
}

nlohmann::json Trainer::checkpoint_state() {
  // Beyond what a resume reads (the step, the tokens seen, the schedule's step, the data position):
  // the optimizer's settings, the learning rate of the next step and the data-parallel degree, so that
  // `titan convert to-dcp` writes the parameter groups and schedule torchtitan resumes from.
  const auto& o = cfg_.optimizer;
  return {{"train_state", {{"step", step_}, {"ntokens_seen", tokens_seen()}, {"dp_degree", dims_->dp_size()}}},
          {"lr_scheduler", {{"step", lr_step_}, {"lr", o.lr * lr_schedule_->factor(lr_step_)}}},
          {"optimizer", {{"name", o.name}, {"lr", o.lr}, {"beta1", o.beta1}, {"beta2", o.beta2}, {"eps", o.eps},
                         {"weight_decay", o.weight_decay}, {"implementation", o.implementation}}},
          {"dataloader", nlohmann::json::parse(dataloader_->state())}};
}

void Trainer::save_checkpoint(bool model_only, std::optional<at::ScalarType> cast) {
  TITAN_ASSERT(checkpointer_, "save_checkpoint without checkpoint.enable");
  TraceRange range(mem::Phase::Checkpoint, "checkpoint_save");
  const std::vector<std::string> parts = model_only ? std::vector<std::string>{"model"} : kParts;
  // With async_mode the copy off the live tensors is all that blocks training; a synchronous save
  // writes the CPU tensors themselves.
  checkpoint::SnapshotOptions so;
  so.copy = cfg_.checkpoint.async_mode != "disabled";
  so.reuse = checkpointer_->reusable_snapshot();
  so.pin = device_.is_cuda() && cfg_.checkpoint.async_mode == "async_with_pinned_mem";
  so.cast_floats_to = cast;
  // Each replicated piece (HSDP/DDP replicas, TP-replicated norms) is written by one of its holders,
  // chosen so that every rank writes about the same bytes.
  std::vector<dist::PlacedTensor> tensors = checkpoint_tensors(parts, /*saving=*/true);
  checkpoint::assign_writers(tensors, [&](const std::string& dim) {
    auto& g = (*mesh_)[dim];
    return std::pair<int, int>(g.rank(), g.size());
  });
  checkpoint::Snapshot snap = checkpoint::take_snapshot(tensors, so);
  nlohmann::json contents = parts;
  snap.info = {{"step", step_},
               {"model", model_record_},
               {"contents", contents},
               {"world_size", env_.world_size},
               {"layout", dims_->describe()}};
  if (!model_only) snap.state = checkpoint_state();
  checkpointer_->save(step_, std::move(snap));
}

void Trainer::save_checkpoint_at_step() {
  const auto& c = cfg_.checkpoint;
  const bool last = step_ == cfg_.training.steps;
  if (!last || (!c.last_save_model_only && !c.last_save_in_hf)) return save_checkpoint(false);
  if (!c.last_save_in_hf) return save_checkpoint(true, export_dtype(c.export_dtype));
  // Hugging Face: rank 0 writes config.json and the safetensors files, one gathered tensor at a time,
  // into step-N.partial, renamed to step-N when complete (replacing an export of the same step).
  checkpointer_->wait();
  const std::string dir = checkpointer_->step_dir(step_), partial = dir + ".partial";
  std::unique_ptr<checkpoint::HFWriter> writer;
  on_every_rank([&] {  // rank 0 prepares the folder before the ranks enter the gathers
    if (env_.rank != 0) return;
    std::error_code ec;
    std::filesystem::remove_all(partial, ec);
    writer = std::make_unique<checkpoint::HFWriter>(partial, model_spec(cfg_.model.name), cfg_.model.flavor,
                                                    export_dtype(c.export_dtype));
  }, "start the Hugging Face save in " + partial);
  for_each_full_parameter([&](const std::string& name, const at::Tensor& full) {
    if (writer) writer->add(name, full.to(at::kCPU));
  });
  // Routing biases (equal on every rank of a stage: rank 0 writes those it holds; DeepSeek-V3's
  // checkpoints store them, Qwen3-MoE's have none). Under pipeline parallelism set_up_checkpointing
  // refuses exports of architectures that store them.
  if (writer)
    for (const auto& [prefix, layer] : moe_layers_)
      if (layer->expert_bias.defined()) writer->add(prefix + "expert_bias", layer->expert_bias.to(at::kCPU));
  if (!writer) return;
  writer->finish();
  std::string tokenizer;
  try {
    tokenizer = checkpoint::export_hf_tokenizer(cfg_.model.hf_assets_path, partial);
  } catch (const std::exception& e) {  // the weights are written: the tokenizer is an addition
    tokenizer = std::string("no tokenizer exported: ") + e.what();
  }
  checkpoint::replace_directory(partial, dir);
  log_info("Checkpoint: saved step " + std::to_string(step_) + " in Hugging Face format to " + dir + " (" +
           tokenizer + ")");
}

void Trainer::wait_for_checkpoint() {
  if (checkpointer_) checkpointer_->wait();
}

void Trainer::on_every_rank(const std::function<void()>& f, const std::string& what) {
  std::string error;
  try {
    f();
  } catch (const nlohmann::json::exception& e) {
    error = what + ": malformed (" + e.what() + ")";
  } catch (const std::exception& e) {
    error = e.what();
  }
  at::Tensor failed = at::full({1}, error.empty() ? 0 : 1, at::TensorOptions().dtype(at::kInt).device(device_));
  (*mesh_)["world"].all_reduce(failed, c10d::ReduceOp::MAX).wait();
  if (failed.item<int>() != 0)
    throw UserError(error.empty() ? "another rank failed to " + what + " (its error is in its log)" : error);
}

void Trainer::load_checkpoint(checkpoint::Source& source, std::vector<std::string> parts, const nlohmann::json& state,
                              bool allow_cast) {
  TraceRange range(mem::Phase::Checkpoint, "checkpoint_load");
  // Read and check everything first (one block in memory at a time); nothing is modified unless every
  // rank succeeded. Then the blocks are read again straight into the live tensors: no second copy of
  // the model and optimizer state is ever held.
  std::optional<int64_t> step, tokens, lr_step;
  std::vector<dist::PlacedTensor> tensors = checkpoint_tensors(parts, /*saving=*/false);
  // Routing biases a source does not hold (Hugging Face Qwen3-MoE weights have none, nor does a
  // checkpoint converted from them) start at zero, as in a fresh model.
  size_t biases_absent = 0;
  std::erase_if(tensors, [&](const dist::PlacedTensor& t) {
    const bool bias = t.name.size() > 16 && t.name.compare(t.name.size() - 16, 16, ".moe.expert_bias") == 0;
    const bool absent = bias && !source.meta(t.name).has_value();
    biases_absent += absent;
    return absent;
  });
  if (biases_absent)
    log_info(source.describe() + " holds no routing biases (" + std::to_string(biases_absent) +
             " MoE layers): they start at zero");
  on_every_rank([&] {
    checkpoint::check(source, tensors, allow_cast);
    if (has(parts, "train_state")) {
      step = state.at("train_state").at("step").get<int64_t>();
      tokens = state.at("train_state").at("ntokens_seen").get<int64_t>();
      TITAN_USER_CHECK(*tokens % dims_->dp_size() == 0, source.describe(), ": ", *tokens,
                       " tokens seen do not split over ", dims_->dp_size(), " data-parallel ranks");
    }
    if (has(parts, "lr_scheduler")) lr_step = state.at("lr_scheduler").at("step").get<int64_t>();
  }, "load " + source.describe());
  // The data position is checked (same dataset, same seq_len) by restoring it; on a failure the
  // constructor throws, so the half-restored loader is never used. Apart from the checks above, which
  // one rank may fail alone: restoring text data exchanges tokens between the node's ranks, which must
  // all reach it.
  if (has(parts, "dataloader"))
    on_every_rank([&] { dataloader_->load_state(state.at("dataloader").dump()); },
                  "restore the data position of " + source.describe());
  on_every_rank([&] { checkpoint::load_into(source, tensors, allow_cast); },
                "load " + source.describe() + " (after it was checked: the state is partly loaded, so the run stops)");
  if (step) step_ = *step;
  if (lr_step) lr_step_ = *lr_step;
  if (tokens) ntokens_seen_ = *tokens / dims_->dp_size();
  for (const auto& t : tensors) {  // the generator states were loaded into copies: set them
    if (t.name != "rng.cpu" && t.name != "rng.cuda") continue;
    at::Generator g = t.name == "rng.cpu" ? at::detail::getDefaultCPUGenerator()
                                          : at::globalContext().defaultGenerator(device_);
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(t.local);
  }
}

void Trainer::check_checkpoint_model(const checkpoint::Reader& reader) const {
  // Two models of the same shapes may differ (RoPE scaling, norm epsilon): the recorded arguments
  // must be this run's. Checkpoints of another family, or of a flavor this build does not know, are
  // left to the shape checks.
  const nlohmann::json& info = reader.info();
  if (!info.contains("model") || !info.at("model").is_object()) return;
  const nlohmann::json& m = info.at("model");
  if (m.value("name", std::string()) != cfg_.model.name) return;
  const std::string recorded = m.contains("hf_config") ? m.value("hf_config", std::string()) : m.value("flavor", std::string());
  const ModelSpec& spec = model_spec(cfg_.model.name);
  std::string why;
  try {
    why = spec.hf_adapter(cfg_.model.flavor).config_mismatch(spec.hf_adapter(recorded).config_json(at::kFloat));
  } catch (const UserError&) {
    return;
  }
  TITAN_USER_CHECK(why.empty(), reader.describe(), " holds a ", cfg_.model.name, " model of other arguments than "
                   "model.flavor '", cfg_.model.flavor, "': ", why, ". Train with the flavor it was saved with (index.json "
                   "records it under info.model)");
}

void Trainer::set_up_checkpointing() {
  const auto& c = cfg_.checkpoint;
  TITAN_USER_CHECK(!c.create_seed_checkpoint || c.enable,
                   "checkpoint.create_seed_checkpoint needs checkpoint.enable = true (the seed is written to its folder)");
  TITAN_USER_CHECK(!c.last_save_in_hf || c.last_save_model_only,
                   "checkpoint.last_save_in_hf writes only the model: set checkpoint.last_save_model_only = true");
  if (c.last_save_in_hf && dims_->pp() > 1 && !model_->moe_layers().empty()) {
    // Rank 0 writes the export; under pipeline parallelism it holds only its stage's routing biases.
    bool stores_bias = false;
    const HFAdapter adapter = model_spec(cfg_.model.name).hf_adapter(cfg_.model.flavor);
    for (const auto& [prefix, layer] : model_->moe_layers())
      stores_bias = stores_bias || !adapter.to_hf({{prefix + "expert_bias", layer->expert_bias}}).empty();
    TITAN_USER_CHECK(!stores_bias, "checkpoint.last_save_in_hf under pipeline parallelism: this model's Hugging Face "
                     "checkpoints hold the routing biases of every MoE layer, which the pipeline stages hold apart; "
                     "save a titan checkpoint (last_save_in_hf = false) and export it with `titan convert to-hf`");
  }
  for (const auto& part : c.exclude_from_loading) {
    TITAN_USER_CHECK(has(kParts, part), "checkpoint.exclude_from_loading: unknown part '", part,
                     "'; the parts are model, optimizer, lr_scheduler, dataloader, train_state, rng");
  }
  if (!c.enable && c.initial_load_path.empty()) {
    if (!restart_note().empty())
      log_info(restart_note() + "checkpoint.enable is false, so nothing was saved to resume from: training starts "
               "again from step 1");
    return;
  }

  const std::string folder = (std::filesystem::path(cfg_.job.dump_folder) / c.folder).string();
  // Saves are coordinated on Gloo groups of their own (a node's ranks, and the nodes' first ranks),
  // under checkpoint.save_timeout_seconds.
  const auto [node, nodes] =
      mesh_->host_groups_by_block("checkpoint", env_.local_world_size, std::chrono::seconds(cfg_.comm.init_timeout_seconds),
                                  std::chrono::seconds(c.save_timeout_seconds), "checkpoint.save_timeout_seconds");
  checkpointer_ = std::make_unique<checkpoint::Checkpointer>(
      c, folder, checkpoint::node_coordinator(*node, nodes, env_.rank, env_.world_size),
      [this](const std::string& m) { log_info(m); });
  if (c.enable && !c.load_only) {
    // Testing hook: TITAN_TEST_RANK_CHECKPOINT_FOLDER="R=path" makes rank R see another folder (as a
    // node-local disk would).
    std::string view;
    if (const char* hook = std::getenv("TITAN_TEST_RANK_CHECKPOINT_FOLDER")) {
      const std::string h = hook;
      const auto eq = h.find('=');
      if (eq != std::string::npos && h.substr(0, eq) == std::to_string(env_.rank)) view = h.substr(eq + 1);
    }
    checkpointer_->check_shared_folder(view);
  }
  if (c.create_seed_checkpoint) return;  // a seed is the initialized model: nothing to load

  // Rank 0 chooses the checkpoint and every rank loads that one (their views of the folder may lag).
  at::Tensor chosen = at::full({1}, -1, at::TensorOptions().dtype(at::kLong).device(device_));
  on_every_rank([&] {
    if (env_.rank != 0 || !c.enable) return;
    if (auto step = checkpointer_->resume_step()) chosen.fill_(*step);
  }, "choose a checkpoint in " + folder);
  (*mesh_)["world"].broadcast(chosen, 0).wait();
  if (const int64_t step = chosen.item<int64_t>(); step >= 0) {
    const std::string dir = checkpointer_->step_dir(step);
    std::unique_ptr<checkpoint::Reader> reader;
    on_every_rank([&] {
      reader = std::make_unique<checkpoint::Reader>(dir);
      check_checkpoint_model(*reader);
    }, "open " + dir);
    const std::vector<std::string> parts = parts_to_load(*reader, c.exclude_from_loading);
    load_checkpoint(*reader, parts, reader->state(), /*allow_cast=*/false);
    std::string loaded;
    for (const auto& p : parts) loaded += (loaded.empty() ? "" : ", ") + p;
    log_info(restart_note() + "Checkpoint: resumed from " + dir + " (" + loaded + "), saved by " +
             reader->info().at("layout").get<std::string>() + "; continuing at step " + std::to_string(step_ + 1));
    return;
  }
  if (!restart_note().empty() && c.initial_load_path.empty())
    log_info(restart_note() + "no complete checkpoint in " + folder + ": training starts again from step 1");
  if (c.initial_load_path.empty()) return;
  // No checkpoint in the folder yet: start from initial_load_path (a titan checkpoint, a Hugging Face
  // folder, or a torch.distributed.checkpoint folder such as torchtitan saves).
  std::vector<std::string> parts = {"model"};
  std::unique_ptr<checkpoint::Source> source;
  nlohmann::json state = nlohmann::json::object();
  std::string dcp_note;
  on_every_rank([&] {
    if (c.initial_load_in_hf) {
      source = std::make_unique<checkpoint::HFSource>(c.initial_load_path, model_spec(cfg_.model.name), cfg_.model.flavor);
      return;
    }
    if (checkpoint::is_dcp_folder(c.initial_load_path)) {
      auto dcp = std::make_unique<checkpoint::DcpSource>(c.initial_load_path);
      if (!c.initial_load_model_only) {
        for (const auto& p : dcp->contents())
          if (p != "model" && !has(c.exclude_from_loading, p)) parts.push_back(p);
        if (has(parts, "train_state") || has(parts, "lr_scheduler")) state = dcp->state(dims_->dp_size());
        if (has(parts, "optimizer")) dcp_note = dcp_optimizer_note(dcp->optimizer_hyperparameters());
      }
      const std::string unread = dcp->unread_summary();
      if (!unread.empty()) dcp_note += (dcp_note.empty() ? "" : "; ") + std::string("not read: ") + unread;
      source = std::move(dcp);
      return;
    }
    namespace fs = std::filesystem;
    std::error_code ec;
    if (fs::is_directory(c.initial_load_path, ec) && !fs::exists(fs::path(c.initial_load_path) / checkpoint::kIndexFile, ec)) {
      // The folder that holds a run's step folders, titan's or torchtitan's: name the latest.
      std::string latest;
      int64_t latest_step = -1;
      for (const auto& entry : fs::directory_iterator(c.initial_load_path, ec)) {
        const std::string name = entry.path().filename().string();
        if (name.rfind("step-", 0) != 0 || !(checkpoint::is_dcp_folder(entry.path().string()) ||
                                             fs::exists(entry.path() / checkpoint::kIndexFile, ec)))
          continue;
        const int64_t step = std::atoll(name.c_str() + 5);
        if (step > latest_step) latest_step = step, latest = entry.path().string();
      }
      TITAN_USER_CHECK(latest.empty(), "checkpoint.initial_load_path ", c.initial_load_path, " holds checkpoints, not one: "
                       "give one of its step folders, e.g. ", latest, " (the latest)");
    }
    auto reader = std::make_unique<checkpoint::Reader>(c.initial_load_path);
    check_checkpoint_model(*reader);
    if (!c.initial_load_model_only) {
      for (const auto& p : parts_to_load(*reader, c.exclude_from_loading))
        if (p != "model") parts.push_back(p);
      state = reader->state();
    }
    source = std::move(reader);
  }, "open checkpoint.initial_load_path " + c.initial_load_path);
  load_checkpoint(*source, parts, state, /*allow_cast=*/true);
  std::string loaded;
  for (const auto& p : parts) loaded += (loaded.empty() ? "" : ", ") + p;
  log_info("Checkpoint: initial load of " + c.initial_load_path +
           (c.initial_load_in_hf ? " (Hugging Face)" : dynamic_cast<checkpoint::DcpSource*>(source.get()) ? " (torch.distributed.checkpoint)" : "") +
           " (" + loaded + "); starting at step " + std::to_string(step_ + 1));
  if (!dcp_note.empty()) log_info("Checkpoint: " + dcp_note);
}

}  // namespace titan
