// Hugging Face model folders (what transformers' save_pretrained writes and from_pretrained reads):
//
//   config.json                        the architecture (LlamaForCausalLM, sizes, RoPE settings, dtype)
//   model.safetensors                  all weights, or when larger than one shard:
//   model-00001-of-0000N.safetensors   ...shards, and
//   model.safetensors.index.json       {"metadata": {"total_size": bytes}, "weight_map": {name: file}}
//
// Names and layouts are transformers' (model.layers.0.self_attn.q_proj.weight, Q/K rows in
// rotate-half order); the model's HFAdapter (registry.h) converts them to and from titan's.
#pragma once

#include "titan/components/checkpoint/file_io.h"
#include "titan/components/checkpoint/source.h"
#include "titan/models/registry.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace titan::checkpoint {

inline constexpr const char* kHFConfigFile = "config.json";
inline constexpr const char* kHFSingleFile = "model.safetensors";
inline constexpr const char* kHFIndexFile = "model.safetensors.index.json";

// Writes a model as a Hugging Face folder, one full tensor at a time: memory stays bounded by one
// shard. Usage: add() every parameter once (titan names, any order), then finish().
class HFWriter {
 public:
  // out_dir: created if missing; must not already hold a Hugging Face model. dtype: what the
  // weights are stored as (float32, bfloat16 or float16). Shards hold at most max_shard_bytes
  // (a single larger tensor gets a shard of its own).
  HFWriter(std::string out_dir, const ModelSpec& spec, const std::string& flavor, at::ScalarType dtype,
           int64_t max_shard_bytes = 5'000'000'000);
  ~HFWriter();
  HFWriter(const HFWriter&) = delete;
  HFWriter& operator=(const HFWriter&) = delete;

  // One full parameter by titan's name (e.g. "layers.0.attention.wq.weight"), or a MoE layer's
  // routing bias ("layers.3.moe.expert_bias": written where the architecture stores one, optional).
  // Throws UserError for a name that is not a parameter of the flavor, a wrong shape, or a parameter
  // given twice.
  void add(const std::string& titan_name, const at::Tensor& full);
  // Writes the last shard, renames the shards to their final names, then writes the index (when
  // sharded) and config.json. Throws UserError naming the first parameter never added.
  void finish();

 private:
  void flush();
  std::string out_dir_, flavor_;
  HFAdapter adapter_;
  at::ScalarType dtype_;
  int64_t max_shard_bytes_;
  std::map<std::string, std::vector<int64_t>> expected_;  // titan name -> shape, for parameters not yet added
  std::map<std::string, std::vector<int64_t>> optional_;  // routing biases: written when given and mapped
  std::set<std::string> added_;
  std::vector<SafetensorsEntry> pending_;                 // the shard being filled (HF names, `dtype_`)
  int64_t pending_bytes_ = 0, total_bytes_ = 0;
  std::vector<std::string> shard_paths_;                  // written shards, under temporary names
  std::vector<std::vector<std::string>> shard_names_;     // HF tensor names of each written shard
  bool finished_ = false;
};

// A Hugging Face folder presented as a titan checkpoint: tensor "model.<titan name>" in titan's
// layout and the stored dtype. Opening checks config.json against the flavor (naming the first
// field that differs) and that the files hold every parameter of the flavor and nothing else.
class HFSource : public Source {
 public:
  HFSource(std::string hf_dir, const ModelSpec& spec, const std::string& flavor);
  ~HFSource() override;
  std::vector<std::string> names() const override;
  std::optional<TensorMeta> meta(const std::string& name) const override;
  // Reads the whole HF tensor, converts it, and returns the block; the last converted tensor is
  // kept, so reading a tensor block by block reads its file once.
  at::Tensor read(const std::string& name, const std::vector<int64_t>& begin,
                  const std::vector<int64_t>& length) override;
  std::string describe() const override { return "Hugging Face folder " + dir_; }

 private:
  struct Entry {
    // The HF tensors it is made of (one, or a MoE layer's experts), each with the path of the
    // safetensors file holding it.
    std::vector<std::pair<std::string, std::string>> parts;
    TensorMeta meta;  // titan shape, stored dtype
    // A MoE layer's stacked experts: parts[rows[j]] is row j of dim 0 as stored, so a block of rows
    // reads only its experts' tensors (a rank of an expert-parallel or FSDP layout reads its own).
    std::vector<size_t> rows;
  };
  std::string dir_;
  HFAdapter adapter_;
  std::map<std::string, Entry> entries_;  // by checkpoint name
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
  std::string cached_name_;
  at::Tensor cached_;
};

// The flavors of `spec` whose Hugging Face config matches `hf_dir`/config.json.
std::vector<std::string> matching_hf_flavors(const std::string& hf_dir, const ModelSpec& spec);

// What a checkpoint records of its model (info.model): {"name", "flavor"}, and for a flavor read from
// a Hugging Face config.json the model's arguments as "hf_config" (a flavor every ModelSpec function
// accepts), so that exporting or inspecting the checkpoint does not need the file.
nlohmann::json model_record(const ModelSpec& spec, const std::string& flavor);

// Makes the Hugging Face folder `out_dir` loadable whole: the run's tokenizer (`assets`, as
// model.hf_assets_path names it) in a form transformers' AutoTokenizer reads, and a
// generation_config.json with its BOS and EOS ids.
//   tokenizer.json           copied, with tokenizer_config.json and special_tokens_map.json when the
//                            assets have them (else a tokenizer_config.json naming the BOS and EOS tokens)
//   SentencePiece model      copied as tokenizer.model, with a tokenizer_config.json for LlamaTokenizer
//   tiktoken model           not exported (transformers needs tokenizer.json for it): the return says so
// Returns one line saying what was written (or why no tokenizer was). Throws UserError for a
// tokenizer that does not load or a failed write.
std::string export_hf_tokenizer(const std::string& assets, const std::string& out_dir);

}  // namespace titan::checkpoint
