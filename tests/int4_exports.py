"""Tiny checkpoints laid out as OpenBMB's own 4-bit builds of MiniCPM-V 4.6 are (their published recipes:
an AutoGPTQ fork, an AutoAWQ fork, bitsandbytes NF4), made offline from an unquantized checkpoint.

The GPTQ and AWQ weights are quantized here by round to nearest, group by group, and packed the way
those tools store them; calibration would change the values, not the layout the loader reads:
- AutoGPTQ (`checkpoint_format: gptq`): `qweight` int32 [in / 8, out], eight 4-bit values of consecutive
  inputs per word, lowest bits first; `qzeros` int32 [groups, out / 8], the zero point minus one, packed
  along the outputs; `scales` fp16 [groups, out]; `g_idx` int32 [in], each input's group.
- AutoAWQ GEMM: `qweight` int32 [in, out / 8] and `qzeros` int32 [groups, out / 8], packed along the
  outputs in the order 0, 2, 4, 6, 1, 3, 5, 7; `scales` fp16 [groups, out].
Both tools load a model in float16 to quantize it, so every other tensor is saved in float16.

The bitsandbytes build's tensors are bitsandbytes' own serialization, which needs its CUDA kernels: on
the CPU only its config is written (`bnb_config_export`); the GPU test has bitsandbytes quantize.
"""

import json
import os
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.model.checkpoint.random_checkpoint import TINY_CONFIG, TINY_TEXT_CONFIG  # noqa: E402

# Every input width a multiple of the recipes' 128-wide groups (the tiny model's is 64).
RECIPE_CONFIG = {**TINY_CONFIG, "text_config": {**TINY_TEXT_CONFIG, "hidden_size": 128, "intermediate_size": 256,
                                                "linear_value_head_dim": 64}}
GROUP = 128
# OpenBMB's GPTQ list, in AutoGPTQ's form (the layers of one step of its sequential quantization together);
# the DeltaNet gates in_proj_a / in_proj_b are not in it.
MODULES_IN_BLOCK = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
                    ["linear_attn.in_proj_qkv", "linear_attn.in_proj_z"], ["linear_attn.out_proj"],
                    ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _quantized(name: str) -> bool:
    module = name.removesuffix(".weight")
    return name.endswith(".weight") and ".language_model.layers." in name and \
        any(module.endswith(part) for step in MODULES_IN_BLOCK for part in step)


def _pack(values: torch.Tensor, order=range(8)) -> torch.Tensor:
    """[..., 8 n] integers 0-15 to int32 [..., n]: 4-bit field j of a word holds element order[j] of its eight."""
    eight = values.to(torch.int64).reshape(*values.shape[:-1], -1, 8)
    words = sum(eight[..., index] << (4 * field) for field, index in enumerate(order))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def _groups(weight: torch.Tensor) -> torch.Tensor:
    return weight.float().view(weight.shape[0], -1, GROUP)  # [out, groups, GROUP]


def gptq_tensors(weight: torch.Tensor) -> dict:
    """AutoGPTQ's symmetric 4-bit layout: the zero point is 8 and a group's largest |w| maps to 7.5 steps."""
    groups = _groups(weight)
    scale = (groups.abs().amax(-1) * 2 / 15).clamp(min=1e-8)  # [out, groups]
    levels = (torch.round(groups / scale[..., None]) + 8).clamp(0, 15).view(weight.shape)  # [out, in]
    zeros = torch.full_like(scale.t(), 8 - 1)  # stored minus one
    return {"qweight": _pack(levels).t().contiguous(), "qzeros": _pack(zeros),
            "scales": scale.t().contiguous().half(),
            "g_idx": torch.arange(weight.shape[1], dtype=torch.int32) // GROUP}


def awq_tensors(weight: torch.Tensor) -> dict:
    """AutoAWQ's 4-bit layout with a zero point: each group's range spread over the 16 levels."""
    groups = _groups(weight)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low).clamp(min=1e-5) / 15)
    zero = torch.round(-low / scale).clamp(0, 15)
    levels = (torch.round(groups / scale[..., None]) + zero[..., None]).clamp(0, 15).view(weight.shape)
    return {"qweight": _pack(levels.t(), _AWQ_ORDER), "qzeros": _pack(zero.t(), _AWQ_ORDER),
            "scales": scale.t().contiguous().half()}


def _export(source: str, out: str, quantize, quantization_config: dict) -> str:
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {}
    for file in sorted(f for f in os.listdir(source) if f.endswith(".safetensors")):
        for name, tensor in load_file(os.path.join(source, file)).items():
            if _quantized(name):
                module = name.removesuffix(".weight")
                tensors.update({f"{module}.{kind}": part for kind, part in quantize(tensor).items()})
            else:
                tensors[name] = tensor.half() if tensor.is_floating_point() else tensor
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as file:
        config = json.load(file)
    config.update(dtype="float16", quantization_config=quantization_config)
    with open(os.path.join(out, "config.json"), "w") as file:
        json.dump(config, file, indent=2)
    return out


def autogptq_export(source: str, out: str) -> str:
    """`source` as OpenBMB's GPTQ build: 4 bits, group 128, symmetric, no act-order, the list above."""
    return _export(source, out, gptq_tensors, {
        "quant_method": "gptq", "checkpoint_format": "gptq", "bits": 4, "group_size": GROUP, "sym": True,
        "desc_act": False, "static_groups": False, "true_sequential": True, "damp_percent": 0.01,
        "modules_in_block_to_quantize": MODULES_IN_BLOCK})


def autoawq_export(source: str, out: str, modules_to_not_convert: list[str] | None) -> str:
    """`source` as OpenBMB's AWQ build: GEMM, zero point, group 128, 4 bits. Its `modules_to_not_convert`
    is not known: the caller picks one."""
    return _export(source, out, awq_tensors, {
        "quant_method": "awq", "version": "gemm", "zero_point": True, "bits": 4, "group_size": GROUP,
        "modules_to_not_convert": modules_to_not_convert})


# What transformers writes for OpenBMB's bitsandbytes recipe (BitsAndBytesConfig.to_dict, transformers 5.23).
BNB_RECIPE = {
    "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False, "_load_in_4bit": True,
    "_load_in_8bit": False, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
    "bnb_4bit_compute_dtype": "float16", "bnb_4bit_quant_storage": "uint8", "llm_int8_skip_modules": ["lm_head"],
    "llm_int8_threshold": 6.0, "llm_int8_has_fp16_weight": False, "llm_int8_enable_fp32_cpu_offload": False,
}


def bnb_config_export(source: str, out: str) -> str:
    """`source` with the bitsandbytes recipe's config (its own tensors: nothing on the CPU reads them)."""
    shutil.copytree(source, out)
    with open(os.path.join(out, "config.json")) as file:
        config = json.load(file)
    config["quantization_config"] = BNB_RECIPE
    with open(os.path.join(out, "config.json"), "w") as file:
        json.dump(config, file, indent=2)
    return out


def check(source: str, exports: list[str]) -> None:
    """Each export loaded as the app loads it: its quantized layers (GPT-QModel's) must compute what the
    unquantized source's layers do, to int4's error; a 4-bit field read from the wrong place makes it O(1).
    Run in a process of its own (GPT-QModel patches libraries when it loads)."""
    from app.model.checkpoint.loader import ModelSource, load_model_and_processor

    weights = load_file(os.path.join(source, "model.safetensors"))
    torch.manual_seed(0)
    checked, worst = 0, 0.0
    for folder in exports:
        model, _ = load_model_and_processor(ModelSource(name=folder, path=folder), "cpu", torch.float32, "sdpa")
        for name, module in model.named_modules():
            if hasattr(module, "qweight"):
                inputs = torch.randn(4, module.in_features)
                with torch.no_grad():
                    expected = inputs @ weights[f"{name}.weight"].float().t()
                    worst = max(worst, float((module(inputs) - expected).norm() / expected.norm()))
                checked += 1
    assert worst < 0.3, f"a quantized layer is {worst:.2f} away from its unquantized weights"
    print(f"checked {checked} layers, worst relative error {worst:.3f}")


if __name__ == "__main__":
    check(sys.argv[1], sys.argv[2:])
