"""Each Triton kernel of the fused text model and the fused vision tower against its PyTorch version in
app.model.text.ops and app.model.vision.ops, on the CPU. Run by tests/test_fused_text.py with
TRITON_INTERPRET=1 (Triton's interpreter), which must be set before Triton is imported; on a GPU
machine it also runs as is on CUDA tensors."""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.model.text import kernels as text_kernels
from app.model.text import ops as text_ops
from app.model.text import prefill_attention, prefill_kernels
from app.model.text.rows import ContinuedRows
from app.model.vision import kernels as vision_kernels
from app.model.vision import ops as vision_ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"


def close(ours, reference, name, atol=1e-5):
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=atol, msg=lambda message: f"{name}: {message}")


def random(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def main() -> None:
    torch.manual_seed(0)
    n = 3
    checked = []
    # Widths off the block sizes, so that masks matter.
    x, residual, weight = random(n, 48), random(n, 48), 1 + random(48)
    for given in (None, residual):
        ours = text_kernels.add_rms_norm(x, given, weight, 1e-6)
        reference = text_ops.add_rms_norm(x, given, weight, 1e-6)
        close(ours[0], reference[0], "add_rms_norm")
        close(ours[1], reference[1], "add_rms_norm residual")
    checked.append("add_rms_norm")

    channels = 300
    projection = random(n, channels + 40)  # wider than the convolved channels, as the merged projection is
    for width in (3, 4):  # the window's tile is a power of two wide
        memory, conv_weight = random(n * channels * width + 8), random(channels, width)
        state = memory[:-8].view(n, channels, width)  # what lies past it must stay as it is
        reference_memory = memory.clone()
        close(text_kernels.conv_step(projection, channels, state, conv_weight),
              text_ops.conv_step(projection, channels, reference_memory[:-8].view(n, channels, width), conv_weight),
              f"conv_step {width}")
        close(memory, reference_memory, f"conv_step state {width}")
    checked.append("conv_step")

    # Prompts packed back to back, one shorter than the window.
    lengths = [5, 2, 40]
    projection = random(sum(lengths), channels + 40)
    positions = torch.cat([torch.arange(length) for length in lengths]).to(DEVICE)
    close(text_kernels.packed_conv(projection, channels, conv_weight, positions),
          text_ops.packed_conv(projection, channels, conv_weight, positions), "packed_conv")
    checked.append("packed_conv")

    key_heads, value_heads, k_dim, v_dim = 2, 4, 32, 24  # grouped values, a value width off the block
    qkv = random(n, 2 * key_heads * k_dim + value_heads * v_dim)
    projection = random(n, 20)
    a_log, dt_bias = random(value_heads), random(value_heads)
    projection[0, 12] = 30.0  # a decay input past softplus' threshold
    columns = torch.tensor([5, 0, 1], device=DEVICE)  # the second row a captured step's padding
    for layout in {text_kernels.delta_step_layout(1), text_kernels.delta_step_layout(256)}:  # few rows, many
        state = random(n, value_heads, k_dim, v_dim)
        given_state, reference_state = state.clone(), state.clone()
        close(text_kernels.gated_delta_step(qkv, projection, 4, 12, a_log, dt_bias, state, key_heads, columns, layout),
              text_ops.gated_delta_step(qkv, projection, 4, 12, a_log, dt_bias, reference_state, key_heads, columns),
              f"gated_delta_step {layout}")
        close(state, reference_state, f"gated_delta_step state {layout}")
        assert torch.equal(state[1], given_state[1]), "gated_delta_step wrote a padding row's state"
        assert not torch.equal(state[0], given_state[0]), "gated_delta_step left a row's state as it was"
    checked.append("gated_delta_step")

    attended, projection, norm_weight = random(n, 4 * 24), random(n, 130), random(24)
    close(text_kernels.gated_rms_norm(attended, projection, 30, norm_weight, 1e-6),
          text_ops.gated_rms_norm(attended, projection, 30, norm_weight, 1e-6), "gated_rms_norm")
    checked.append("gated_rms_norm")

    gate_up = random(n, 2 * 1100)  # more than one block per row
    close(text_kernels.silu_and_mul(gate_up), text_ops.silu_and_mul(gate_up), "silu_and_mul")
    checked.append("silu_and_mul")

    # One row, its outputs off the blocks, its inputs over two steps and off them.
    x, weight = random(1, 2300), random(41, 2300)
    close(text_kernels.linear(x, weight), F.linear(x, weight), "linear", atol=1e-4)
    x, weight = x.bfloat16(), weight.bfloat16()
    exact = F.linear(x.float(), weight.float())  # within a bf16 step of the largest output (2^-7 of it)
    close(text_kernels.linear(x, weight).float(), exact, "linear bf16", atol=exact.abs().max().item() / 128)
    checked.append("linear")

    heads, kv_heads, head_dim = 4, 2, 64
    projection = random(n, heads * 2 * head_dim + 2 * kv_heads * head_dim)
    q_norm, k_norm = 1 + random(head_dim), 1 + random(head_dim)
    slots, columns = torch.tensor([4, 0, 4], device=DEVICE), torch.tensor([0, 5, 11], device=DEVICE)
    rope_positions = torch.tensor([3, 1000, 70000], device=DEVICE)
    for rotary in (16, head_dim):  # partial (4.6) and whole-head (the tiny 4.7) rotary
        inv_freq = 1.0 / (100 ** (torch.arange(0, rotary, 2, device=DEVICE).float() / rotary))
        keys, values = random(5, kv_heads, 12, head_dim), random(5, kv_heads, 12, head_dim)
        reference_keys, reference_values = keys.clone(), values.clone()
        ours = text_kernels.attention_inputs(projection, heads, kv_heads, head_dim, q_norm, k_norm, 1e-6, inv_freq,
                                              1.0, rope_positions, slots, columns, keys, values)
        reference = text_ops.attention_inputs(projection, heads, kv_heads, head_dim, q_norm, k_norm, 1e-6, inv_freq,
                                                1.0, rope_positions, slots, columns, reference_keys, reference_values)
        close(ours, reference, "attention_inputs", atol=1e-4)  # cos and sin of large angles, in two libraries
        close(keys, reference_keys, "attention_inputs keys", atol=1e-4)
        close(values, reference_values, "attention_inputs values")
    checked.append("attention_inputs")

    # Sequences at the first column, mid-way and near the end of a capacity off the part sizes.
    capacity = 300
    keys, values = random(5, kv_heads, capacity, head_dim), random(5, kv_heads, capacity, head_dim)
    query = random(n, heads, head_dim)
    positions = torch.tensor([0, 77, 298], device=DEVICE)
    reference = text_ops.attend(query, keys, values, positions, 0.125, projection)
    # The default layout and others: parts that no sequence reaches, sequences that end within a step.
    for layout in (None, (4, 16, 4, 1), (32, 32, 2, 2)):
        # On a GPU, Triton's matrix products of fp32 run in TF32.
        close(text_kernels.attend(query, keys, values, positions, 0.125, projection, layout), reference,
              f"attend {layout}", atol=1e-5 if DEVICE == "cpu" else 1e-2)
    checked.append("attend")

    # A continued prefill's attention: prompts padded at their end to 40 places, going on after 0, 20, 100 and 260
    # of their slots' columns, one with 3 new tokens (whole blocks of it padding, which the kernel leaves at zero),
    # the last reaching the store's last column. What lies past each prompt's places is NaN, so that a read
    # there shows; so is the output at first, so that a place left unwritten shows.
    length = 40
    slots, starts, lengths = (torch.tensor(v, device=DEVICE) for v in ([4, 0, 2, 1], [0, 20, 100, 260], [17, 3, 40, 40]))
    prompts = slots.shape[0]
    for heads in (4, 6):  # 2 and 3 query heads a key head: 3 divides no block of rows
        query = random(prompts * length, heads, head_dim)
        rows = ContinuedRows.padded(lengths, starts, slots, length, capacity)
        reference = prefill_attention.padded(query, keys, values, rows, heads, kv_heads, head_dim, 0.125)
        held_keys, held_values = keys.clone(), values.clone()
        for slot, end in zip(slots.tolist(), (starts + length).tolist()):
            held_keys[slot, :, end:], held_values[slot, :, end:] = float("nan"), float("nan")
        # One block for a prompt's rows; several, the last part-filled; columns past the store's last step.
        for layout in (None, (16, 16, 4, 1), (32, 64, 4, 2)):
            ours = torch.full((prompts * length, heads * head_dim), float("nan"), device=DEVICE)
            prefill_kernels.continued_attention(query, held_keys, held_values, slots, starts, lengths, 0.125, layout, ours)
            close(ours[rows.real], reference[rows.real], f"continued_attention {heads} heads {layout}",
                  atol=1e-5 if DEVICE == "cpu" else 1e-2)
            assert torch.isfinite(ours).all(), "continued_attention left a padding place unwritten"
    checked.append("continued_attention")

    # A continued prefill's convolution and stepped delta rule, prompts padded at their end in slots of a larger
    # store, one with fewer new tokens than the window (its new state partly the kept one), one whole; at a length
    # within one block of places and at one over three (the convolution's loop), in fp32 and bf16. The other
    # slots' states must stay as they were.
    slots = torch.tensor([3, 0, 1], device=DEVICE)
    for length, real_lengths in ((6, [2, 6, 5]), (40, [1, 40, 23])):
        lengths, prompts = torch.tensor(real_lengths, device=DEVICE), 3
        real = (torch.arange(length, device=DEVICE) < lengths[:, None]).flatten()
        for width, dtype in ((3, torch.float32), (4, torch.float32), (4, torch.bfloat16)):
            projection, conv_weight = random(prompts * length, channels + 40, dtype=dtype), random(channels, width, dtype=dtype)
            state = random(5, channels, width, dtype=dtype)
            reference_state = state.clone().float()  # bf16 against fp32 arithmetic on the same values, rounded once
            ours = prefill_kernels.continued_conv(projection, channels, state, slots, lengths, conv_weight)
            reference = text_ops.continued_conv(projection.float(), channels, reference_state, slots, lengths,
                                                conv_weight.float()).to(dtype)
            torch.testing.assert_close(ours[real], reference[real], rtol=1e-4 if dtype == torch.float32 else 2 ** -7,
                                       atol=1e-5, msg=lambda message: f"continued_conv {length} {width} {dtype}: {message}")
            assert torch.equal(state, reference_state.to(dtype)), f"continued_conv state {length} {width} {dtype}"
    checked.append("continued_conv")

    # Head sizes off powers of two and off the value block, so that the masks matter; a decay input past softplus'
    # threshold on a real place.
    key_heads, value_heads, k_dim, v_dim = 2, 4, 24, 20
    lengths, length, prompts = torch.tensor([2, 6, 5], device=DEVICE), 6, 3
    real = (torch.arange(length, device=DEVICE) < lengths[:, None]).flatten()
    qkv = random(prompts * length, 2 * key_heads * k_dim + value_heads * v_dim)
    projection, a_log, dt_bias = random(prompts * length, 20), random(value_heads), random(value_heads)
    projection[6, 12] = 30.0
    state = random(5, value_heads, k_dim, v_dim)
    given_state, reference_state = state.clone(), state.clone()
    ours = prefill_kernels.continued_delta_steps(qkv, projection, 4, 12, a_log, dt_bias, state, slots, lengths, key_heads)
    reference = text_ops.continued_delta_steps(qkv, projection, 4, 12, a_log, dt_bias, reference_state, slots, lengths,
                                               key_heads)
    close(ours[real], reference[real], "continued_delta_steps")
    close(state, reference_state, "continued_delta_steps state")
    assert torch.equal(state[[2, 4]], given_state[[2, 4]]), "continued_delta_steps wrote another slot's state"
    checked.append("continued_delta_steps")

    # The vision tower's: a width off the block size; windows of four tokens, a head size off the block.
    x, residual, weight, bias = random(n, 40), random(n, 40), random(40), random(40)
    for given in (None, residual):
        ours = vision_kernels.add_layer_norm(x, given, weight, bias, 1e-6)
        reference = vision_ops.add_layer_norm(x, given, weight, bias, 1e-6)
        close(ours[0], reference[0], "add_layer_norm")
        close(ours[1], reference[1], "add_layer_norm residual")
    checked.append("add_layer_norm")

    heads, head_dim = 3, 24
    for windows in (5, 40):  # one block, part-filled; several blocks
        qkv = random(4 * windows, 3 * heads * head_dim)
        close(vision_kernels.window_attention(qkv, heads, 4, 0.2), vision_ops.window_attention(qkv, heads, 4, 0.2),
              "window_attention", atol=1e-5 if DEVICE == "cpu" else 1e-2)
    checked.append("window_attention")
    if DEVICE == "cuda":  # the GELU in cuBLASLt's epilogue is the tanh form the model asks for
        x, weight, bias = random(300, 64), random(200, 64), random(200)
        close(vision_ops.linear_gelu_tanh(x, weight, bias),
              F.gelu(F.linear(x, weight, bias), approximate="tanh"), "linear_gelu_tanh", atol=1e-2)
        x, weight, bias = x.bfloat16(), weight.bfloat16(), bias.bfloat16()
        close(vision_ops.linear_gelu_tanh(x, weight, bias).float(),
              F.gelu(F.linear(x, weight, bias).float(), approximate="tanh"), "linear_gelu_tanh bf16", atol=0.1)
    print(f"checked {len(checked)} kernels on {DEVICE}: {', '.join(checked)}")


if __name__ == "__main__":
    main()
