"""Known MiniCPM-V checkpoints and what they can do. Any other Hub id or local folder loads too."""

from dataclasses import dataclass

from app.config import TINY_RANDOM


@dataclass(frozen=True)
class Preset:
    model: str
    label: str
    native: bool  # loads in this app's transformers; False: serve it elsewhere and use --backend openai
    video: bool = True
    thinking: bool = True  # the chat template takes enable_thinking (its own default applies: app.engine.inputs)
    note: str = ""


# The model type the batching engine serves (app/model/runner.py knows its layout).
SERVED_MODEL_TYPES = ("minicpmv4_6", "minicpmv4_7")
# MiniCPM-V model types it does not serve (yet), and why.
UNSERVED_MODEL_TYPES = {
    "minicpmv": "its remote code, written for transformers 4",
}
# The first transformers release that reads each model type, for the "upgrade" message.
FIRST_TRANSFORMERS = {"minicpmv4_6": "5.7.0", "minicpmv4_7": "5.18.0"}

PRESETS = (
    Preset("openbmb/MiniCPM-V-4.6", "MiniCPM-V 4.6 (1.3 B)", native=True),
    Preset("openbmb/MiniCPM-V-4.6-Thinking", "MiniCPM-V 4.6 Thinking", native=True),
    # OpenBMB's int4 builds: GPTQ and AWQ need requirements-quant.txt, BNB needs bitsandbytes and CUDA.
    Preset("openbmb/MiniCPM-V-4.6-GPTQ", "MiniCPM-V 4.6 int4 (GPTQ)", native=True),
    Preset("openbmb/MiniCPM-V-4.6-AWQ", "MiniCPM-V 4.6 int4 (AWQ)", native=True),
    Preset("openbmb/MiniCPM-V-4.6-BNB", "MiniCPM-V 4.6 4-bit (bitsandbytes, CUDA)", native=True),
    Preset("openbmb/MiniCPM-V-4.6-Thinking-GPTQ", "MiniCPM-V 4.6 Thinking int4 (GPTQ)", native=True),
    Preset("openbmb/MiniCPM-V-4.6-Thinking-AWQ", "MiniCPM-V 4.6 Thinking int4 (AWQ)", native=True),
    Preset("openbmb/MiniCPM-V-4.6-Thinking-BNB", "MiniCPM-V 4.6 Thinking 4-bit (bitsandbytes, CUDA)", native=True),
    Preset("openbmb/MiniCPM-V-2_6", "MiniCPM-V 2.6 (8 B)", native=False, thinking=False,
           note="MiniCPM-V 2.6's Hub code predates transformers 5: serve it with vLLM, SGLang or Ollama "
                "and start this app with --backend openai (see the README)."),
    Preset("openbmb/MiniCPM-V-4.7-1B", "MiniCPM-V 4.7 1B", native=True),
    Preset(TINY_RANDOM, "tiny random (for tests)", native=True),
)


def find_preset(model: str) -> Preset | None:
    return next((preset for preset in PRESETS if preset.model == model), None)
