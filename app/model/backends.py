"""Fused or transformers: decided once per model, here, for the text model and for the vision tower.

The runner (app.model.runner) holds one text backend and one vision backend and never asks which it
has. A text backend has prefill(prompts, first_slot), decode_step(tokens, positions), capture(max_rows)
(its small prefills as CUDA graphs, where it has any), clear(), `continues`: whether it has
prefill_continued (a prompt going on from a slot's kept state; the fused model only), and
`reads_every_column`: whether its decode step reads every column the store reserves; a vision backend has
features(pixels, sizes, mode).

- Text: app.model.text.fused where the checkpoint is the architecture it writes out with plain linear
  layers (tuning.FUSED_TEXT_MODEL), else transformers' layers (app.model.text.layers).
- Vision: app.model.vision.fused where the tower has plain linear layers (tuning.FUSED_VISION_TOWER),
  else transformers' modules, tuned (app.model.vision.tower).
"""

import torch

from app import tuning
from app.model.continued_graphs import ContinuedPrefillGraphs
from app.model.cuda_graphs import PrefillGraphs
from app.model.uncaptured import LaunchedPrefills
from app.model.text.fused import FusedTextModel, fused_text_model_for
from app.model.text.layers import PromptEmbedder, TransformersText
from app.model.vision.fused import fused_vision_tower_for
from app.model.vision.tower import TransformersVisionTower


class FusedText:
    """The fused text model as a text backend: prompts packed back to back, waves of few tokens replayed from
    captured graphs. MiniCPM-V 4.7's prompts with images (canvas positions, three M-RoPE channels apart)
    go through transformers' layers, which it keeps for them."""

    continues = True  # prefill_continued: a prompt can go on from a conversation's kept state
    reads_every_column = False  # the decode step's attention reads each request's own columns

    def __init__(self, fused: FusedTextModel, through_transformers: TransformersText, embedded: PromptEmbedder,
                 capture_prefills: bool):
        self.fused, self.through_transformers, self.embedded = fused, through_transformers, embedded
        self.prefill_graphs = PrefillGraphs(fused.store, fused) if capture_prefills else LaunchedPrefills()
        self.continued_graphs = ContinuedPrefillGraphs(fused.store, fused) if capture_prefills else LaunchedPrefills()

    def prefill(self, prompts: list[tuple], first_slot: int) -> torch.Tensor:
        if any(canvas is not None for _, _, canvas in prompts):
            return self.through_transformers.prefill(prompts, first_slot)
        lengths = [input_ids.shape[1] for input_ids, _, _ in prompts]
        features = [f for _, f, _ in prompts if f is not None]
        embeddings = self.embedded(torch.cat([input_ids for input_ids, _, _ in prompts], dim=1),
                                   torch.cat(features) if features else None)[0]
        logits = self.prefill_graphs.run(embeddings, lengths, first_slot)
        return self.fused.prefill(embeddings, lengths, first_slot) if logits is None else logits

    def prefill_continued(self, prompts: list[tuple], starts: list[int], slots: list[int]) -> torch.Tensor:
        """Prompts (input ids [1, length], visual features) that go on from the `starts[i]` tokens slots[i]
        holds; waves of few tokens replayed from captured graphs."""
        features = [f for _, f in prompts if f is not None]
        embeddings = self.embedded(torch.cat([input_ids for input_ids, _ in prompts], dim=1),
                                   torch.cat(features) if features else None)[0]
        lengths = [ids.shape[1] for ids, _ in prompts]
        logits = self.continued_graphs.run(embeddings, lengths, starts, slots)
        return self.fused.prefill_continued(embeddings, lengths, starts, slots) if logits is None else logits

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.fused.decode(tokens, positions)

    def capture(self, max_rows: int) -> None:
        self.prefill_graphs.capture_all(max_rows)
        self.continued_graphs.capture_all(max_rows)

    def clear(self) -> None:
        self.prefill_graphs.clear()
        self.continued_graphs.clear()


def text_backend_for(model, store, capture_graphs: bool) -> FusedText | TransformersText:
    """The text backend for `model` over `store`; `capture_graphs`: small prefills may be captured."""
    embedded = PromptEmbedder(model)
    through_transformers = TransformersText(model, store, embedded)
    fused = fused_text_model_for(model, store) if tuning.FUSED_TEXT_MODEL else None
    if fused is None:
        return through_transformers
    return FusedText(fused, through_transformers, embedded, capture_graphs)


def vision_backend_for(model):
    """The vision backend for `model`: a FusedVisionTower, or a TransformersVisionTower."""
    fused = fused_vision_tower_for(model) if tuning.FUSED_VISION_TOWER else None
    return TransformersVisionTower(model) if fused is None else fused
