"""Which checkpoints load, and the one-line answers for those that cannot."""

import json

import pytest

from app.model.checkpoint.loader import ModelSource, ModelUnavailable, load_model_and_processor
from app.model.checkpoint.presets import find_preset


def checkpoint(folder, config: dict) -> ModelSource:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return ModelSource(name=folder.name, path=str(folder))


def test_minicpm_v_2_6_is_pointed_at_an_external_engine(tmp_path):
    source = checkpoint(tmp_path / "MiniCPM-V-2_6", {"model_type": "minicpmv"})
    with pytest.raises(ModelUnavailable, match="“minicpmv”.*remote code.*--backend openai"):
        load_model_and_processor(source, "cpu", None, "sdpa")
    preset = find_preset("openbmb/MiniCPM-V-2_6")
    assert not preset.native and "--backend openai" in preset.note


def test_an_unknown_model_type_says_so(tmp_path):
    source = checkpoint(tmp_path / "future", {"model_type": "minicpmv9_9"})
    with pytest.raises(ModelUnavailable, match="cannot read “future” \\(model type “minicpmv9_9”\\).*Upgrade transformers"):
        load_model_and_processor(source, "cpu", None, "sdpa")


def test_an_older_transformers_is_told_the_version_needed(tmp_path, monkeypatch):
    import transformers

    def too_old(*args, **kwargs):
        raise KeyError("minicpmv4_7")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", too_old)
    source = checkpoint(tmp_path / "MiniCPM-V-4.7-1B", {"model_type": "minicpmv4_7"})
    with pytest.raises(ModelUnavailable, match="needs transformers >= 5.18.0"):
        load_model_and_processor(source, "cpu", None, "sdpa")
