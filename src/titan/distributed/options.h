// The distributed layer's options from the config's [parallelism] and [training] sections: one
// function per parallelism, beside the parallelisms themselves.
#pragma once

#include "titan/config/sections_run.h"
#include "titan/config/sections_train.h"
#include "titan/distributed/data_parallel.h"
#include "titan/distributed/parallel_dims.h"
#include "titan/distributed/tensor_parallel.h"

namespace titan::dist {

// The degrees of [parallelism] over `world_size` ranks (dp_shard -1: the ranks left over); throws
// UserError when they do not fit.
ParallelDims parallel_dims(const config::Parallelism& par, int64_t world_size);

// FSDP / HSDP / DDP: resharding (under pipeline parallelism the units stay gathered over a step's
// microbatches by default, as torchtitan does), CPU offload, and the dtype parameters are gathered in
// (bf16 when the run computes in bf16 on CUDA).
DataParallelOptions data_parallel_options(const config::Parallelism& par, const config::Training& training,
                                          bool pipeline, bool bf16_compute);

// Tensor parallelism's sequence parallel, loss parallel and async options.
TensorParallelOptions tensor_parallel_options(const config::Parallelism& par);

}  // namespace titan::dist
