"""What titan's MoE reference scripts (qwen3_moe_reference.py, deepseek_v3_reference.py) share: a
transformers MoE model's forward and backward on a batch, with each MoE layer's routed copies per
expert, and the gradients of its fused experts in titan's layout."""

import torch
from safetensors.torch import load_file


def forward_backward(model, moe_layers, num_experts, batch_path):
    """Runs BATCH's "tokens" (B, S) through `model` and back-propagates the mean cross-entropy against
    its "labels". Returns "logits", "loss" and "counts.<layer>" (E,): the routed token copies each
    expert of that layer received (from its router's top-k indices, the third output of mlp.gate).

    With output_router_logits in the model's config, the loss back-propagated adds
    router_aux_loss_coef x the mean over the MoE layers of transformers' load_balancing_loss_func
    of each layer's router logits alone (titan's per-layer form; transformers pools the layers), and
    the mean is returned as "aux_loss" (the cross-entropy stays "loss")."""
    counts = {}

    def count(i):
        def hook(module, args, output):
            counts[f"counts.{i}"] = torch.bincount(output[2].reshape(-1), minlength=num_experts).float()
        return hook

    for i in moe_layers:
        model.model.layers[i].mlp.gate.register_forward_hook(count(i))
    batch = load_file(batch_path)
    model.train()
    aux = bool(getattr(model.config, "output_router_logits", False))
    result = model(input_ids=batch["tokens"], output_router_logits=aux)
    logits = result.logits.float()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    out = {"logits": logits.detach().contiguous(), "loss": loss.detach().reshape(())}
    if aux:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        per_layer = [load_balancing_loss_func((g,), num_experts, model.config.num_experts_per_tok)
                     for g in result.router_logits]
        assert len(per_layer) == len(moe_layers), (len(per_layer), moe_layers)
        aux_loss = torch.stack(per_layer).mean()
        (loss + model.config.router_aux_loss_coef * aux_loss).backward()
        out["aux_loss"] = aux_loss.detach().reshape(())
    else:
        loss.backward()
    out.update(counts)
    return out


def fused_expert_grads(params, moe_layers):
    """titan's "grad.layers.<i>.moe.experts.w1" and "...w3" from transformers 5's fused
    mlp.experts.gate_up_proj (E, 2F, D), gate rows first (down_proj is titan's w2 as it is)."""
    out = {}
    for i in moe_layers:
        g = params[f"model.layers.{i}.mlp.experts.gate_up_proj"].grad
        f = g.shape[1] // 2
        out[f"grad.layers.{i}.moe.experts.w1"] = g[:, :f].contiguous()
        out[f"grad.layers.{i}.moe.experts.w3"] = g[:, f:].contiguous()
    return out
