"""The model's side of batching: encode media of many requests at once, prefill them together into
their slots, and run one decode step for every running slot together.

The text model runs as app.model.text.fused writes it out where the checkpoint allows (else through
transformers' layers). On CUDA the decode step is captured as a CUDA graph per batch-size bucket and
replayed: even fused, a step is a chain of a few hundred small kernels, and launching them from Python
would cost more than running them. Elsewhere it runs eagerly.

On CUDA a wave's media are encoded on a stream of their own (encode_media_ahead) while the running
requests' decode steps go on, on a stream of higher priority (`serving_stream`). The vision tower's big
waves are bound by matrix products, the decode step by memory: run one after the other, every running
reply stalled for each wave (100-400 ms), and the GPU did one kind of work at a time. Side by side they
still mostly take turns: cuBLAS's products keep their thread blocks on every SM until they end, so a
decode step waits for each (2 steps in a 16-image wave of 157 ms on an H200), unless the products are
told to leave SMs free (tuning.VISION_SM_CARVEOUT; benchmarks/experiments/side_by_side.py).
"""

import contextlib
import logging
import time

import torch

from app import tuning
from app.model.cuda_graphs import GRAPH_BUCKETS, DecodeGraphs, PrefillGraphs
from app.model.streams import MediaEncoding, PixelStaging, StagedPixels, matmuls_leaving_sms, serving_stream, vision_stream
from app.model.batch_cache import DecodeCache, PrefillCache, SlotStore
from app.model.text.fused import fused_text_model_for
from app.model.vision.fused import fused_vision_tower_for
from app.engine.waves import padded_length
from app.engine.inputs import PIXEL_KEYS, normalized_pixels
from app.model.transfers import on_device
from app.model.vision.tower import slice_layout, tune_vision_tower

log = logging.getLogger(__name__)


def canvas_positions(model, tensors: dict, downsample_mode: str) -> tuple[torch.Tensor, int] | None:
    """A prompt's M-RoPE positions [3, length] and what later tokens add to their text position, for a
    model that lays images out on canvases (MiniCPM-V 4.7, through its own get_rope_index); None when
    positions are plain token counts (4.6, or a prompt without media). CPU work on the prompt's ids."""
    get_rope_index = getattr(model.model, "get_rope_index", None)
    media = tensors.get("target_sizes") is not None or tensors.get("target_sizes_videos") is not None
    if get_rope_index is None or tensors.get("mm_token_type_ids") is None or not media:
        return None
    positions, deltas = get_rope_index(
        tensors["input_ids"], tensors["mm_token_type_ids"], target_sizes=tensors.get("target_sizes"),
        target_sizes_videos=tensors.get("target_sizes_videos"), downsample_mode=downsample_mode)
    return positions[:, 0], int(deltas[0, 0])


class BatchRunner:
    def __init__(self, model, use_cuda_graphs: bool | None = None):
        self.model = model
        self.device = model.device
        self.store = SlotStore(self.device)
        self.language_model = model.model.language_model
        self.embed = model.get_input_embeddings()
        self.image_token_id = model.config.image_token_id
        self.video_token_id = model.config.video_token_id
        if use_cuda_graphs is None:
            use_cuda_graphs = self.device.type == "cuda"
        self.graphs = DecodeGraphs(self) if use_cuda_graphs else None
        self.fused = fused_text_model_for(model, self.store) if tuning.FUSED_TEXT_MODEL else None
        self.prefill_graphs = PrefillGraphs(self) if use_cuda_graphs and self.fused is not None else None
        self.fused_vision = fused_vision_tower_for(model) if tuning.FUSED_VISION_TOWER else None
        # Not with use_cuda_graphs=False either: on ZeroGPU the GPU exists only inside the callers' functions.
        self._staging = PixelStaging(self.device) if use_cuda_graphs and self.device.type == "cuda" else None
        # The scheduler's stream for prefills and decode steps; None: the thread's current one.
        self.serving_stream = (serving_stream(self.device) if use_cuda_graphs and self.device.type == "cuda"
                               and tuning.MEDIA_ALONGSIDE_DECODING else None)
        self.pixel_dtype = model.model.vision_tower.dtype
        self._normalizations: dict[tuple, torch.Tensor] = {}  # pixel normalization on the device
        if self.fused_vision is None:
            tune_vision_tower(model)

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.graphs is not None

    def on_serving_stream(self):
        """A context in which GPU work goes to the serving stream (nothing changes without one)."""
        return contextlib.nullcontext() if self.serving_stream is None else torch.cuda.stream(self.serving_stream)

    # Media ---------------------------------------------------------------------------------------

    def stage_media(self, tensors: dict) -> None:
        """Start copying a prepared request's pixels to the GPU on a side stream, on the caller's thread,
        so that its prefill wave finds them there. Copied in the wave, from pageable memory (the
        pixels come from the preparing workers through shared memory), each copy held up the GPU and
        the scheduler's thread: 25 ms of a 32-image wave's 404 on an H200. At most
        tuning.STAGED_PIXELS_MB wait on the GPU at once; others are copied in their wave."""
        if self._staging is None:
            return
        for key in PIXEL_KEYS:
            pixels = tensors.get(key)
            if isinstance(pixels, torch.Tensor) and not pixels.is_cuda:
                staged = self._staging.stage(pixels)
                if staged is not None:
                    tensors[key] = staged

    def encode_media_ahead(self, batch: list[tuple[dict, str]], decoding: bool) -> "MediaEncoding":
        """encode_media, on CUDA launched on the vision stream without waiting for it: the features are
        ready when the returned MediaEncoding says so. Elsewhere computed at once. `decoding`: replies
        decode meanwhile, and the tower's matrix products leave them tuning.VISION_SM_CARVEOUT SMs."""
        if self.serving_stream is None:
            started = time.perf_counter()
            features = self.encode_media(batch)
            return MediaEncoding(features, None, time.perf_counter() - started)
        stream = vision_stream(self.device)
        with torch.cuda.stream(stream), matmuls_leaving_sms(tuning.VISION_SM_CARVEOUT if decoding else 0):
            started, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            started.record(stream)
            features = self.encode_media(batch)
            done.record(stream)
        return MediaEncoding(features, (started, done), None)

    def encode_media(self, batch: list[tuple[dict, str]]) -> list[torch.Tensor | None]:
        """Visual features per request, from (processor tensors, downsample mode) pairs.

        Images of all requests that share a downsample mode go through the vision tower in one call
        (the model packs any number of images into one sequence); a video is encoded on its own.
        """
        features: list[torch.Tensor | None] = [None] * len(batch)
        by_mode: dict[str, list[int]] = {}
        for index, (tensors, mode) in enumerate(batch):
            if tensors.get("pixel_values_videos") is not None:
                # Frames packed one after another, as the model's get_video_features packs them.
                frames = self._on_device(tensors["pixel_values_videos"])
                sizes = tensors["target_sizes_videos"].repeat(frames.shape[0], 1)
                features[index] = torch.cat(self._slice_features(frames.permute(1, 2, 0, 3).flatten(2), sizes, mode))
            elif tensors.get("pixel_values") is not None:
                by_mode.setdefault(mode, []).append(index)
        for mode, indices in by_mode.items():
            # Joined on the GPU: a wave's pixels are hundreds of MB, too many to copy once more on the CPU.
            pixels = torch.cat([self._image_pixels(batch[i][0]) for i in indices], dim=-1)
            sizes = [batch[i][0]["target_sizes"] for i in indices]
            per_slice = iter(self._slice_features(pixels, torch.cat(sizes), mode))
            for index, request_sizes in zip(indices, sizes):
                features[index] = torch.cat([next(per_slice) for _ in range(len(request_sizes))])
        return features

    def _image_pixels(self, tensors: dict) -> torch.Tensor:
        """A request's image slices [channels, patch, tokens * patch] on the device, as the tower takes
        them: the app's processor leaves them in uint8, to be normalized here (app.engine.inputs)."""
        pixels = self._on_device(tensors["pixel_values"])[0]
        if pixels.is_floating_point():
            return pixels
        normalization = tensors["pixel_normalization"]
        key = tuple(normalization.flatten().tolist())
        if key not in self._normalizations:  # constant per processor: copied once
            self._normalizations[key] = normalization.to(self.device)
        return normalized_pixels(pixels, self._normalizations[key]).to(self.pixel_dtype)

    def _on_device(self, pixels) -> torch.Tensor:
        if isinstance(pixels, StagedPixels):
            return pixels.on_device()
        return pixels.to(self.device, non_blocking=True)

    def _slice_features(self, pixels: torch.Tensor, sizes: torch.Tensor, mode: str) -> list[torch.Tensor]:
        """Each slice's visual features from slices packed back to back: pixels [channels, patch, tokens *
        patch] on the device, their patch grids `sizes` [slices, 2] on the CPU (the model reads them
        slice by slice, and each read from the GPU would wait for it)."""
        if self.fused_vision is not None:
            return self.fused_vision.features(pixels, sizes, mode)
        output = self.model.model.get_image_features(pixels[None], sizes, downsample_mode=mode,
                                                     **slice_layout(self.model, sizes))
        return list(output.pooler_output)

    # Text ----------------------------------------------------------------------------------------

    def prefill(self, prompts: list[tuple[torch.Tensor, torch.Tensor | None, tuple | None]], first_slot: int,
                columns: int) -> torch.Tensor:
        """Run new requests' prompts (input ids [1, length], visual features, `canvas_positions`) together
        into slots first_slot, first_slot + 1, ...; `columns` is room each needs. Next-token logits
        [requests, vocab]."""
        count = len(prompts)
        self.store.reserve(first_slot + count, columns)
        lengths = [prompt[0].shape[1] for prompt in prompts]
        deltas = [canvas[1] if canvas is not None else 0 for _, _, canvas in prompts]
        # MiniCPM-V 4.7's canvas positions (three M-RoPE channels apart) go through transformers' layers.
        if self.fused is not None and not any(canvas is not None for _, _, canvas in prompts):
            features = [f for _, f, _ in prompts if f is not None]
            embeddings = self._embedded(torch.cat([input_ids for input_ids, _, _ in prompts], dim=1),
                                        torch.cat(features) if features else None)[0]
            logits = self.prefill_graphs.run(embeddings, lengths, first_slot) if self.prefill_graphs else None
            if logits is None:
                logits = self.fused.prefill(embeddings, lengths, first_slot)
        else:
            logits = self.prefill_through_transformers(prompts, first_slot)
        self.store.lengths[first_slot:first_slot + count] = on_device(lengths, torch.long, self.device)
        self.store.rope_deltas[first_slot:first_slot + count] = on_device(deltas, torch.long, self.device)
        return logits

    def prefill_through_transformers(self, prompts: list[tuple], first_slot: int) -> torch.Tensor:
        """prefill's computation through transformers' layers: the prompts left-padded to one length."""
        count = len(prompts)
        lengths = [prompt[0].shape[1] for prompt in prompts]
        # One prompt alone needs no padding (nor an attention mask, whose size grows with its square).
        padded = lengths[0] if count == 1 else padded_length(max(lengths))
        embeds = [torch.nn.functional.pad(self._embedded(input_ids, features), (0, 0, padded - length, 0))
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

    def _embedded(self, input_ids: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """Input embeddings [1, length, hidden] of prompt tokens [1, length], their media placeholders
        holding `features` in order. Neither step waits for the GPU (a pageable copy or a boolean
        index would, and the GPU may still be busy with a decode step)."""
        if self.device.type == "cuda":
            input_ids = input_ids.pin_memory()
        input_ids = input_ids.to(self.device, non_blocking=True)
        row = self.embed(input_ids)
        if features is not None:
            placeholders = input_ids == self.image_token_id
            if self.video_token_id is not None:
                placeholders |= input_ids == self.video_token_id
            row.masked_scatter_(placeholders[..., None], features.to(row.dtype))
        return row

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """One step for slots [0, n) fed `tokens` [n]; next-token logits [n, vocab]."""
        n = tokens.shape[0]
        if self.graphs is not None:
            logits = self.graphs.run(tokens)
        else:
            logits = self.decode_step(tokens.to(self.device), self.store.lengths[:n].clone())
        self.store.lengths[:n] += 1
        return logits

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The decode computation itself: slot i reads its columns [0, positions[i]] and writes column positions[i]."""
        if self.fused is not None:
            return self.fused.decode(tokens, positions)
        return self.decode_step_through_transformers(tokens, positions)

    def decode_step_through_transformers(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """decode_step through transformers' layers (for models app.model.text.fused does not cover)."""
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

    def move(self, source: int, target: int) -> None:
        self.store.move(source, target)

    def warm_up_shapes(self, max_rows: int, token_budget: int) -> list[tuple[int, int]]:
        """Run every shape the scheduler can use once, so that kernels built per shape (Triton's, on
        CUDA) are ready before users come: prefill waves of 1, 2, 4... rows at padded lengths filling
        each quarter of `token_budget`, then the captured decode step of each batch bucket up to the
        wave's rows. Uses the slots freely, then leaves the store reserved for `max_rows` (see
        _reserve_batch). Returns the (rows, length) prefill shapes run."""
        with self.on_serving_stream():  # where the scheduler uses the store next: no wait between streams
            return self._warm_up_shapes(max_rows, token_budget)

    def _warm_up_shapes(self, max_rows: int, token_budget: int) -> list[tuple[int, int]]:
        multiple = tuning.PREFILL_LENGTH_MULTIPLE
        shapes, rows, decoded_up_to = [], 1, 0
        while rows <= max_rows and rows * multiple <= token_budget:
            lengths = {max(multiple, token_budget * quarter // 4 // rows // multiple * multiple) for quarter in range(1, 5)}
            if rows == 1:  # a prompt alone is not padded: lengths off the multiple too
                lengths |= {length - 1 for length in lengths}
            for length in sorted(lengths):
                prompt = torch.randint(0, self.embed.num_embeddings, (1, length))
                # Several rows: one shorter, so the wave runs with padding and masks, as in service.
                prompts = [(prompt, None, None)] * rows
                if rows > 1:
                    prompts[0] = (prompt[:, 1:], None, None)
                self.prefill(prompts, 0, length + 1)
                shapes.append((rows, length))
            if self.graphs is not None:
                for bucket in GRAPH_BUCKETS:
                    if decoded_up_to < bucket <= rows:
                        self.graphs.run(torch.zeros(bucket, dtype=torch.long, device=self.device))
            decoded_up_to = rows
            self.release()
            rows *= 2
        self._reserve_batch(max_rows)
        return shapes

    def _reserve_batch(self, max_rows: int) -> None:
        """Take the store's slots for a whole batch now, and capture the decode step of every bucket (and
        the small waves' prefill).

        Else the store grows with the batch in service, and each growth moves its tensors and so
        recaptures the decode step of each bucket met next (about 0.1 s each, every stream stalled):
        33 recaptures in one benchmark run on an H200. Columns still grow for long requests.
        """
        self.prefill([(torch.zeros((1, 1), dtype=torch.long), None, None)], 0, tuning.RESERVED_COLUMNS)  # every layer's state
        self.store.reserve(max_rows, tuning.RESERVED_COLUMNS)
        if self.graphs is not None:
            for bucket in GRAPH_BUCKETS:
                if bucket <= max_rows:
                    self.graphs.run(torch.zeros(bucket, dtype=torch.long, device=self.device))
        if self.prefill_graphs is not None:
            self.prefill_graphs.capture_all(max_rows)

    def release(self) -> None:
        self.store.release()
        if self.graphs is not None:
            self.graphs.clear()
        if self.prefill_graphs is not None:
            self.prefill_graphs.clear()


def release_gpu_memory(error: Exception) -> None:
    """After `error`, if the GPU ran out of memory: what the allocator keeps cached goes back to the card."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        torch.cuda.empty_cache()
