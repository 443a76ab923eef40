#include "titan/distributed/options.h"

namespace titan::dist {

ParallelDims parallel_dims(const config::Parallelism& p, int64_t world_size) {
  return ParallelDims(p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.context_parallel_degree,
                      p.tensor_parallel_degree, p.pipeline_parallel_degree, world_size, p.expert_parallel_degree);
}

DataParallelOptions data_parallel_options(const config::Parallelism& par, const config::Training& tr, bool pipeline,
                                          bool bf16_compute) {
  DataParallelOptions dpo;
  dpo.fsdp.offload_to_cpu = tr.enable_cpu_offload;
  dpo.fsdp.param_dtype = bf16_compute ? at::kBFloat16 : at::kFloat;
  dpo.fsdp.reduce_dtype = at::kFloat;
  dpo.fsdp.reshard_after_forward = par.fsdp_reshard_after_forward;
  if (pipeline) {
    // By default the units stay gathered across the step's microbatches and reduce once after the
    // last backward; "always" reshards after every forward and backward action (lower memory, two
    // all-gathers per unit and microbatch).
    dpo.fsdp.reshard_after_backward = par.fsdp_reshard_after_forward == "always";
    if (par.fsdp_reshard_after_forward == "default") dpo.fsdp.reshard_after_forward = "never";
  }
  // CPU offload keeps FSDP's shards in CPU memory: it shards over dp_shard_cp even when that is one
  // rank (one GPU, or replicas only), as torchtitan's fully_shard with an offload policy does.
  dpo.shard_always = tr.enable_cpu_offload;
  return dpo;
}

TensorParallelOptions tensor_parallel_options(const config::Parallelism& par) {
  TensorParallelOptions tpo;
  tpo.sequence_parallel = par.enable_sequence_parallel;
  tpo.loss_parallel = !par.disable_loss_parallel;
  tpo.async = par.enable_async_tensor_parallel;
  return tpo;
}

}  // namespace titan::dist
