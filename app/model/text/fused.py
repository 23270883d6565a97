"""The text model written out over the slot store with few, fused kernels: its decode step (one new
token per sequence) and its prefill (prompts packed back to back).

Through transformers' layers a decode step of MiniCPM-V 4.6's text model (Qwen3.5: 18 gated-DeltaNet
and 6 full-attention layers) is about 1,540 small kernels, 2.4 us each on an H200 even when replayed as a
CUDA graph: 4.1 ms a step against a 0.36 ms floor. Here a layer is ten kernels (249 a step, 0.90 ms at
batch 1 with the one-row products of D44; docs/DECISIONS.md D20): the projections of a layer are one matrix product (its weights
concatenated once at load, the modules keeping views into them, so transformers' path still works and
no memory is added), and everything between the products is one kernel each (app.model.text.ops).
Sequences read and write their state in the slot store in place (app.model.batch_cache), and
attention reads each sequence's own columns only, split across the GPU (flash-decoding).

A prefill wave packs its prompts back to back instead of left-padding them to one length: the DeltaNet
layers run flash-linear-attention's chunked kernels over the packed sequences (cu_seqlens), attention
runs per prompt. Each prompt's result is then what it would be alone (transformers' padded wave is
not, by a little), and a 32-prompt wave's text half takes half the time.

Used for any checkpoint whose text model is this architecture with plain linear layers, as far as its
config and modules show (fused_text_model_for checks what the code here assumes rather than reads);
others (quantized ones) and MiniCPM-V 4.7's prompts with images (their M-RoPE positions are three
channels apart) go through transformers' layers.
"""

import logging

import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

from app.model.text import ops as text_ops
from app.model.text import prefill_attention
from app.model.text.rows import ContinuedRows, Rows

log = logging.getLogger(__name__)


_DELTANET_LINEARS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
_ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")


def fused_text_model_for(model, store):
    """A FusedTextModel for `model`'s text model reading `store`, or None where it does not apply (the
    reason is logged)."""
    text = model.model.language_model
    reason = _config_mismatch(text.config) or _modules_mismatch(text, model.lm_head)
    if reason:
        log.info("The text model runs through transformers' layers, not the fused one: %s", reason)
        return None
    return FusedTextModel(model, store)


def _config_mismatch(config) -> str | None:
    """What of the text config the fused model would not compute as transformers' layers do. It reads the
    rest: sizes, heads and head dims, the rotary dimensions (partial_rotary_factor), base and scaling,
    eps, and the output layer, tied or not."""
    if config.model_type != "qwen3_5_text":
        return f"model type {config.model_type}"
    if config.hidden_act != "silu":  # the MLP's and the DeltaNet convolution's activation
        return f"hidden_act {config.hidden_act}"
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type != "default":
        return f"rope type {rope_type}"
    # transformers' Qwen3.5 layers do not read it (they always gate): a config saying otherwise is not this model.
    if not getattr(config, "attn_output_gate", True):
        return "attn_output_gate false"
    if config.attention_bias:
        return "attention biases"
    return None


def _modules_mismatch(text, lm_head) -> str | None:
    """What of the text model's modules the fused model would not compute as they do."""
    linears, norms = [lm_head], [text.norm]
    for layer in text.layers:
        mixer, names = (layer.linear_attn, _DELTANET_LINEARS) if hasattr(layer, "linear_attn") \
            else (layer.self_attn, _ATTENTION_LINEARS)
        linears += [getattr(mixer, name, None) for name in names]
        linears += [getattr(layer.mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [layer.self_attn.q_norm, layer.self_attn.k_norm] if hasattr(layer, "self_attn") else []
    # Quantized layers (GPTQ, AWQ, bitsandbytes) hold no plain weight to concatenate.
    if any(type(module) is not torch.nn.Linear or module.bias is not None for module in linears):
        return "linear layers other than plain nn.Linear without bias (a quantized checkpoint)"
    # The fused norms scale by 1 + w, at one eps for all: FusedTextModel's for the layers', q_norm's for k_norm.
    if any(type(norm) is not Qwen3_5RMSNorm or norm.eps != text.config.rms_norm_eps for norm in norms):
        return "a norm other than Qwen3.5's zero-centred RMSNorm (1 + w) at rms_norm_eps"
    for layer in text.layers:
        reason = _deltanet_mismatch(layer.linear_attn) if hasattr(layer, "linear_attn") \
            else _attention_mismatch(layer.self_attn, text.rotary_emb)
        if reason:
            return reason
    return None


def _deltanet_mismatch(attention) -> str | None:
    norm = attention.norm  # text_ops.gated_rms_norm: x / rms(x) * w * SiLU(gate), at the norm's own eps
    if type(norm) is not Qwen3_5RMSNormGated or norm.activation != "silu":
        return "a DeltaNet output norm other than Qwen3.5's SiLU-gated RMSNorm"
    if attention.conv1d.bias is not None:
        return "a DeltaNet convolution with a bias"
    return None


def _attention_mismatch(attention, rotary_embedding) -> str | None:
    heads, head_dim = attention.config.num_attention_heads, attention.head_dim
    if head_dim & (head_dim - 1):
        return f"head_dim {head_dim}: the attention kernels work on power-of-two heads"
    if attention.q_proj.out_features != 2 * heads * head_dim:  # text_ops.attention_inputs' layout
        return "a q_proj other than a query and its output gate per head"
    if 2 * rotary_embedding.inv_freq.shape[0] > head_dim:
        return "rotary dimensions wider than a head"
    return None


@torch.no_grad()
def merge_parameters(*linears: torch.nn.Linear, name: str = "weight") -> torch.Tensor:
    """One weight (or bias: `name`) for several linear layers of the same input, the layers keeping views into it."""
    merged = torch.cat([getattr(linear, name) for linear in linears])
    start = 0
    for linear in linears:
        rows = getattr(linear, name).shape[0]
        setattr(linear, name, torch.nn.Parameter(merged[start:start + rows], requires_grad=False))
        start += rows
    return merged


# cuBLAS's fast kernels need rows of a multiple of 8 values: logits [rows, 248,094] (the real vocabulary) took
# an align-2 kernel, 0.50 ms of a 4.6 ms step at 200 rows on an H200 (docs/DECISIONS.md D54).
OUTPUT_ROWS_MULTIPLE = 64


def padded_output_weight(lm_head: torch.nn.Linear, multiple: int) -> torch.Tensor:
    """The output layer's weight with zero rows up to a multiple of `multiple`; the layer (and a tied input
    embedding) keeps a view of its first rows, so that no memory is added."""
    weight, rows = lm_head.weight, lm_head.weight.shape[0]
    padded_rows = -(-rows // multiple) * multiple
    if padded_rows == rows:
        return weight.detach()
    padded = weight.new_zeros((padded_rows, weight.shape[1]))
    with torch.no_grad():
        padded[:rows] = weight
    weight.data = padded[:rows]  # the Parameter object stays: a tied embedding shares it
    return padded


# A captured continued prefill of at most this many places a prompt (a generation prompt's graphs: 16) runs the delta
# rule a token at a time in one kernel a layer; longer ones through the chunked kernels (docs/DECISIONS.md D67).
STEPPED_DELTA_RULE_TOKENS = 16


def _norm_weight(norm) -> torch.Tensor:
    """The model's zero-centred RMSNorm scale (1 + w) in fp32."""
    return 1.0 + norm.weight.detach().float()


class _DeltaNetLayer:
    def __init__(self, layer):
        attention = layer.linear_attn
        self.index = attention.layer_idx
        self.key_heads = attention.num_k_heads
        self.value_heads = attention.num_v_heads
        self.key_dim, self.value_dim = attention.key_dim, attention.value_dim
        self.channels = attention.conv_dim
        # [queries, keys, values | output gate | betas | decays]: see text_ops.gated_delta_step.
        self.in_weight = merge_parameters(attention.in_proj_qkv, attention.in_proj_z, attention.in_proj_b,
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

    def decode(self, hidden, store, rows: Rows):
        n = hidden.shape[0]
        projection = text_ops.linear(hidden, self.in_weight)
        qkv = text_ops.conv_step(projection, self.channels, store.conv[self.index][:n], self.conv_weight)
        attended = text_ops.gated_delta_step(qkv, projection, self.beta_column, self.decay_column, self.a_log, self.dt_bias,
                                             store.recurrent[self.index][:n], self.key_heads, rows.columns)
        return self._out(attended, projection)

    def prefill(self, hidden, store, rows: Rows):
        projection = text_ops.linear(hidden, self.in_weight)
        qkv = text_ops.packed_conv(projection, self.channels, self.conv_weight, rows.places)
        tails = (projection[rows.tail_rows, :self.channels] * rows.tail_exists[..., None]).transpose(1, 2)
        store.ensure_layer(store.conv, self.index, tails, columns=False).index_copy_(0, rows.prompt_slots, tails)
        return self._delta_rule(projection, qkv, store, rows)

    def prefill_continued(self, hidden, store, rows: ContinuedRows):
        """prefill for prompts that go on from their slots' states: the convolution reads each slot's kept
        inputs before the new ones, and the delta rule starts from each slot's recurrent state."""
        projection = text_ops.linear(hidden, self.in_weight)
        if rows.prompt_lengths is not None:
            return self._prefill_continued_padded(projection, store, rows)
        conv_state = store.conv[self.index].index_select(0, rows.prompt_slots).transpose(1, 2)  # [prompts, width, channels]
        inputs = projection.new_empty((rows.conv_places.shape[0], self.channels))
        inputs[rows.conv_state_rows] = conv_state.reshape(-1, self.channels).to(inputs.dtype)
        inputs[rows.conv_token_rows] = projection[:, :self.channels]
        qkv = text_ops.packed_conv(inputs, self.channels, self.conv_weight, rows.conv_places)[rows.conv_token_rows]
        store.conv[self.index].index_copy_(0, rows.prompt_slots, inputs[rows.conv_tail_rows].transpose(1, 2).to(conv_state.dtype))
        return self._delta_rule(projection, qkv, store, rows, store.recurrent[self.index].index_select(0, rows.prompt_slots),
                                rows.real)

    def _prefill_continued_padded(self, projection, store, rows: ContinuedRows):
        """prefill_continued for prompts padded at their end (a captured graph's rows), each layer's states read
        and moved on in place in their slots: a few kernels a layer where the packed layout's gathers and scatters
        take about twenty (docs/DECISIONS.md D67)."""
        qkv = text_ops.continued_conv(projection, self.channels, store.conv[self.index], rows.prompt_slots,
                                      rows.prompt_lengths, self.conv_weight)
        recurrent = store.recurrent[self.index]
        if rows.lengths[0] > STEPPED_DELTA_RULE_TOKENS:
            return self._delta_rule(projection, qkv, store, rows, recurrent.index_select(0, rows.prompt_slots), rows.real)
        attended = text_ops.continued_delta_steps(qkv, projection, self.beta_column, self.decay_column, self.a_log,
                                                  self.dt_bias, recurrent, rows.prompt_slots, rows.prompt_lengths,
                                                  self.key_heads)
        return self._out(attended, projection)

    def _delta_rule(self, projection, qkv, store, rows, initial_state=None, real=None):
        """The gated delta rule over a prefill's convolved queries, keys and values, each prompt from a zero
        state or from its row of `initial_state`, its final state written into its slot; rows where `real` is
        false (padding) go through without decay or update, leaving each state as it is."""
        tokens = projection.shape[0]
        query, key, value = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta, decay = text_ops.delta_gates(projection, self.beta_column, self.decay_column, self.value_heads,
                                           self.a_log, self.dt_bias)
        if real is not None:
            beta, decay = beta * real[:, None], decay * real[:, None]
        batch = (rows.sequences, tokens // rows.sequences)
        attended, states = text_ops.chunk_delta_rule(
            query.reshape(*batch, self.key_heads, -1), key.reshape(*batch, self.key_heads, -1),
            value.reshape(*batch, self.value_heads, -1), decay.view(*batch, -1), beta.view(*batch, -1), rows.bounds,
            rows.device_bounds, initial_state=initial_state)
        store.ensure_layer(store.recurrent, self.index, states, columns=False).index_copy_(0, rows.prompt_slots, states)
        return self._out(attended.reshape(tokens, -1), projection)

    def _out(self, attended, projection):
        gated = text_ops.gated_rms_norm(attended, projection, self.gate_column, self.norm_weight, self.norm_eps)
        return text_ops.linear(gated, self.out_weight)


class _AttentionLayer:
    def __init__(self, layer, rotary_embedding):
        attention = layer.self_attn
        self.index = attention.layer_idx
        self.heads = attention.config.num_attention_heads
        self.kv_heads = attention.config.num_key_value_heads
        self.head_dim = attention.head_dim
        self.scaling = attention.scaling
        self.in_weight = merge_parameters(attention.q_proj, attention.k_proj, attention.v_proj)
        self.q_norm = _norm_weight(attention.q_norm)
        self.k_norm = _norm_weight(attention.k_norm)
        self.eps = attention.q_norm.eps
        self.inv_freq = rotary_embedding.inv_freq.float()
        self.rope_scaling = float(rotary_embedding.attention_scaling)
        self.out_weight = attention.o_proj.weight

    def _inputs(self, hidden, rows: Rows, keys, values):
        """(the merged projection, the queries); the rows' keys and values are written into the store."""
        projection = text_ops.linear(hidden, self.in_weight)
        query = text_ops.attention_inputs(projection, self.heads, self.kv_heads, self.head_dim, self.q_norm,
                                          self.k_norm, self.eps, self.inv_freq, self.rope_scaling, rows.rope_positions,
                                          rows.slots, rows.columns, keys, values)
        return projection, query

    def decode(self, hidden, store, rows: Rows):
        keys, values = store.keys[self.index], store.values[self.index]
        projection, query = self._inputs(hidden, rows, keys, values)
        attended = text_ops.attend(query, keys, values, rows.columns, self.scaling, projection)
        return text_ops.linear(attended, self.out_weight)

    def prefill(self, hidden, store, rows: Rows):
        like = hidden.new_empty((1, self.kv_heads, 0, self.head_dim))
        keys = store.ensure_layer(store.keys, self.index, like, columns=True)
        values = store.ensure_layer(store.values, self.index, like, columns=True)
        return self._prefill(hidden, rows, keys, values)

    def prefill_continued(self, hidden, store, rows: ContinuedRows):
        """prefill for prompts that go on from their slots: each new token attends over its slot's columns
        up to its own, the kept ones first."""
        return self._prefill(hidden, rows, store.keys[self.index], store.values[self.index], continued=True)

    def _prefill(self, hidden, rows, keys, values, continued=False):
        projection, query = self._inputs(hidden, rows, keys, values)
        heads = (self.heads, self.kv_heads, self.head_dim, self.scaling)
        if rows.sees is None:
            attended = prefill_attention.packed(query, keys, values, rows.attention, *heads)
        elif continued:
            attended = prefill_attention.continued(query, keys, values, rows, *heads)
        else:
            attended = prefill_attention.padded(query, keys, values, rows, *heads)
        return text_ops.linear(text_ops.output_gated(attended, projection, self.heads, self.head_dim), self.out_weight)


class _MLP:
    def __init__(self, mlp):
        self.gate_up_weight = merge_parameters(mlp.gate_proj, mlp.up_proj)
        self.down_weight = mlp.down_proj.weight

    def __call__(self, hidden):
        return text_ops.linear(text_ops.silu_and_mul(text_ops.linear(hidden, self.gate_up_weight)), self.down_weight)


class FusedTextModel:
    """The text model over the slot store, with the same contracts as BatchRunner's paths through
    transformers' layers:

    - decode(tokens, positions): next-token logits for slots [0, n), each fed one token at its column
      `positions[i]`;
    - prefill(embeddings, lengths, first_slot): prompts' input embeddings packed back to back (no
      padding), each from a fresh state into slot first_slot + i; each prompt's next-token logits;
      prefill_padded the same for prompts front-padded to one length.
    """

    def __init__(self, model, store):
        text = model.model.language_model
        self.store = store
        self.embed = text.embed_tokens
        self.vocab = model.lm_head.weight.shape[0]
        # Padded on a GPU only: the CPU's products gain nothing from it.
        multiple = OUTPUT_ROWS_MULTIPLE if model.lm_head.weight.is_cuda else 1
        self.output_weight = padded_output_weight(model.lm_head, multiple)
        self.eps = text.config.rms_norm_eps
        self.layers = []
        for layer in text.layers:
            mixer = _DeltaNetLayer(layer) if hasattr(layer, "linear_attn") else _AttentionLayer(layer, text.rotary_emb)
            self.layers.append((_norm_weight(layer.input_layernorm), mixer, _norm_weight(layer.post_attention_layernorm),
                                _MLP(layer.mlp)))
        self.final_norm = _norm_weight(text.norm)
        self.conv_width = text.config.linear_conv_kernel_dim

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[0]
        rows = Rows(torch.arange(n, device=positions.device), positions, positions + self.store.rope_deltas[:n])
        hidden, residual = self._layers(self.embed(tokens), rows, "decode")
        return self._logits(hidden, residual)

    def prefill(self, embeddings: torch.Tensor, lengths: list[int], first_slot: int) -> torch.Tensor:
        return self._prefill(embeddings, Rows.packed(lengths, first_slot, self.conv_width, embeddings.device))

    def prefill_padded(self, embeddings: torch.Tensor, pads: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """prefill for prompts front-padded to one length: embeddings [prompts * length, hidden], prompt
        i's `pads[i]` zero rows then its tokens, into slot `slots[i]` (both on the device, so that no
        host value depends on the prompts: this is what app.model.runner captures)."""
        length = embeddings.shape[0] // pads.shape[0]
        return self._prefill(embeddings, Rows.padded(pads, slots, length, self.conv_width))

    def prefill_continued(self, embeddings: torch.Tensor, lengths: list[int], starts: list[int],
                          slots: list[int]) -> torch.Tensor:
        """prefill for prompts that go on from what slots[i] holds (`starts[i]` tokens, a conversation's
        earlier turns): their new tokens' embeddings packed back to back."""
        rows = ContinuedRows.packed(lengths, starts, slots, self.conv_width, embeddings.device)
        return self._prefill(embeddings, rows, "prefill_continued")

    def prefill_continued_padded(self, embeddings: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor,
                                 slots: torch.Tensor, columns: int) -> torch.Tensor:
        """prefill_continued for prompts padded at their end to one length: embeddings [prompts * length,
        hidden], no row reaching past each slot's first `columns` columns; lengths, starts and slots on the
        device (what app.model.continued_graphs captures)."""
        length = embeddings.shape[0] // lengths.shape[0]
        rows = ContinuedRows.padded(lengths, starts, slots, length, columns)
        return self._prefill(embeddings, rows, "prefill_continued")

    def _prefill(self, embeddings: torch.Tensor, rows, step: str = "prefill") -> torch.Tensor:
        hidden, residual = self._layers(embeddings, rows, step)
        return self._logits(hidden[rows.last_rows], residual[rows.last_rows])

    def _layers(self, hidden, rows, step: str):
        """Every layer's `step` ("decode", "prefill" or "prefill_continued") over `rows`."""
        residual = None
        for input_norm, mixer, post_norm, mlp in self.layers:
            normed, residual = text_ops.add_rms_norm(hidden, residual, input_norm, self.eps)
            hidden = getattr(mixer, step)(normed, self.store, rows)
            normed, residual = text_ops.add_rms_norm(hidden, residual, post_norm, self.eps)
            hidden = mlp(normed)
        return hidden, residual

    def _logits(self, hidden, residual):
        normed, _ = text_ops.add_rms_norm(hidden, residual, self.final_norm, self.eps)
        return text_ops.linear(normed, self.output_weight)[:, :self.vocab]
