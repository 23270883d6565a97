"""The vision tower's inputs, grouped attention, precomputed slice layout and one-pass merger."""

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention
from transformers import AutoModelForImageTextToText, AutoProcessor

from app.model.vision import tower as vision_tower
from app.model.vision.fused import FusedVisionTower
from app.model.runner import BatchRunner
from app.engine.inputs import prepare_inputs
from app.engine.processor import load_processor
from app.model.checkpoint.random_checkpoint import TINY_CONFIG, TINY_CONFIG_4_7, build_random_checkpoint
from app.engine.settings import GenerationSettings
from tests.conftest import make_image, make_video, normalized_as_the_engine_does


def per_slice_attention(query, key, value, lengths, scale):
    outputs, start = [], 0
    for length in lengths:
        window = slice(start, start + length)
        outputs.append(scaled_dot_product_attention(query[:, :, window], key[:, :, window], value[:, :, window],
                                                    scale=scale).transpose(1, 2))
        start += length
    return torch.cat(outputs, dim=1)


def test_grouped_attention_equals_one_call_per_slice(monkeypatch):
    torch.manual_seed(0)
    heads, dim = 4, 8
    # Runs of equal slices, a lone slice, and a run longer than one call may hold (split in three).
    monkeypatch.setattr(vision_tower, "MAX_GRID_ROWS", 3 * heads)
    for lengths in ([16, 16, 16], [16, 16, 9, 9, 16], [5], [4] * 8):
        tokens = sum(lengths)
        # As the model hands them over: [1, heads, tokens, dim] views of [1, tokens, heads, dim] projections.
        query, key, value = (torch.randn(1, tokens, heads, dim).transpose(1, 2) for _ in range(3))
        bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        grouped, _ = vision_tower.grouped_varlen_attention(None, query, key, value, scaling=0.3, cu_seq_lens_q=bounds)
        assert grouped.shape == (1, tokens, heads, dim)
        torch.testing.assert_close(grouped, per_slice_attention(query, key, value, lengths, 0.3), rtol=0, atol=1e-6)


def test_images_and_videos_come_in_uint8_and_the_engine_normalizes_them(manager, tmp_path):
    """The app's processor leaves images' and videos' pixels unnormalized (uint8, a quarter of float32's bytes);
    the runner's normalization on its device gives what the processor as shipped gives, bit for bit, in the
    tower's dtype."""
    image = make_image(tmp_path, "p.png", (1000, 700))
    video = make_video(tmp_path, seconds=2, fps=4)
    settings = GenerationSettings(max_new_tokens=8)
    shipped = AutoProcessor.from_pretrained(manager.source.path)
    runner = manager.runner
    for media, key, normalization in (({"type": "image", "path": image}, "pixel_values", "pixel_normalization"),
                                      ({"type": "video", "path": video}, "pixel_values_videos",
                                       "video_pixel_normalization")):
        messages = [{"role": "user", "content": [media, {"type": "text", "text": "What is this?"}]}]
        sent = prepare_inputs(manager.processor, messages, settings, 4096, pixel_dtype=torch.bfloat16).tensors
        assert sent[key].dtype == torch.uint8, key
        expected = prepare_inputs(shipped, messages, settings, 4096).tensors[key]
        assert expected.dtype == torch.float32
        assert torch.equal(runner._pixels(sent[key], sent[normalization]), expected.to(runner.pixel_dtype)), key


@pytest.mark.parametrize("config", [TINY_CONFIG, TINY_CONFIG_4_7], ids=["4.6", "4.7"])
def test_patches_cut_by_reshape_equal_the_processors_own(config, tmp_path):
    folder = str(tmp_path / "checkpoint")
    build_random_checkpoint(folder, config)
    shipped, ours = AutoProcessor.from_pretrained(folder), load_processor(folder, trust_remote_code=False)
    for part in ("image_processor", "video_processor"):  # both were changed
        assert getattr(ours, part).reshape_by_patch.__name__ != type(getattr(ours, part)).reshape_by_patch.__name__
    images = [make_image(tmp_path, f"{i}.png", size, (40 * i, 90, 200 - 40 * i))
              for i, size in enumerate([(1344, 1344), (700, 300), (180, 900), (30, 30)])]
    video = make_video(tmp_path, seconds=3, fps=4)
    requests = [[{"role": "user", "content": [{"type": "image", "path": path} for path in images] + [{"type": "text", "text": "?"}]}],
                [{"role": "user", "content": [{"type": "video", "path": video}, {"type": "text", "text": "?"}]}]]
    for mode in ("16x", "4x"):
        settings = GenerationSettings(max_new_tokens=8, downsample_mode=mode)
        for messages in requests:
            expected = prepare_inputs(shipped, messages, settings, 8192).tensors
            got = normalized_as_the_engine_does(prepare_inputs(ours, messages, settings, 8192).tensors)
            assert expected.keys() == got.keys()
            for key, value in expected.items():
                assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, key


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "transformers' modules"])
@pytest.mark.parametrize("config", [TINY_CONFIG, TINY_CONFIG_4_7], ids=["4.6", "4.7"])
def test_tower_gives_the_models_own_features(config, fused, tmp_path, monkeypatch):
    from app import tuning
    """Images of three sizes (slices of several sizes side by side) in both downsample modes, and a video:
    the fused tower (app.model.vision.fused), and transformers' modules as app.model.vision.tower tunes
    them (grouped attention, precomputed layout, one-pass merger), against the model as shipped. In float64,
    so that only a difference in the computation shows (in float32 the fused tower's matrix products,
    merged and with the position embeddings as their C input, round differently: up to 1.3e-5 at
    features up to 20)."""
    monkeypatch.setattr(tuning, "FUSED_VISION_TOWER", int(fused))
    folder = str(tmp_path / "checkpoint")
    build_random_checkpoint(folder, config)
    processor = AutoProcessor.from_pretrained(folder)
    as_shipped = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="sdpa").eval().double()
    runner = BatchRunner(AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="sdpa").eval().double())
    assert isinstance(runner.vision, FusedVisionTower) == fused
    images = [make_image(tmp_path, f"{i}.png", size, (40 * i, 90, 200 - 40 * i))
              for i, size in enumerate([(1344, 1344), (700, 300), (180, 900)])]
    video = make_video(tmp_path, seconds=3, fps=4)
    for mode in ("16x", "4x"):
        settings = GenerationSettings(max_new_tokens=8, downsample_mode=mode)
        requests = [[{"role": "user", "content": [{"type": "image", "path": path} for path in paths] + [{"type": "text", "text": "?"}]}]
                    for paths in (images[:1], images[1:])]
        requests.append([{"role": "user", "content": [{"type": "video", "path": video}, {"type": "text", "text": "?"}]}])
        tensors = [prepare_inputs(processor, messages, settings, 8192).tensors for messages in requests]
        with torch.no_grad():
            tuned = runner.encode_media([(t, mode) for t in tensors])
            for t, features in zip(tensors, tuned):
                if "pixel_values_videos" in t and t["pixel_values_videos"] is not None:
                    shipped = as_shipped.model.get_video_features(t["pixel_values_videos"], t["target_sizes_videos"],
                                                                  downsample_mode=mode)
                else:
                    shipped = as_shipped.model.get_image_features(t["pixel_values"], t["target_sizes"], downsample_mode=mode)
                torch.testing.assert_close(features, torch.cat(shipped.pooler_output), rtol=1e-10, atol=1e-10)


def test_a_quantized_tower_keeps_transformers_modules(tmp_path):
    """A vision linear layer that is not a plain nn.Linear (as bitsandbytes', GPTQ's) holds no weight to
    merge: the runner keeps transformers' modules, tuned."""
    from tests.test_fused_text import LinearSubclass, tiny_model

    model = tiny_model(TINY_CONFIG, tmp_path)
    model.model.vision_tower.encoder.layers[-1].mlp.fc2.__class__ = LinearSubclass
    runner = BatchRunner(model)
    assert isinstance(runner.vision, vision_tower.TransformersVisionTower)
    assert model.model.vision_tower.config._attn_implementation == vision_tower.NAME
