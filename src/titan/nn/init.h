// Layout-independent parameter initialization.
//
// A parameter's initial values are a function of (seed, its global name) only, and any slice of
// them can be generated alone: element i of parameter `name` depends on (seed, name, i) and nothing
// else (not on the slice asked for, the chunking, the thread count, the CPU's vector width or the
// tensor's device). Every parallel layout therefore trains the same global model, no seed
// checkpoint is needed, and each rank computes only its own shard: O(shard), not O(model).
//
// The generator is counter-based: Philox-4x32-10 keyed by a 64-bit mix of the seed and a 64-bit
// hash of the name. Elements come in groups of 64 (group g = elements [64g, 64g + 64)); element
// 64g + 16l + j takes 32-bit word l of the Philox block with counter (16g + j, attempt, 0), where
// the 64-bit block index fills counter words 0-1 and `attempt` (0 unless a truncated draw is
// rejected) word 2. Normals: Box-Muller on the word pairs (0, 1) and (2, 3) of each block (cosine
// and sine), with vectorized log, sqrt and sine/cosine accurate to ~1e-7; the radius reaches 6.77
// std. Values are computed on the CPU in fp32 with the same operations on every code path (AVX-512,
// AVX2, generic), so the bits are identical everywhere, then converted to the tensor's dtype (round
// to nearest even, as Tensor::to) and copied to its device. (The inverse-CDF path of narrow
// truncations computes in double with libm: the same on every slice and thread count, across
// machines as far as their libm agrees.)
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace titan::init {

// Each function fills `out` (any dtype, any device, any shape) with the elements
// [first_element, first_element + out.numel()) of parameter `name`'s flattened (row-major) initial
// values: the rows [r, r + n) of a parameter with k elements per row are first_element = r * k.
// No autograd. Elements past the parameter's end are defined too (FSDP's padding may ask for them).

// Normal(mean, std).
void normal(at::Tensor out, uint64_t seed, std::string_view name, int64_t first_element, double mean, double std);
// Normal(mean, std) truncated to the absolute cut-offs [a, b], like torch.nn.init.trunc_normal_: an
// element whose draw falls outside draws again with the next attempt counter (exact distribution).
// Cut-offs keeping less than 10% of the mass use the inverse CDF (in double) instead.
void trunc_normal(at::Tensor out, uint64_t seed, std::string_view name, int64_t first_element, double mean,
                  double std, double a, double b);
void ones(at::Tensor out);
void zeros(at::Tensor out);

namespace detail {
// For tests. Philox-4x32-10 of one counter (Salmon et al., SC'11): the reference of the vectorized one.
std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);
// The Philox key of parameter (seed, name).
std::array<uint32_t, 2> philox_key(uint64_t seed, std::string_view name);
// The 32-bit word each element of [first_element, first_element + n) draws at `attempt`.
std::vector<uint32_t> random_words(uint64_t seed, std::string_view name, int64_t first_element, int64_t n,
                                   uint32_t attempt);
// The vectorized code paths this CPU runs ("avx512", "avx2", "generic"), fastest first, and a switch
// between them (all give identical bits). The fastest is used unless a test switches.
std::vector<std::string> kernel_variants();
void set_kernel_variant(const std::string& name);
}  // namespace detail

}  // namespace titan::init
