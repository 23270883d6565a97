"""The Server load panel's charts: the engine's history of the last minutes (EngineMetrics.history) as
Gradio line plots. The x axis is minutes before the newest sample, so that no clock of the browser or of
another process enters."""

import gradio as gr
import pandas as pd

from app import tuning
from app.messages import MSG_NO_GPU

MINUTES = "minutes ago"
CHART_MIN_WIDTH = 300  # two charts a row on a desktop, one on a phone


def load_charts(on_gpu: bool) -> list[gr.LinePlot]:
    """The panel's four charts (created inside the panel): tokens/s, replies, first token, GPU memory (a
    labelled empty box without a GPU: on the CPU, or with a model served elsewhere)."""
    with gr.Row():
        tokens = _chart("Tokens/s", "tokens/s", "load-tokens")
        replies = _chart("Replies", "count", "load-replies", color="replies")
    with gr.Row():
        first_token = _chart(f"First token (p50, p95 over {tuning.LOAD_FIRST_TOKEN_WINDOW_S:g} s)", "ms",
                             "load-first-token", color="percentile")
        gpu = _chart("GPU memory in use" if on_gpu else MSG_NO_GPU, "GiB", "load-gpu")
    return [tokens, replies, first_token, gpu]


def _chart(label: str, y: str, elem_id: str, color: str | None = None) -> gr.LinePlot:
    # Set once: an event that changes a plot's settings (not only its value) makes Gradio build that
    # plot again for the session, every refresh. ",.4~r" reads 5,000 and 0.2, and an idle server's
    # chart of zeros "0" (Vega's own format: "0.000000").
    return gr.LinePlot(x=MINUTES, y=y, color=color, label=label, show_label=True, elem_id=elem_id,
                       x_lim=[-tuning.LOAD_HISTORY_S / 60, 0], y_lim=[0, None], y_axis_format=",.4~r",
                       min_width=CHART_MIN_WIDTH)


def chart_values(history: list[dict]) -> list[pd.DataFrame | None]:
    """What each chart shows for `history` (oldest first); None where a chart has no points."""
    if not history:
        return [None] * 4
    newest = history[-1]["time"]
    minutes = [round((sample["time"] - newest) / 60, 2) for sample in history]
    frames = [_lines(minutes, history, "tokens/s", {"tokens/s": "tokens_per_s"}),
              _lines(minutes, history, "count", {"answering": "running", "waiting": "waiting"}, name="replies"),
              _lines(minutes, history, "ms", {"p50": "ttft_p50_s", "p95": "ttft_p95_s"}, name="percentile", scale=1000),
              _lines(minutes, history, "GiB", {"in use": "gpu_memory_bytes"}, scale=1 / 2**30)]
    return [frame if frame[frame.columns[-1]].notna().any() else None for frame in frames]


def _lines(minutes: list[float], history: list[dict], value: str, lines: dict, name: str | None = None,
           scale: float = 1) -> pd.DataFrame:
    """The samples' fields as lines: `lines` maps each line's name to its field; a chart of several names
    them in column `name`. A None (no first token in the window, no GPU) breaks the line there."""
    rows = [(at, line, None if sample[field] is None else sample[field] * scale)
            for line, field in lines.items() for at, sample in zip(minutes, history)]
    if name is None:
        return pd.DataFrame([(at, number) for at, _, number in rows], columns=[MINUTES, value])
    return pd.DataFrame(rows, columns=[MINUTES, name, value])
