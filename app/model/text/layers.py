"""The text model through transformers' own layers over the slot store: the path for checkpoints that
app.model.text.fused does not cover (quantized ones, other architectures), and for MiniCPM-V 4.7's
prompts with images, whose M-RoPE positions are three channels apart. Also where a prompt's tokens
become input embeddings, which both paths share."""

import torch

from app.engine.waves import padded_length
from app.model.batch_cache import DecodeCache, PrefillCache
from app.model.text.rows import power_of_two_pieces
from app.model.transfers import on_device


class PromptEmbedder:
    """Input embeddings of a prompt's tokens, its media placeholders holding the visual features."""

    def __init__(self, model):
        self.embed = model.get_input_embeddings()
        self.device = model.device
        self.placeholder_ids = [model.config.image_token_id] + (
            [model.config.video_token_id] if model.config.video_token_id is not None else [])

    def __call__(self, input_ids: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """Embeddings [1, length, hidden] of prompt tokens [1, length], their placeholders holding
        `features` in order. Neither step waits for the GPU (a pageable copy or a boolean index would,
        and the GPU may still be busy with a decode step)."""
        if self.device.type == "cuda":
            input_ids = input_ids.pin_memory()
        input_ids = input_ids.to(self.device, non_blocking=True)
        row = self.embed(input_ids)
        if features is not None:
            placeholders = input_ids == self.placeholder_ids[0]
            for token_id in self.placeholder_ids[1:]:
                placeholders |= input_ids == token_id
            row.masked_scatter_(placeholders[..., None], features.to(row.dtype))
        return row


class TransformersText:
    """The runner's text backend through transformers' layers (see app.model.backends)."""

    continues = False  # no prefill_continued: conversations are not kept on this path
    reads_every_column = True  # the decode step's attention reads every column the store reserves

    def __init__(self, model, store, embedded: PromptEmbedder):
        self.model, self.store, self.embedded = model, store, embedded
        self.language_model = model.model.language_model
        self.device = model.device

    def prefill(self, prompts: list[tuple], first_slot: int) -> torch.Tensor:
        """Prompts (input ids [1, length], visual features, canvas positions) into slots first_slot,
        first_slot + 1, ...; next-token logits [prompts, vocab]. In pieces of 2^k prompts, each left-padded
        to one length: the linear-attention layers' Triton kernels are compiled for each new shape
        (tuning.PREFILL_LENGTH_MULTIPLE)."""
        logits = [self._prefill(prompts[start:start + rows], first_slot + start)
                  for start, rows in power_of_two_pieces(len(prompts))]
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def _prefill(self, prompts: list[tuple], first_slot: int) -> torch.Tensor:
        count = len(prompts)
        lengths = [prompt[0].shape[1] for prompt in prompts]
        # One prompt alone needs no padding (nor an attention mask, whose size grows with its square).
        padded = lengths[0] if count == 1 else padded_length(max(lengths))
        embeds = [torch.nn.functional.pad(self.embedded(input_ids, features), (0, 0, padded - length, 0))
                  for (input_ids, features, _), length in zip(prompts, lengths)]
        real = torch.arange(padded, device=self.device)[None] >= padded - on_device(lengths, torch.long, self.device)[:, None]
        positions = (real.cumsum(-1) - 1).clamp(min=0)
        # Rows: the text position (masks, cache columns), then the three M-RoPE channels.
        rope = positions[None].repeat(3, 1, 1)
        for row, (_, _, canvas) in enumerate(prompts):
            if canvas is not None:
                rope[:, row, padded - lengths[row]:] = canvas[0].to(self.device)
        if all(length == padded for length in lengths):
            masks = {"full_attention": None, "linear_attention": None}  # no padding: plain causal attention
        else:
            causal = torch.ones(padded, padded, dtype=torch.bool, device=self.device).tril()
            # Padding rows see themselves only, so that they stay finite (their output is never used).
            sees = (causal[None] & real[:, None, :]) | torch.eye(padded, dtype=torch.bool, device=self.device)[None]
            masks = {"full_attention": sees[:, None], "linear_attention": real.to(embeds[0].dtype)}
        output = self.language_model(
            inputs_embeds=torch.cat(embeds),
            attention_mask=masks,
            position_ids=torch.cat([positions[None], rope]),
            past_key_values=PrefillCache(self.store, first_slot, lengths),
            use_cache=True,
        )
        return self.model.lm_head(output.last_hidden_state[:, -1])

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token for each of slots [0, n): slot i reads its columns [0, positions[i]] and writes
        column positions[i]. Next-token logits [n, vocab]."""
        columns = torch.arange(self.store.column_capacity, device=self.device)
        visible = (columns[None, :] <= positions[:, None])[:, None, None, :]
        rope = positions + self.store.rope_deltas[: positions.shape[0]]
        output = self.language_model(
            input_ids=tokens[:, None],
            attention_mask={"full_attention": visible, "linear_attention": None},
            position_ids=torch.stack([positions, rope, rope, rope])[:, :, None],
            past_key_values=DecodeCache(self.store, tokens.shape[0], positions),
            use_cache=True,
        )
        return self.model.lm_head(output.last_hidden_state[:, 0])

    def capture(self, max_rows: int) -> None:
        """Nothing is captured on this path: its prefills are launched as they come."""

    def clear(self) -> None:
        """Nothing captured to forget."""
