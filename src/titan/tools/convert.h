// `titan convert`: a titan checkpoint to a Hugging Face model folder and back, from a
// torch.distributed.checkpoint folder (torchtitan's), and its model to such a folder or a torch.save file.
//
//   titan convert to-hf CHECKPOINT_STEP_DIR OUT_DIR [--checkpoint.export_dtype float32|bfloat16|float16]
//   titan convert from-hf HF_DIR OUT_CHECKPOINT_DIR [--model.name llama3] [--model.flavor F]
//   titan convert from-dcp DCP_STEP_DIR OUT_CHECKPOINT_DIR --model.flavor F
//   titan convert to-dcp CHECKPOINT_STEP_DIR OUT_DIR [--model-only [--checkpoint.export_dtype ...]]
//   titan convert to-torch CHECKPOINT_STEP_DIR OUT_FILE.pt [--checkpoint.export_dtype ...]
//
// to-hf writes the model's weights (optimizer state is left out) as safetensors shards of at most
// 5 GB plus config.json, loadable with transformers' from_pretrained. from-hf writes a titan
// checkpoint holding only the model (fp32), for checkpoint.initial_load_path or further training.
#pragma once

#include "titan/config/job_config.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

namespace titan {

// Exports the "model.*" tensors of titan checkpoint `step_dir` (e.g. outputs/checkpoint/step-1000),
// one tensor in memory at a time. Returns the number of tensors written.
int64_t convert_to_hf(const std::string& step_dir, const std::string& out_dir, at::ScalarType dtype);

// Imports Hugging Face folder `hf_dir` as model `model` / `flavor` into a new checkpoint folder
// `out_step_dir`. An empty flavor picks the registered flavor whose config matches config.json.
// Returns the flavor used.
std::string convert_from_hf(const std::string& hf_dir, const std::string& out_step_dir, const std::string& model,
                            const std::string& flavor);

// Imports torch.distributed.checkpoint folder `dcp_dir` (torchtitan's names) into a new checkpoint folder
// `out_step_dir` recording model `model` / `flavor`: the model, and unless `model_only` the AdamW state,
// the schedule's step and the training step. Returns the number of tensors written.
int64_t convert_from_dcp(const std::string& dcp_dir, const std::string& out_step_dir, const std::string& model,
                         const std::string& flavor, bool model_only);

// Exports titan checkpoint `step_dir` as a torch.distributed.checkpoint folder `out_dir` under
// torchtitan's names, one tensor in memory at a time: the model's state dict at the top level and,
// when the checkpoint holds them and not `model_only`, the optimizer flattened as torchtitan saves it
// ("optimizer.state.<param>.exp_avg", ..., "optimizer.param_groups.<param>.lr", ...), the LambdaLR
// schedule ("lr_scheduler.*") and "train_state.*": what torchtitan resumes from (its data loader's
// state excluded), and torch.distributed.checkpoint.load reads in any layout. The optimizer's
// settings are the checkpoint's record of them, or for a checkpoint saved before titan recorded them,
// those of `run_config()` (called only then). Returns the number of entries written.
int64_t convert_to_dcp(const std::string& step_dir, const std::string& out_dir, at::ScalarType dtype, bool model_only,
                       const std::function<JobConfig()>& run_config);

// Exports them as one torch.save file `out_file` (a dict of name -> tensor, torch.load(...,
// weights_only=True) reads it), written one tensor at a time. Returns the count.
int64_t convert_to_torch(const std::string& step_dir, const std::string& out_file, at::ScalarType dtype);

// The command line after `titan convert`; returns the exit status.
int run_convert(const std::vector<std::string>& args);
// Usage text of `titan convert`.
std::string convert_usage();

}  // namespace titan
