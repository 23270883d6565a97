"""Quantize a MiniCPM-V 4.6 checkpoint to int4 (GPTQ or AWQ) with GPT-QModel (needs requirements-quant.txt).

Calibration uses the example images in assets/examples with a few questions and answers. The result is
a folder the app loads like any checkpoint (`python app.py --model OUT`). GPT-QModel also writes a
logs/ folder where it runs.

    python scripts/quantize.py --model tiny-random --out /tmp/tiny-gptq                 # seconds, on the CPU
    python scripts/quantize.py --model tiny-random --method awq --out /tmp/tiny-awq
    python scripts/quantize.py --model openbmb/MiniCPM-V-4.6 --out MiniCPM-V-4.6-GPTQ --device cuda
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

EXAMPLES = os.path.join(ROOT, "assets", "examples")
QUESTIONS = [
    ("What is in this picture?", "The picture shows a few coloured shapes on a plain background."),
    ("Describe every detail, please.", "There is a circle, a square and a triangle, each a different colour."),
    ("Read any text you see.", "The sign says: welcome to the demo."),
    ("What changed, and where?", "The shapes moved to the right; their colours stayed the same."),
]


def calibration_conversations(samples: int) -> list[list[dict]]:
    images = sorted(os.path.join(EXAMPLES, name) for name in os.listdir(EXAMPLES) if name.endswith(".jpg"))
    conversations = []
    for index in range(samples):
        question, answer = QUESTIONS[index % len(QUESTIONS)]
        conversations.append([
            {"role": "user", "content": [{"type": "image", "url": images[index % len(images)]},
                                         {"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ])
    return conversations


def quantize(model: str, out: str, method: str = "gptq", bits: int = 4, group_size: int = 32, samples: int = 8,
             device: str = "cpu") -> str:
    """Quantize `model` (Hub id, folder or tiny-random) with `method` into the folder `out`; returns `out`."""
    # GPT-QModel sizes a worker pool from the CPU count and refuses to start on a 1-2 core machine.
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.quantization.config import AWQConfig

    from app.model.checkpoint.loader import resolve_model

    source = resolve_model(model)
    settings = (AWQConfig if method == "awq" else QuantizeConfig)(bits=bits, group_size=group_size)
    quantizer = GPTQModel.load(source.path, settings, device=device)
    quantizer.quantize(calibration_conversations(samples), batch_size=1)
    quantizer.save(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--method", choices=["gptq", "awq"], default="gptq")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(quantize(args.model, args.out, args.method, args.bits, args.group_size, args.samples, args.device))


if __name__ == "__main__":
    main()
