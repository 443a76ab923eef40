#include "titan/models/llama3/parallelize.h"

#include "titan/common/error.h"
#include "titan/distributed/fsdp.h"
#include "titan/models/common/activation_checkpoint.h"
#include "titan/models/llama3/model.h"

namespace titan::llama3 {

void parallelize(LanguageModelImpl& model, const ParallelizeContext& ctx) {
  auto* transformer = dynamic_cast<TransformerImpl*>(&model);
  TITAN_ASSERT(transformer, "llama3::parallelize needs a llama3 Transformer");
  // torchtitan's order: (TP, CP,) activation checkpointing, then FSDP. FSDP's hooks run around the
  // checkpointed body, so recomputation in backward gathers nothing more.
  if (ctx.ac_mode != "none") {
    TITAN_ASSERT(ctx.ac_mode == "full" || ctx.ac_mode == "op" || (ctx.ac_mode == "selective" && ctx.ac_every >= 1),
                 "AC mode ", ctx.ac_mode);
    for (size_t i = 0; i < transformer->layers->size(); ++i)
      if (ctx.ac_mode != "selective" || static_cast<int64_t>(i + 1) % ctx.ac_every == 0)
        nn::apply_activation_checkpointing(*transformer->layers[i]->as<TransformerBlock>(), ctx.ac_mode == "op");
  }
  if (ctx.fsdp) {
    // Units as torchtitan makes them: each block; [norm, output] together, kept gathered after the
    // forward (its backward comes first) and apart from the embedding so that its reduce-scatter
    // starts as soon as the output layer's backward is done; the root (the embedding) last.
    for (size_t i = 0; i < transformer->layers->size(); ++i)
      ctx.fsdp->fully_shard(*transformer->layers[i]->as<TransformerBlock>(), "layers." + std::to_string(i) + ".",
                            ctx.init_rows);
    std::vector<dist::UnitPart> head = {{"norm.", transformer->norm.get()}};
    if (transformer->output) head.push_back({"output.", transformer->output.get()});
    ctx.fsdp->fully_shard(head, ctx.init_rows, /*keep_after_forward=*/true);
    ctx.fsdp->fully_shard(*transformer, "", ctx.init_rows);
  }
}

}  // namespace titan::llama3
