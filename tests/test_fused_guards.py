"""The fused text model and vision tower are chosen only for models that compute what they assume: each
field or module they assume rather than read, changed alone, sends the model through transformers'
layers, with the reason logged; the real 4.6 shape and the tiny 4.6 and 4.7 models take the fused path.
(What they read, varied, gives transformers' results: tests/test_fused_text.py, VARIED_CONFIG.)

Models are built on the meta device: the checks read configs and modules, never weights."""

import json
import logging
import os

import pytest
import torch
import transformers

from app.model.checkpoint.random_checkpoint import TINY_CONFIG, TINY_CONFIG_4_7
from app.model.text.fused import FusedTextModel, fused_text_model_for
from app.model.vision.fused import FusedVisionTower, fused_vision_tower_for
from tests.conftest import ROOT

with open(os.path.join(ROOT, "benchmarks", "minicpm-v-4.6.config.json")) as _file:
    REAL_CONFIG = json.load(_file)


def meta_model(config: dict, text: dict | None = None, vision: dict | None = None):
    """`config` (a config.json's contents) with `text` / `vision` changes to its parts, on the meta device."""
    version = "4_7" if config.get("model_type") == "minicpmv4_7" else "4_6"
    settings = {key: value for key, value in config.items()
                if key not in ("architectures", "model_type", "transformers_version")}
    settings.update(text_config={**config["text_config"], **(text or {})},
                    vision_config={**config["vision_config"], **(vision or {})})
    model_config = getattr(transformers, f"MiniCPMV{version}Config")(**settings)
    with torch.device("meta"):
        return getattr(transformers, f"MiniCPMV{version}ForConditionalGeneration")._from_config(model_config)


@pytest.mark.parametrize("config", [REAL_CONFIG, TINY_CONFIG, TINY_CONFIG_4_7], ids=["4.6 real shape", "4.6 tiny", "4.7 tiny"])
def test_the_models_served_take_the_fused_paths(config):
    model = meta_model(config)
    assert isinstance(fused_text_model_for(model, None), FusedTextModel)
    assert isinstance(fused_vision_tower_for(model), FusedVisionTower)


def refused_for(caplog, reason: str) -> bool:
    return f"not the fused one: {reason}" in caplog.text


# change -> the reason logged
TEXT_CHANGES = {
    "hidden_act": ({"hidden_act": "gelu"}, "hidden_act gelu"),
    "rope type": ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10_000_000,
                                       "partial_rotary_factor": 0.25}}, "rope type linear"),
    "no output gate": ({"attn_output_gate": False}, "attn_output_gate false"),
    "attention bias": ({"attention_bias": True}, "attention biases"),
    "head dim": ({"head_dim": 48}, "head_dim 48"),
    "rotary wider than a head": ({"rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000,
                                                      "partial_rotary_factor": 2.0}}, "rotary dimensions wider"),
}


@pytest.mark.parametrize("change, reason", TEXT_CHANGES.values(), ids=TEXT_CHANGES.keys())
def test_a_text_config_the_fused_model_does_not_compute_is_refused(change, reason, caplog):
    caplog.set_level(logging.INFO, logger="app.model")
    assert fused_text_model_for(meta_model(TINY_CONFIG, text=change), None) is None
    assert refused_for(caplog, reason)


def _plain_rms_norm(text):
    text.layers[0].input_layernorm = torch.nn.RMSNorm(text.config.hidden_size, eps=text.config.rms_norm_eps)


def _other_eps(text):
    text.layers[1].self_attn.k_norm.eps = 1e-3


def _ungated_q_proj(text):
    attention = text.layers[1].self_attn
    attention.q_proj = torch.nn.Linear(text.config.hidden_size, text.config.num_attention_heads * attention.head_dim,
                                       bias=False)


def _conv_bias(text):
    text.layers[0].linear_attn.conv1d.bias = torch.nn.Parameter(torch.zeros(text.layers[0].linear_attn.conv_dim))


def _gate_activation(text):
    text.layers[0].linear_attn.norm.activation = "sigmoid"


TEXT_MODULES = {"plain RMSNorm": (_plain_rms_norm, "a norm other than Qwen3.5's zero-centred RMSNorm"),
                "another eps": (_other_eps, "a norm other than Qwen3.5's zero-centred RMSNorm (1 + w) at rms_norm_eps"),
                "q_proj without gate": (_ungated_q_proj, "a q_proj other than a query and its output gate"),
                "conv bias": (_conv_bias, "a DeltaNet convolution with a bias"),
                "gated norm activation": (_gate_activation, "a DeltaNet output norm other than")}


@pytest.mark.parametrize("change, reason", TEXT_MODULES.values(), ids=TEXT_MODULES.keys())
def test_text_modules_the_fused_model_does_not_compute_are_refused(change, reason, caplog):
    caplog.set_level(logging.INFO, logger="app.model")
    model = meta_model(TINY_CONFIG)
    with torch.device("meta"):
        change(model.model.language_model)
    assert fused_text_model_for(model, None) is None
    assert refused_for(caplog, reason)


def _no_layer_norm_bias(tower):
    tower.encoder.layers[0].layer_norm2.bias = None


def _rms_norm(tower):
    tower.post_layernorm = torch.nn.RMSNorm(tower.config.hidden_size)


def _overlapping_patches(tower):
    tower.embeddings.patch_embedding = torch.nn.Conv2d(3, tower.config.hidden_size, 14, stride=7)


def _no_window_merger(tower):
    tower.vit_merger = None


VISION_CHANGES = {"hidden_act": ({"hidden_act": "gelu"}, "hidden_act gelu"),
                  "window not square": ({"window_kernel_size": [2, 1]}, "window kernel (2, 1)"),
                  "layer norm without bias": (_no_layer_norm_bias, "a norm other than a layer norm"),
                  "RMS norm": (_rms_norm, "a norm other than a layer norm"),
                  "overlapping patches": (_overlapping_patches, "a patch embedding other than"),
                  "no window merger": (_no_window_merger, "no window merger")}


@pytest.mark.parametrize("change, reason", VISION_CHANGES.values(), ids=VISION_CHANGES.keys())
def test_a_vision_tower_the_fused_one_does_not_compute_is_refused(change, reason, caplog):
    caplog.set_level(logging.INFO, logger="app.model")
    if isinstance(change, dict):
        model = meta_model(TINY_CONFIG, vision=change)
    else:
        model = meta_model(TINY_CONFIG)
        with torch.device("meta"):
            change(model.model.vision_tower)
    assert fused_vision_tower_for(model) is None
    assert refused_for(caplog, reason)
