"""The text model's decode step written out for one new token per sequence, with few, fused kernels.

Through transformers' layers a decode step of MiniCPM-V 4.6's text model (Qwen3.5: 18 gated-DeltaNet
and 6 full-attention layers) is about 1,540 small kernels, 2.4 us each on an H200 even when replayed as a
CUDA graph: 4.1 ms a step against a 0.36 ms floor (benchmarks/RESULTS.md). Here a layer is ten kernels:
the projections of a layer are one matrix product (its weights concatenated once at load, the modules
keeping views into them, so the prefill path is unchanged and no memory is added), and everything
between the products is one kernel each (app.engine.decode_ops). Sequences read and write their state
in the slot store in place (app.engine.batch_cache).

Used for any checkpoint whose text model is this architecture with plain linear layers; others
(quantized ones) decode through transformers' layers.
"""

import torch
import torch.nn.functional as F

from app.engine import decode_ops


_DELTANET_LINEARS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
_ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")


def fused_decoder_for(model, store):
    """A FusedDecoder for `model`'s text model reading `store`, or None where it does not apply."""
    text = model.model.language_model
    config = text.config
    if config.model_type != "qwen3_5_text" or config.hidden_act != "silu":
        return None
    if config.rope_parameters.get("rope_type", "default") != "default":
        return None
    linears = [model.lm_head]
    for layer in text.layers:
        mixer, names = (layer.linear_attn, _DELTANET_LINEARS) if hasattr(layer, "linear_attn") \
            else (layer.self_attn, _ATTENTION_LINEARS)
        linears += [getattr(mixer, name, None) for name in names]
        linears += [getattr(layer.mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    # Quantized layers (GPTQ, AWQ, bitsandbytes) hold no plain weight to concatenate.
    if any(type(module) is not torch.nn.Linear or module.bias is not None for module in linears):
        return None
    if any(layer.self_attn.head_dim & (layer.self_attn.head_dim - 1)
           for layer in text.layers if hasattr(layer, "self_attn")):
        return None  # the attention kernel works on power-of-two heads
    return FusedDecoder(model, store)


@torch.no_grad()
def _merge_weights(*linears: torch.nn.Linear) -> torch.Tensor:
    """One weight for several linear layers of the same input, the layers keeping views into it."""
    merged = torch.cat([linear.weight for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = torch.nn.Parameter(merged[start:start + rows], requires_grad=False)
        start += rows
    return merged


def _norm_weight(norm) -> torch.Tensor:
    """The model's zero-centred RMSNorm scale (1 + w) in fp32."""
    return 1.0 + norm.weight.detach().float()


class _DeltaNetLayer:
    def __init__(self, layer):
        attention = layer.linear_attn
        self.index = attention.layer_idx
        self.key_heads = attention.num_k_heads
        self.channels = attention.conv_dim
        # [queries, keys, values | output gate | betas | decays]: see decode_ops.gated_delta_step.
        self.in_weight = _merge_weights(attention.in_proj_qkv, attention.in_proj_z, attention.in_proj_b,
                                        attention.in_proj_a)
        self.gate_column = self.channels
        self.beta_column = self.gate_column + attention.value_dim
        self.decay_column = self.beta_column + attention.num_v_heads
        self.conv_weight = attention.conv1d.weight.detach()[:, 0]
        self.a_log = attention.A_log.detach()
        self.dt_bias = attention.dt_bias.detach()
        self.norm_weight = attention.norm.weight.detach()
        self.norm_eps = attention.norm.variance_epsilon
        self.out_weight = attention.out_proj.weight

    def __call__(self, hidden, store, n, positions, rope_positions):
        projection = F.linear(hidden, self.in_weight)
        qkv = decode_ops.conv_step(projection, self.channels, store.conv[self.index][:n], self.conv_weight)
        attended = decode_ops.gated_delta_step(qkv, projection, self.beta_column, self.decay_column, self.a_log,
                                               self.dt_bias, store.recurrent[self.index][:n], self.key_heads)
        gated = decode_ops.gated_rms_norm(attended, projection, self.gate_column, self.norm_weight, self.norm_eps)
        return F.linear(gated, self.out_weight)


class _AttentionLayer:
    def __init__(self, layer, rotary_embedding):
        attention = layer.self_attn
        self.index = attention.layer_idx
        self.heads = attention.config.num_attention_heads
        self.kv_heads = attention.config.num_key_value_heads
        self.head_dim = attention.head_dim
        self.scaling = attention.scaling
        self.in_weight = _merge_weights(attention.q_proj, attention.k_proj, attention.v_proj)
        self.q_norm = _norm_weight(attention.q_norm)
        self.k_norm = _norm_weight(attention.k_norm)
        self.eps = attention.q_norm.eps
        self.inv_freq = rotary_embedding.inv_freq.float()
        self.rope_scaling = float(rotary_embedding.attention_scaling)
        self.out_weight = attention.o_proj.weight

    def __call__(self, hidden, store, n, positions, rope_positions):
        projection = F.linear(hidden, self.in_weight)
        keys, values = store.keys[self.index], store.values[self.index]
        query = decode_ops.attention_inputs(projection, self.heads, self.kv_heads, self.head_dim, self.q_norm,
                                            self.k_norm, self.eps, self.inv_freq, self.rope_scaling, rope_positions,
                                            positions, keys, values)
        attended = decode_ops.attend(query, keys, values, positions, self.scaling, projection)
        return F.linear(attended, self.out_weight)


class _MLP:
    def __init__(self, mlp):
        self.gate_up_weight = _merge_weights(mlp.gate_proj, mlp.up_proj)
        self.down_weight = mlp.down_proj.weight

    def __call__(self, hidden):
        return F.linear(decode_ops.silu_and_mul(F.linear(hidden, self.gate_up_weight)), self.down_weight)


class FusedDecoder:
    """decode(tokens, positions): next-token logits for slots [0, n), each fed one token at its column
    `positions[i]`, with the same contract as BatchRunner's step through transformers' layers."""

    def __init__(self, model, store):
        text = model.model.language_model
        self.store = store
        self.embed = text.embed_tokens
        self.lm_head = model.lm_head
        self.eps = text.config.rms_norm_eps
        self.layers = []
        for layer in text.layers:
            mixer = _DeltaNetLayer(layer) if hasattr(layer, "linear_attn") else _AttentionLayer(layer, text.rotary_emb)
            self.layers.append((_norm_weight(layer.input_layernorm), mixer, _norm_weight(layer.post_attention_layernorm),
                                _MLP(layer.mlp)))
        self.final_norm = _norm_weight(text.norm)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        store = self.store
        n = tokens.shape[0]
        rope_positions = positions + store.rope_deltas[:n]
        hidden, residual = self.embed(tokens), None
        for input_norm, mixer, post_norm, mlp in self.layers:
            normed, residual = decode_ops.add_rms_norm(hidden, residual, input_norm, self.eps)
            hidden = mixer(normed, store, n, positions, rope_positions)
            normed, residual = decode_ops.add_rms_norm(hidden, residual, post_norm, self.eps)
            hidden = mlp(normed)
        normed, _ = decode_ops.add_rms_norm(hidden, residual, self.final_norm, self.eps)
        return self.lm_head(normed)
