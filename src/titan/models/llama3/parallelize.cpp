#include "titan/models/llama3/parallelize.h"

#include "titan/common/error.h"
#include "titan/distributed/fsdp.h"
#include "titan/models/llama3/model.h"

namespace titan::llama3 {

void parallelize(LanguageModelImpl& model, const ParallelizeContext& ctx) {
  auto* transformer = dynamic_cast<TransformerImpl*>(&model);
  TITAN_ASSERT(transformer, "llama3::parallelize needs a llama3 Transformer");
  if (ctx.fsdp) {
    for (size_t i = 0; i < transformer->layers->size(); ++i)
      ctx.fsdp->fully_shard(*transformer->layers[i]->as<TransformerBlock>(), "layers." + std::to_string(i) + ".",
                            ctx.init_weights);
    ctx.fsdp->fully_shard(*transformer, "", ctx.init_weights);
  }
}

}  // namespace titan::llama3
