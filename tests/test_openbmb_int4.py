"""OpenBMB's own 4-bit builds of MiniCPM-V 4.6, as tiny checkpoints laid out the same way
(tests/int4_exports.py): the GPTQ and AWQ ones load and answer through `python app.py`; the bitsandbytes
one is checked on the CPU up to what the loader hands transformers, and loaded on a GPU."""

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from app.errors import ModelUnavailable, UserError
from app.model.checkpoint.loader import ModelSource, load_model_and_processor
from app.model.checkpoint.quantized import complete_quantization_config
from app.model.checkpoint.random_checkpoint import build_random_checkpoint, ensure_tiny_checkpoint
from tests.int4_exports import (BNB_RECIPE, MODULES_IN_BLOCK, RECIPE_CONFIG, autoawq_export, autogptq_export,
                                bnb_config_export)
from tests.conftest import ROOT
from tests.test_quantized import ask, header, serving

# The vision side, named as an AutoAWQ user would (substrings), not the DeltaNet gates: what the loader
# must complete, OpenBMB's own list being unknown.
VISION_ONLY = ["vision_tower", "merger"]


@pytest.fixture(scope="module")
def recipe_source(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("recipe") / "source")
    build_random_checkpoint(folder, RECIPE_CONFIG)
    return folder


@pytest.fixture(scope="module")
def exports(recipe_source, tmp_path_factory) -> dict[str, str]:
    work = tmp_path_factory.mktemp("openbmb")
    return {"gptq": autogptq_export(recipe_source, str(work / "gptq")),
            "awq": autoawq_export(recipe_source, str(work / "awq"), VISION_ONLY)}


@pytest.fixture(scope="module", params=["gptq", "awq"])
def openbmb_int4(request, exports) -> tuple[str, str]:
    return request.param, exports[request.param]


def tensor_names(folder: str) -> set[str]:
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as tensors:
        return set(tensors.keys())


def test_the_exports_follow_the_recipes(openbmb_int4):
    method, folder = openbmb_int4
    with open(os.path.join(folder, "config.json")) as file:
        settings = json.load(file)["quantization_config"]
    assert settings["quant_method"] == method and settings["bits"] == 4 and settings["group_size"] == 128
    if method == "gptq":
        assert settings["checkpoint_format"] == "gptq" and settings["sym"] and not settings["desc_act"]
        assert settings["modules_in_block_to_quantize"] == MODULES_IN_BLOCK
    else:
        assert settings["version"] == "gemm" and settings["zero_point"]
    names = tensor_names(folder)
    quantized = {"qweight", "qzeros", "scales"} | ({"g_idx"} if method == "gptq" else set())
    assert {f"model.language_model.layers.0.mlp.down_proj.{kind}" for kind in quantized} <= names
    assert "model.language_model.layers.1.self_attn.q_proj.qweight" in names
    for plain in ("model.language_model.layers.0.linear_attn.in_proj_a.weight",
                  "model.vision_tower.encoder.layers.0.mlp.fc1.weight", "model.merger.mlp.0.linear_1.weight"):
        assert plain in names and plain.replace(".weight", ".qweight") not in names


def test_the_kernels_read_the_exports_as_laid_out(recipe_source, exports):
    """The exports are what GPT-QModel's kernels read (tests/int4_exports.py check)."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "int4_exports.py"), recipe_source,
                           *exports.values()], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "checked 26 layers" in done.stdout  # 13 a checkpoint: every layer of MODULES_IN_BLOCK


@pytest.mark.parametrize("listed", [None, VISION_ONLY, ["in_proj_a"]], ids=["none", "vision only", "gates only"])
def test_awq_keeps_both_its_own_list_and_its_16_bit_layers(recipe_source, tmp_path, listed):
    folder = autoawq_export(recipe_source, str(tmp_path / "awq"), listed)
    with open(os.path.join(folder, "config.json")) as file:
        config = SimpleNamespace(quantization_config=json.load(file)["quantization_config"])
    complete_quantization_config(folder, config, "cpu", torch.float32)
    kept = set(config.quantization_config["modules_to_not_convert"])
    assert set(listed or []) <= kept
    assert {"model.language_model.layers.0.linear_attn.in_proj_b", "model.vision_tower.encoder.layers.0.mlp.fc1",
            "model.merger.mlp.0.linear_1"} <= kept
    assert "model.language_model.layers.0.mlp.down_proj" not in kept


@pytest.fixture(scope="module")
def openbmb_app(openbmb_int4, tmp_path_factory):
    method, folder = openbmb_int4
    with serving(folder, tmp_path_factory.mktemp(f"openbmb-{method}-app") / "app.log") as url:
        yield method, url


def test_openbmb_int4_loads_and_streams_an_answer(openbmb_app, red_image):
    method, url = openbmb_app
    ask(url, red_image)
    assert f"{method} 4-bit weights" in header(url)


@pytest.fixture(scope="module")
def bnb_recipe(tmp_path_factory) -> str:
    """The bitsandbytes recipe's config over the tiny model's unquantized tensors: the CPU never reads them."""
    return bnb_config_export(ensure_tiny_checkpoint(), str(tmp_path_factory.mktemp("bnb") / "openbmb-bnb"))


def bnb_config(folder: str) -> SimpleNamespace:
    with open(os.path.join(folder, "config.json")) as file:
        return SimpleNamespace(quantization_config=json.load(file)["quantization_config"])


def test_a_bitsandbytes_checkpoint_needs_cuda_then_bitsandbytes(bnb_recipe, monkeypatch):
    with pytest.raises(ModelUnavailable, match="quantized \\(bitsandbytes\\) and needs a CUDA GPU"):
        load_model_and_processor(ModelSource(name=bnb_recipe, path=bnb_recipe), "cpu", torch.float32, "sdpa")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "bitsandbytes" else find_spec(name))
    with pytest.raises(UserError, match="needs bitsandbytes: pip install bitsandbytes"):
        complete_quantization_config(bnb_recipe, bnb_config(bnb_recipe), "cuda", torch.bfloat16)


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16 card", "no bf16"])
def test_a_bitsandbytes_checkpoint_computes_in_the_apps_dtype(bnb_recipe, monkeypatch, bf16):
    """What transformers gets: the checkpoint's own NF4 settings and skip list (its vision tower is
    4-bit too), computing in the app's bf16 where the card has it, else in the checkpoint's float16."""
    from transformers import BitsAndBytesConfig
    from transformers.quantizers import AutoHfQuantizer

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: name == "bitsandbytes" or find_spec(name))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
    config = bnb_config(bnb_recipe)
    complete_quantization_config(bnb_recipe, config, "cuda", torch.bfloat16)
    assert config.quantization_config == {**BNB_RECIPE, "bnb_4bit_compute_dtype": "bfloat16" if bf16 else "float16"}
    merged = AutoHfQuantizer.merge_quantization_configs(config.quantization_config, None)
    assert isinstance(merged, BitsAndBytesConfig) and merged.load_in_4bit
    assert merged.bnb_4bit_compute_dtype == (torch.bfloat16 if bf16 else torch.float16)
    assert merged.llm_int8_skip_modules == ["lm_head"] and merged.bnb_4bit_use_double_quant
    assert AutoHfQuantizer.from_config(merged, pre_quantized=True).pre_quantized


@pytest.fixture(scope="module")
def bnb_export(tmp_path_factory) -> str:
    """The tiny model quantized by bitsandbytes with OpenBMB's recipe and saved, as their BNB build was."""
    from transformers import AutoModelForImageTextToText, AutoProcessor, BitsAndBytesConfig

    source, out = ensure_tiny_checkpoint(), str(tmp_path_factory.mktemp("bnb-gpu") / "openbmb-bnb")
    recipe = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.float16, llm_int8_skip_modules=["lm_head"])
    model = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.bfloat16, device_map="cuda",
                                                        quantization_config=recipe)
    model.save_pretrained(out)
    AutoProcessor.from_pretrained(source).save_pretrained(out)
    return out


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None,
                    reason="bitsandbytes checkpoints load on CUDA only, with bitsandbytes installed")
def test_a_bitsandbytes_checkpoint_loads_and_answers_on_a_gpu(bnb_export, tmp_path, red_image):
    import bitsandbytes

    assert bnb_config(bnb_export).quantization_config == BNB_RECIPE  # the recipe as transformers saves it
    assert "model.vision_tower.encoder.layers.0.mlp.fc1.weight.absmax" in tensor_names(bnb_export)
    model, _ = load_model_and_processor(ModelSource(name=bnb_export, path=bnb_export), "cuda", torch.bfloat16, "sdpa")
    down = model.model.language_model.layers[0].mlp.down_proj
    fc1 = model.model.vision_tower.encoder.layers[0].mlp.fc1
    assert isinstance(down, bitsandbytes.nn.Linear4bit) and isinstance(fc1, bitsandbytes.nn.Linear4bit)
    assert down.compute_dtype == torch.bfloat16 == fc1.compute_dtype
    del model
    with serving(bnb_export, tmp_path / "app.log") as url:
        ask(url, red_image)
        assert "bitsandbytes 4-bit weights" in header(url)
