"""OpenBMB's own 4-bit builds of MiniCPM-V 4.6, as tiny checkpoints laid out the same way
(tests/int4_exports.py) load and answer through `python app.py`."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from safetensors import safe_open

from app.model.checkpoint.quantized import complete_quantization_config
from app.model.checkpoint.random_checkpoint import build_random_checkpoint
from tests.int4_exports import MODULES_IN_BLOCK, RECIPE_CONFIG, autoawq_export, autogptq_export
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
    complete_quantization_config(folder, config)
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
