// Float8 linear layers with dynamic scaling (torchao's Float8Linear recipes, docs/float8.md).
//
// A linear layer y = x Wᵀ runs three matrix multiplications, each A (M, K) @ B (K, N):
//   output       y  = x @ Wᵀ        operands: input, weight
//   grad_input   gx = gy @ W        operands: grad_output, weight (for grad_input)
//   grad_weight  gW = gyᵀ @ x       operands: grad_output (for grad_weight), input (for grad_weight)
// Each operand is cast to a float8 type (e4m3fn: max 448; e5m2: max 57344) with a scale from its
// amax, or kept in high precision:
//   amax  = max |t| over the whole tensor (tensorwise) or along the matmul's K (axiswise: one per
//           row of A, one per column of B)
//   scale = fp8_max / max(amax, 1e-12) computed in fp64, stored fp32; rounded down to a power of 2
//           when the recipe says (2^floor(log2 scale))
//   data  = float8(clamp(t_fp32 * scale, -fp8_max, fp8_max))
// and the product is (A_data @ B_data) / (scale_A scale_B), accumulated in fp32 and returned in the
// high-precision dtype. Recipes (torchao's names):
//   tensorwise          all tensorwise; input, weight e4m3, grad_output e5m2
//   rowwise             all axiswise, all e4m3, scales rounded to powers of 2
//   rowwise_with_gw_hp  as rowwise for output; grad_input: grad_output axiswise e4m3 and the weight
//                       tensorwise e4m3; grad_weight in high precision (no cast)
// The matmul itself: at::_scaled_mm (CUDA: either granularity; CPU: tensorwise, or for axiswise
// scales the float8 product with unit scales, then the scales applied to its fp32 result, the same
// value). `emulate` keeps the float8 rounding but multiplies the values (data / scale) in fp32, for
// devices without float8 matmuls.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace titan::nn {

enum class Float8Type { E4M3, E5M2, HighPrecision };
enum class Float8Scaling { Tensorwise, Axiswise };

// How one operand of one matmul is cast.
struct Float8Cast {
  Float8Type type = Float8Type::E4M3;
  Float8Scaling scaling = Float8Scaling::Tensorwise;
};

struct Float8Recipe {
  std::string name = "tensorwise";
  Float8Cast input, weight, grad_output;                                             // output, grad_input
  Float8Cast weight_for_grad_input, grad_output_for_grad_weight, input_for_grad_weight;
  bool round_scales_to_power_of_2 = false;
  bool emulate = false;
  // torchao's recipe by name ("tensorwise", "rowwise", "rowwise_with_gw_hp"; "" is tensorwise).
  // Throws UserError for another name.
  static Float8Recipe named(const std::string& name, bool emulate = false);
};

// Tensor parallelism's split of a float8 linear layer (set by dist::TensorParallel). In the layer's
// logical dims (M tokens, N out features, K in features; x (M, K), W (N, K), gy (M, N)) one is split
// over the ranks: 'N' (column-wise), 'K' (row-wise) or 'M' (a replicated layer on sequence-sharded
// tokens). An operand holding the split dim takes its amax as the maximum over the ranks
// (max_over_ranks, an all-reduce) where the amax spans that dim: always for tensorwise scales, and
// for axiswise ones when the split dim is the matmul's K. The casts then equal one device's.
struct Float8Sharding {
  char dim = 0;
  std::function<void(at::Tensor& amax)> max_over_ranks;
};

// A layer's weight cast to float8 before the layer runs (FSDP's float8 all-gather, which gathers the
// float8 bytes, dist/fsdp.h): `data` (N, K) e4m3fn, `scale` an fp32 scalar, both as the tensorwise
// recipe's cast of the whole weight would make them (the amax over every rank's shard). The layer
// multiplies with them instead of casting its weight, in forward and for grad_input; the owner keeps
// them valid while the layer's forward and backward run (FSDP's unit is gathered then).
struct Float8Weight {
  at::Tensor data, scale;
};

// The cast's two steps, for a caller that reduces amaxes its own way (FSDP's float8 all-gather):
// the scale from an amax (fp64, stored fp32, optionally a power of 2), and the float8 data of `t`
// under a scale that broadcasts against it (one value, or (R, 1) or (1, C) for a 2-D t), row-major,
// or column-major (its transpose contiguous) when `column_major` and t is 2-D. On CUDA one pass of
// titan's kernel (fused_kernels.h) writes it in that layout; elsewhere ATen's operations.
at::Tensor float8_scale(const at::Tensor& amax, Float8Type type, bool round_scales_to_power_of_2);
at::Tensor float8_data(const at::Tensor& t, const at::Tensor& scale, Float8Type type, bool column_major = false);

// One operand cast as above: `data` float8 (the operand's shape), `scale` fp32 (a scalar
// (tensorwise) or the operand's shape with K reduced to 1 (axiswise)). `k_dim` is the dimension
// summed by the matmul (1 for A, 0 for B). `max_over_ranks`, when given, completes the amax across
// the ranks that hold the rest of the operand. `column_major`: `data` in that layout (float8_data).
struct Float8Operand {
  at::Tensor data, scale;
};
Float8Operand float8_cast(const at::Tensor& t, const Float8Cast& cast, int64_t k_dim, bool round_scales_to_power_of_2,
                          const std::function<void(at::Tensor&)>* max_over_ranks = nullptr, bool column_major = false);

// a (M, K) @ b (K, N) with a and b cast as `ca`, `cb` (both high precision or both float8), in
// `out_dtype`, each amax completed over the ranks by the function given for it (or none).
// `fast_accum`: CUDA's faster, less precise accumulation (torchao uses it for the forward's product
// only; the CPU ignores it). (Shapes where a float8 operand's dims are not multiples of 16 are the
// caller's to avoid: CUDA's kernels need them.)
// `a_cast`, `b_cast`: an operand already cast (its data and scale), used instead of casting it.
at::Tensor float8_mm(const at::Tensor& a, const at::Tensor& b, const Float8Cast& ca, const Float8Cast& cb,
                     at::ScalarType out_dtype, const Float8Recipe& recipe,
                     const std::function<void(at::Tensor&)>* max_a = nullptr,
                     const std::function<void(at::Tensor&)>* max_b = nullptr, bool fast_accum = false,
                     const Float8Operand* b_cast = nullptr, const Float8Operand* a_cast = nullptr);

// x (..., K) Wᵀ for W (N, K) under `recipe`, differentiable in x and W (gradients in their dtypes).
// Where the recipe casts the input alike for the output and for grad_weight (tensorwise), the
// backward casts x under the forward's scale (no second amax, nor its all-reduce).
// Under autocast, x is first cast to the autocast dtype (the output's). With `kept` defined (an
// output kept by per-operator activation checkpointing) the forward returns it instead of
// multiplying again; the backward is the same. `sharding`: the layer's split under tensor
// parallelism (null: none). `cast_weight` (tensorwise recipe only): the weight already in float8,
// used for the forward's and grad_input's products (null: the layer casts `weight`).
at::Tensor float8_linear(const at::Tensor& x, const at::Tensor& weight, const Float8Recipe& recipe,
                         const at::Tensor& kept = at::Tensor(), const Float8Sharding* sharding = nullptr,
                         const Float8Weight* cast_weight = nullptr);

// Within its scope (one thread's; scopes nest, the innermost serves), float8 layers given the same
// input tensor cast it once for their forward products: the first layer's cast (amax, its reduction
// over the ranks, scale, float8 data) serves each later one that casts its input alike (the same
// float8 type, scaling, scale rounding and amax reduction) while the tensor is unchanged (its
// version). Attention's wq, wk and wv take one input, as do a feed-forward's w1 and w3. The casts are
// freed with the scope. (The values are those of casting again: a cast depends on the tensor alone.)
// A scope no float8 layer uses costs nothing but its opening (no allocation).
class Float8SharedInputs {
 public:
  Float8SharedInputs();
  ~Float8SharedInputs();
  Float8SharedInputs(const Float8SharedInputs&) = delete;
  Float8SharedInputs& operator=(const Float8SharedInputs&) = delete;
  struct State;
  State* existing() const { return state_.get(); }  // null until a cast is recorded
  State& state();                                      // made on the first use

 private:
  std::unique_ptr<State> state_;
  Float8SharedInputs* outer_;
};

// Grouped float8 matmuls of MoE experts (torchao's float8 grouped GEMM for
// "quantize.grouped_mm.float8"): x (T, K) holds the routed tokens sorted by expert, counts_E[e] rows
// for expert e; w (E, N, K) stacks the experts' weights. Rows of group e become x_e w[e]ᵀ, each of
// the three products per group cast as `recipe` says (rowwise: one scale per token row and per
// (expert, column), and for the weight gradient per column over the group's tokens only: the
// jagged scales of a grouped GEMM). Differentiable in x and w (w's gradient for an expert without
// tokens is zero). On CUDA the weight gradient's product sums over a group's tokens padded with zero
// rows to a multiple of 16 for the float8 kernels (zeros change no amax and no product). `counts`:
// the groups' row counts, on the host (read once per MoE layer's forward by its caller). `padding`:
// that multiple of rows instead (0: 16 on CUDA, none elsewhere; a test pads on the CPU).
at::Tensor float8_grouped_linear(const at::Tensor& x, const at::Tensor& w, const std::vector<int64_t>& counts,
                                 const Float8Recipe& recipe, int64_t padding = 0);

}  // namespace titan::nn
