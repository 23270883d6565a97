"""The benchmarks' model and request: random weights at the real MiniCPM-V 4.6 shape (timings do not depend
on their values), and one 1344x1344 image (640 visual tokens) with a short question."""

import argparse
import json
import os
import tempfile

from app.model.checkpoint.random_checkpoint import RANDOM_CHECKPOINT_VERSION

REFERENCE_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "minicpm-v-4.6.config.json")
DEFAULT_FOLDER = os.path.join(tempfile.gettempdir(), f"minicpmv4_6-real-shape-random-{RANDOM_CHECKPOINT_VERSION}")


def ensure_real_shape_checkpoint(folder: str = DEFAULT_FOLDER) -> str:
    """Build the checkpoint in `folder` (bf16) on first use; returns the folder."""
    import torch

    from app.model.checkpoint.random_checkpoint import build_random_checkpoint

    if not os.path.exists(os.path.join(folder, "config.json")):
        with open(REFERENCE_CONFIG) as file:
            build_random_checkpoint(folder, json.load(file), dtype=torch.bfloat16,
                                    device="cuda" if torch.cuda.is_available() else "cpu")
    return folder


def benchmark_parser(description: str) -> argparse.ArgumentParser:
    """A benchmark's options, beginning with the model's (--model, --checkpoint: see chosen_model), once the
    limits and knobs the environment sets are read, as the app's processes read them (app.startup)."""
    from app.config import apply_environment

    apply_environment()
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint (Hub id, folder or tiny-random) instead of the real-shape random one")
    parser.add_argument("--checkpoint", default=DEFAULT_FOLDER, help="where the real-shape random one is built")
    return parser


def chosen_model(args) -> str:
    """--model, else the real-shape random checkpoint, built into --checkpoint on first use."""
    return args.model or ensure_real_shape_checkpoint(args.checkpoint)


QUESTION = "Describe this image in detail."


def benchmark_request(image_format: str = "png") -> tuple[str, list[dict]]:
    """(image path, messages): a 1344x1344 noise image written once per call, and the question about it.
    As a PNG (4.6 MB, 5.4 MB of pixels: the slow case to decode, what every table in RESULTS.md used unless it says
    otherwise) or as a JPEG of quality 90 (1.3 MB), as photos mostly come."""
    from PIL import Image

    image = os.path.join(tempfile.gettempdir(), f"benchmark-1344.{image_format}")
    Image.effect_noise((1344, 1344), 64).convert("RGB").save(image, **({"quality": 90} if image_format == "jpeg" else {}))
    return image, [{"role": "user", "content": [{"type": "image", "path": image}, {"type": "text", "text": QUESTION}]}]


def asked_anew(messages: list[dict], number: int) -> list[dict]:
    """`messages` with the last question numbered: a first question asked again word for word would be answered
    from the conversation the engine kept of it (app.engine.conversations), as a Retry is, not as a first turn."""
    *earlier, last = messages
    content = [dict(part, text=f"{part['text']} (request {number})") if part["type"] == "text" else part
               for part in last["content"]]
    return [*earlier, {**last, "content": content}]
