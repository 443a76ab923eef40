"""Independent PyTorch reference for titan's float8 linear layer (tests/unit/models/float8_test.cpp),
written from torchao's recipes (docs/float8.md): each operand of each of the linear layer's three
matmuls cast with its own amax and scale, the product of the dequantized float8 values in fp64.

  float8_reference.py IN.safetensors OUT.safetensors

IN holds x (M, K), w (N, K), gy (M, N) in fp32 and the metadata "recipe" (tensorwise, rowwise or
rowwise_with_gw_hp). OUT holds y = x wᵀ, gx = gy w and gw = gyᵀ x as the recipe computes them, in
fp32, and the scales of the forward's operands: "scale_x" and "scale_w".
"""

import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}


def cast(t, dtype, axiswise, k_dim, pow2):
    """Returns (dequantized values, scale): amax over the tensor or along the matmul's K, scale =
    max / amax (fp64, clamped at 1e-12, stored fp32, optionally 2^floor(log2)), t * scale clamped and
    rounded to float8."""
    if dtype is None:
        return t.double(), None
    amax = t.abs().amax(dim=k_dim, keepdim=True) if axiswise else t.abs().max()
    scale = (MAX[dtype] / amax.double().clamp(min=1e-12)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    data = (t.float() * scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype)
    return data.double() / scale.double(), scale


def main():
    with safe_open(sys.argv[1], "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        recipe = f.metadata()["recipe"]
    x, w, gy = t["x"], t["w"], t["gy"]
    # (dtype, axiswise) for: input, weight | grad_output, weight | grad_output, input
    if recipe == "tensorwise":
        ops = [(E4M3, False), (E4M3, False), (E5M2, False), (E4M3, False), (E5M2, False), (E4M3, False)]
        pow2 = False
    elif recipe == "rowwise":
        ops = [(E4M3, True)] * 6
        pow2 = True
    elif recipe == "rowwise_with_gw_hp":
        ops = [(E4M3, True), (E4M3, True), (E4M3, True), (E4M3, False), (None, False), (None, False)]
        pow2 = True
    else:
        sys.exit(f"unknown recipe {recipe}")

    def mm(a, b, ca, cb):  # a (M, K) @ b (K, N): a's K is dim 1, b's dim 0
        da, sa = cast(a, *ca, 1, pow2)
        db, sb = cast(b, *cb, 0, pow2)
        return (da @ db).float(), sa, sb

    y, sx, sw = mm(x, w.t(), ops[0], ops[1])
    gx, _, _ = mm(gy, w, ops[2], ops[3])
    gw, _, _ = mm(gy.t(), x, ops[4], ops[5])
    save_file({"y": y.contiguous(), "gx": gx.contiguous(), "gw": gw.contiguous(),
               "scale_x": sx.float().contiguous(), "scale_w": sw.float().contiguous()}, sys.argv[2])


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
