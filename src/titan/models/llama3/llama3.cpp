#include "titan/models/llama3/llama3.h"

#include "titan/models/common/decoder_spec.h"
#include "titan/models/llama3/args.h"

namespace titan::llama3 {

namespace {
const HFDialect kDialect{"LlamaForCausalLM", "llama", false, 0};
}

ModelSpec spec() { return decoder_model_spec({"llama3", &flavors(), kDialect}); }

HFAdapter hf_adapter(const DecoderArgs& args) { return decoder_hf_adapter(args, kDialect); }

}  // namespace titan::llama3
