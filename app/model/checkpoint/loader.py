"""Resolving --model to a local checkpoint folder and loading model and processor from it.

Every checkpoint, the tiny random one included, goes through the same `from_pretrained` calls.
"""

import json
import logging
import os
import socket
from dataclasses import dataclass
from urllib.parse import urlparse

from app.messages import MSG_MODEL_TYPE_NOT_SERVED, MSG_MODEL_UNAVAILABLE, MSG_TRANSFORMERS_TOO_OLD
from app.config import TINY_RANDOM
from app.engine.processor import load_processor
from app.model.checkpoint.presets import FIRST_TRANSFORMERS, SERVED_MODEL_TYPES, UNSERVED_MODEL_TYPES
from app.model.checkpoint.quantized import complete_quantization_config, load_in_4bit_config
from app.errors import ModelUnavailable, UserError

log = logging.getLogger(__name__)

# What a checkpoint needs to load; skips extra formats (GGUF, ONNX) that some repos also carry.
_CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken", "*.py"]


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for
    path: str  # local folder that from_pretrained reads
    random_weights: bool = False


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = urlparse(endpoint).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def resolve_model(name: str) -> ModelSource:
    if name == TINY_RANDOM:
        from app.model.checkpoint.random_checkpoint import ensure_tiny_checkpoint

        return ModelSource(name=name, path=ensure_tiny_checkpoint(), random_weights=True)
    if os.path.isdir(name):
        return ModelSource(name=name, path=name)

    from huggingface_hub import snapshot_download

    try:
        return ModelSource(name=name, path=snapshot_download(name, allow_patterns=_CHECKPOINT_FILES, local_files_only=True))
    except Exception:  # not (completely) in the local cache: fetch it below
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    # Without this check huggingface_hub retries for about half a minute before failing.
    if offline or not _hub_reachable():
        reason = "HF_HUB_OFFLINE is set" if offline else "the Hub is unreachable"
        raise ModelUnavailable(MSG_MODEL_UNAVAILABLE.format(model=name, reason=reason))
    log.info("Downloading %s from the Hugging Face Hub", name)
    try:
        path = snapshot_download(name, allow_patterns=_CHECKPOINT_FILES)
    except Exception as error:
        raise ModelUnavailable(MSG_MODEL_UNAVAILABLE.format(model=name, reason=str(error).splitlines()[0])) from error
    return ModelSource(name=name, path=path)


def pick_device(requested: str) -> str:
    import torch

    if requested != "auto":
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_dtype(requested: str, device: str):
    import torch

    if requested == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, requested)


def _declared_model_type(path: str) -> str:
    try:
        with open(os.path.join(path, "config.json")) as file:
            return json.load(file).get("model_type", "unknown")
    except (OSError, ValueError):
        return "unknown"


def _not_served(model_type: str) -> ModelUnavailable:
    reason = UNSERVED_MODEL_TYPES.get(model_type, "the engine knows the MiniCPM-V 4.6 and 4.7 layouts only")
    return ModelUnavailable(MSG_MODEL_TYPE_NOT_SERVED.format(model_type=model_type, reason=reason))


def load_model_and_processor(source: ModelSource, device: str, dtype, attn_implementation: str,
                              trust_remote_code: bool = False, load_in_4bit: bool = False):
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    try:
        config = AutoConfig.from_pretrained(source.path, trust_remote_code=trust_remote_code)
    except (KeyError, ValueError) as error:
        import transformers

        model_type = _declared_model_type(source.path)
        if model_type in UNSERVED_MODEL_TYPES:  # no transformers upgrade helps: say where it runs instead
            raise _not_served(model_type) from error
        needed = f"; it needs transformers >= {FIRST_TRANSFORMERS[model_type]}" if model_type in FIRST_TRANSFORMERS else ""
        log.info("AutoConfig could not read %s: %s", source.path, error)
        raise ModelUnavailable(MSG_TRANSFORMERS_TOO_OLD.format(
            installed=transformers.__version__, model=source.name, model_type=model_type, needed=needed)) from error
    if config.model_type not in SERVED_MODEL_TYPES:
        raise _not_served(config.model_type)
    quantization = None
    try:
        complete_quantization_config(source.path, config, device, dtype)
        if load_in_4bit:
            quantization = load_in_4bit_config(source.name, config, device, dtype)
    except UserError as error:
        raise ModelUnavailable(str(error)) from error
    processor = load_processor(source.path, trust_remote_code)
    model = AutoModelForImageTextToText.from_pretrained(
        source.path, dtype=dtype, attn_implementation=attn_implementation, device_map=device,
        trust_remote_code=trust_remote_code, config=config, quantization_config=quantization,
    )
    model.eval()
    if str(device).startswith("cuda"):
        # cuDNN's attention builds a graph for every new sequence length it meets (per thread): on an H200
        # replies whose length was new decoded at 72-94 ms/token with it, 32-45 without (docs/DECISIONS.md D23).
        torch.backends.cuda.enable_cudnn_sdp(False)
    return model, processor
