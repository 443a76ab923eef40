// Layout-independent parameter initialization.
//
// A parameter's initial values are a function of (seed, its global name) only: each parameter
// draws from its own CPU generator seeded by mixing the run seed with a hash of the name. Every
// parallel layout (and every rank) therefore trains the same global model, and no seed checkpoint
// is needed. Values are drawn in fp32 on the CPU and then copied to the parameter's device/dtype.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string_view>

namespace titan::init {

// The generator for parameter `name` under run seed `seed`.
at::Generator param_generator(uint64_t seed, std::string_view name);

// Fill `param` in place (no autograd), drawing from param_generator(seed, name).
// Tensors without values (meta, or storage not allocated: see tensor_storage.h) are left alone,
// so a model can be initialized piece by piece as its parameters get their memory.
void normal(at::Tensor& param, uint64_t seed, std::string_view name, double mean, double std);
// Truncated normal with absolute cut-offs [a, b] like torch.nn.init.trunc_normal_ (inverse-CDF method).
void trunc_normal(at::Tensor& param, uint64_t seed, std::string_view name, double mean, double std,
                  double a, double b);
void ones(at::Tensor& param);

}  // namespace titan::init
