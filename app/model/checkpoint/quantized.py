"""int4 checkpoints: what transformers needs to load them, and a clear word when a package is missing.

GPTQ (and AWQ) checkpoints load through GPT-QModel + optimum (requirements-quant.txt). GPT-QModel's own
exports say how weights were quantized but not which linear layers were: it leaves small ones, such as
the DeltaNet gates `in_proj_a` / `in_proj_b`, in 16 bits. Told nothing, transformers converts every
linear layer (of each block for GPTQ, everywhere for AWQ) and fails on those. The quantized layers are
the ones whose weights come as `qweight`, so they are read from the checkpoint's tensor names. An AWQ
checkpoint's own `modules_to_not_convert` (OpenBMB's is not known) is completed with its 16-bit layers.

bitsandbytes checkpoints (OpenBMB's BNB build) need CUDA and bitsandbytes. A 16-bit checkpoint can also
be quantized while it loads (--load-in-4bit, bitsandbytes NF4 on CUDA).
"""

import glob
import importlib.util
import os
import re

from app.messages import (
    MSG_4BIT_ALREADY_QUANTIZED,
    MSG_4BIT_NEEDS_BITSANDBYTES,
    MSG_4BIT_NEEDS_CUDA,
    MSG_BNB_NEEDS_BITSANDBYTES,
    MSG_BNB_NEEDS_CUDA,
    MSG_QUANT_PACKAGES_MISSING,
)
from app.errors import UserError

_BLOCK_LAYER = re.compile(r"^(.*\.layers)\.\d+\.(.+)$")
# quant_method -> Python packages it needs
_NEEDS = {"gptq": ("gptqmodel", "optimum"), "awq": ("gptqmodel",)}
# Left in 16 bits by --load-in-4bit: the vision side (run once per request, not per token), the output
# layer (tied to the embeddings) and the DeltaNet gates (16 rows: nothing to save, precision to lose).
_KEEP_16_BIT = ["model.vision_tower", "model.merger", "lm_head", "in_proj_a", "in_proj_b"]


def complete_quantization_config(path: str, config, device: str, dtype) -> None:
    """Check what a quantized checkpoint needs, and fill in what its export leaves out."""
    settings = getattr(config, "quantization_config", None)
    if settings is None:
        return
    settings = settings if isinstance(settings, dict) else settings.to_dict()
    method = settings.get("quant_method")
    if method == "bitsandbytes":
        config.quantization_config = _bitsandbytes_settings(settings, device, dtype)
        return
    missing = [package for package in _NEEDS.get(method, ()) if importlib.util.find_spec(package) is None]
    if missing:
        raise UserError(MSG_QUANT_PACKAGES_MISSING.format(method=method, packages=", ".join(missing)))
    quantized, plain = _weight_modules(path)
    if not quantized:
        return  # not a layout we can read: transformers gets the config as it is
    if method == "gptq" and not settings.get("modules_in_block_to_quantize"):
        matches = [match for match in map(_BLOCK_LAYER.match, quantized) if match]
        blocks = {match.group(1) for match in matches}
        if len(blocks) == 1:
            modules = {match.group(2) for match in matches}
            config.quantization_config = {**settings, "block_name_to_quantize": blocks.pop(),
                                          "modules_in_block_to_quantize": [sorted(modules)]}
    elif method == "awq":
        # Whatever the checkpoint lists (an AutoAWQ export may name the vision side only, as substrings
        # transformers does not match), its 16-bit layers must stay unconverted too.
        listed = settings.get("modules_to_not_convert") or []
        config.quantization_config = {**settings, "modules_to_not_convert": sorted(plain.union(listed))}


def _bitsandbytes_settings(settings: dict, device: str, dtype) -> dict:
    """A checkpoint bitsandbytes quantized (OpenBMB's BNB build) loads on CUDA, computing in the app's dtype."""
    if not str(device).startswith("cuda"):
        raise UserError(MSG_BNB_NEEDS_CUDA)
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError(MSG_BNB_NEEDS_BITSANDBYTES)
    import torch

    # OpenBMB's build says float16, while the rest of the model runs in the app's dtype (bf16 on CUDA):
    # every 4-bit layer would cast its input to fp16 and back, and a bf16 activation past fp16's range
    # would overflow. Cards without bf16 keep the checkpoint's float16.
    if torch.cuda.is_bf16_supported():
        settings = {**settings, "bnb_4bit_compute_dtype": str(dtype).removeprefix("torch.")}
    return settings


def _weight_modules(path: str) -> tuple[set[str], set[str]]:
    """Names of the modules stored quantized (`qweight`) and of those stored plain (`weight`)."""
    from safetensors import safe_open

    quantized, plain = set(), set()
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        with safe_open(file, framework="pt") as tensors:
            for name in tensors.keys():
                module, _, kind = name.rpartition(".")
                if kind == "qweight":
                    quantized.add(module)
                elif kind == "weight":
                    plain.add(module)
    return quantized, plain - quantized


def load_in_4bit_config(model: str, config, device: str, dtype):
    """A bitsandbytes NF4 config quantizing the language model of a 16-bit checkpoint while it loads."""
    settings = getattr(config, "quantization_config", None)
    if settings is not None:
        method = settings.get("quant_method") if isinstance(settings, dict) else settings.quant_method
        raise UserError(MSG_4BIT_ALREADY_QUANTIZED.format(model=model, method=getattr(method, "value", method)))
    if not str(device).startswith("cuda"):
        raise UserError(MSG_4BIT_NEEDS_CUDA)
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UserError(MSG_4BIT_NEEDS_BITSANDBYTES)
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                              llm_int8_skip_modules=_KEEP_16_BIT)
