"""The model's side of batching: encode media of many requests at once, prefill them together into
their slots, run one decode step for every running slot together, and choose each row's next token.
The scheduler (app.engine.scheduler) asks; this is the only part of the engine that touches the GPU.

The text model runs as app.model.text.fused writes it out where the checkpoint allows (else through
transformers' layers: app.model.backends decides). On CUDA the decode step is captured as a CUDA graph
per batch-size bucket and replayed: even fused, a step is a chain of a few hundred small kernels, and
launching them from Python would cost more than running them. Elsewhere it runs eagerly.

On CUDA a wave's media are encoded on a stream of their own (encode_media_ahead) while the running
requests' decode steps go on, on a stream of higher priority (app.model.streams.SideStreams). The vision
tower's big waves are bound by matrix products, the decode step by memory: run one after the other,
every running reply stalled for each wave (100-400 ms), and the GPU did one kind of work at a time. Side
by side they still mostly take turns: cuBLAS's products keep their thread blocks on every SM until they
end, so a decode step waits for each (2 steps in a 16-image wave of 157 ms on an H200), unless the
products are told to leave SMs free (tuning.VISION_SM_CARVEOUT; benchmarks/experiments/side_by_side.py).
"""

import contextlib
import logging

import torch

from app import tuning
from app.model.backends import text_backend_for, vision_backend_for
from app.model.continued_graphs import CONTINUED_GRAPH_LENGTHS
from app.model.cuda_graphs import DecodeGraphs
from app.model.uncaptured import EagerDecode
from app.model.streams import MediaEncoding, NoStaging, OneStream, PixelStaging, SideStreams, StagedPixels
from app.model.batch_cache import SlotStore
from app.model.sampling import Choice, choose
from app.engine.inputs import PIXEL_KEYS
from app.engine.processor import normalized_pixels
from app.engine.jpegs_on_device import DECODED_PIXELS, DEFERRED_IMAGES
from app.model.jpegs import jpegs_for
from app.model.transfers import on_device

log = logging.getLogger(__name__)


class BatchRunner:
    """What the scheduler asks of the GPU. How each part runs is chosen once, here: the text and vision
    backends (app.model.backends), the decode step captured or launched (app.model.cuda_graphs), pixels
    staged ahead or not and media encoded beside the decode steps or at once (app.model.streams)."""

    def __init__(self, model, use_cuda_graphs: bool | None = None):
        self.model = model
        self.device = model.device
        self.store = SlotStore(self.device)
        on_cuda = self.device.type == "cuda"
        # Not on ZeroGPU either (use_cuda_graphs=False): there the GPU exists only inside the callers' functions.
        captured = on_cuda if use_cuda_graphs is None else use_cuda_graphs
        self.text = text_backend_for(model, self.store, capture_graphs=captured)
        self.steps = (DecodeGraphs if captured else EagerDecode)(self.store, self.text.decode_step)
        self.vision = vision_backend_for(model)
        self.staging = PixelStaging(self.device) if captured and on_cuda else NoStaging()
        self.jpegs = jpegs_for(self.device, captured and on_cuda and bool(tuning.JPEG_ON_DEVICE))
        self.streams = SideStreams(self.device) if captured and on_cuda and tuning.MEDIA_ALONGSIDE_DECODING else OneStream()
        self.pixel_dtype = model.model.vision_tower.dtype
        self._normalizations: dict[tuple, torch.Tensor] = {}  # pixel normalization on the device
        end = model.generation_config.eos_token_id
        self.end_token_ids = [] if end is None else [end] if isinstance(end, int) else list(end)
        self._end_tokens = torch.tensor(self.end_token_ids, dtype=torch.long, device=self.device)

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.steps.captures

    @contextlib.contextmanager
    def serving(self):
        """Where the scheduler's GPU work runs: in inference mode, on the serving stream (if any)."""
        with torch.inference_mode(), self.streams.serving():
            yield

    # Media ---------------------------------------------------------------------------------------

    def stage_media(self, tensors: dict) -> None:
        """Start copying a prepared request's pixels to the GPU on a side stream, on the caller's thread,
        so that its prefill wave finds them there. Copied in the wave, from pageable memory (the
        pixels come from the preparing workers through shared memory), each copy held up the GPU and
        the scheduler's thread: 25 ms of a 32-image wave's 404 on an H200. At most
        tuning.STAGED_PIXELS_MB wait on the GPU at once; others are copied in their wave.

        A request whose images' slices its preparer left to the engine (where self.jpegs.enabled) gets its
        pixels made here, its JPEGs decoded, and every image resized and sliced, on the GPU (app.model.jpegs),
        so that a JPEG that cannot be decoded fails its own request before it joins the line."""
        deferred, decoded = tensors.pop(DEFERRED_IMAGES, None), tensors.pop(DECODED_PIXELS, None)
        if deferred is not None:
            tensors["pixel_values"] = self.jpegs.pixels(deferred, decoded, self.staging)
        for key in PIXEL_KEYS:
            pixels = tensors.get(key)
            if isinstance(pixels, torch.Tensor) and not pixels.is_cuda:
                staged = self.staging.stage(pixels)
                if staged is not None:
                    tensors[key] = staged

    def encode_media_ahead(self, batch: list[tuple[dict, str]], decoding: bool) -> MediaEncoding:
        """encode_media, on CUDA launched on the vision stream from a thread of its own, neither waited for:
        the features are ready when the returned MediaEncoding says so. Elsewhere computed at once.
        `decoding`: replies decode meanwhile (app.model.streams.SideStreams.encode_ahead). The caller may let
        the pixels in `batch`'s dicts go once this returns: the launch reads copies of the dicts."""
        if all(tensors.get(key) is None for tensors, _ in batch for key in PIXEL_KEYS):  # nothing to encode
            return MediaEncoding([None] * len(batch), None, 0.0)
        batch = [(dict(tensors), mode) for tensors, mode in batch]
        return self.streams.encode_ahead(lambda: self.encode_media(batch), decoding)

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
                frames = self._pixels(tensors["pixel_values_videos"], tensors.get("video_pixel_normalization"))
                sizes = tensors["target_sizes_videos"].repeat(frames.shape[0], 1)
                features[index] = torch.cat(self._slice_features(frames.permute(1, 2, 0, 3).flatten(2), sizes, mode))
            elif tensors.get("pixel_values") is not None:
                by_mode.setdefault(mode, []).append(index)
        for mode, indices in by_mode.items():
            # Joined on the GPU: a wave's pixels are hundreds of MB, too many to copy once more on the CPU.
            pixels = torch.cat([self._pixels(batch[i][0]["pixel_values"], batch[i][0].get("pixel_normalization"))[0]
                                for i in indices], dim=-1)
            sizes = [batch[i][0]["target_sizes"] for i in indices]
            per_slice = iter(self._slice_features(pixels, torch.cat(sizes), mode))
            for index, request_sizes in zip(indices, sizes):
                features[index] = torch.cat([next(per_slice) for _ in range(len(request_sizes))])
        return features

    def _pixels(self, pixels, normalization: torch.Tensor | None) -> torch.Tensor:
        """A request's image slices [1, channels, patch, tokens * patch] or video frames on the device, as the tower
        takes them: the app's processor leaves them in uint8, to be normalized here by `normalization`
        (app.engine.processor)."""
        pixels = self._on_device(pixels)
        if pixels.is_floating_point():
            return pixels
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
        return self.vision.features(pixels, sizes, mode)

    # Text ----------------------------------------------------------------------------------------

    def prefill(self, prompts: list[tuple[torch.Tensor, torch.Tensor | None, tuple | None]], first_slot: int,
                columns: int) -> torch.Tensor:
        """Run new requests' prompts (input ids [1, length], visual features, `canvas_positions`) together
        into slots first_slot, first_slot + 1, ...; `columns` is room each needs. Next-token logits
        [requests, vocab]."""
        count = len(prompts)
        self.store.reserve(first_slot + count, columns)
        logits = self.text.prefill(prompts, first_slot)
        lengths = [prompt[0].shape[1] for prompt in prompts]
        deltas = [canvas[1] if canvas is not None else 0 for _, _, canvas in prompts]
        self.store.lengths[first_slot:first_slot + count] = on_device(lengths, torch.long, self.device)
        self.store.rope_deltas[first_slot:first_slot + count] = on_device(deltas, torch.long, self.device)
        return logits

    @property
    def continues(self) -> bool:
        """Whether a prompt can go on from a kept state (prefill_continued, snapshots, restore)."""
        return self.text.continues

    def prefill_continued(self, prompts: list[tuple[torch.Tensor, torch.Tensor | None]], starts: list[int],
                          slots: list[int], columns: int) -> torch.Tensor:
        """Prompts' new tokens (input ids [1, length], visual features) after the `starts[i]` tokens slot
        slots[i] holds (put there by restore, or a prefill); `columns` is room each needs. Next-token
        logits [prompts, vocab]."""
        self.store.reserve(max(slots) + 1, columns)
        logits = self.text.prefill_continued(prompts, starts, slots)
        lengths = [start + input_ids.shape[1] for start, (input_ids, _) in zip(starts, prompts)]
        self.store.lengths.index_copy_(0, on_device(slots, torch.long, self.device), on_device(lengths, torch.long, self.device))
        return logits

    def snapshots(self, slots: list[int], columns: list[int]) -> list | None:
        """A copy of each slot slots[i]'s state after its first columns[i] tokens (app.model.batch_cache.StateSnapshot),
        or None where the GPU has no room for them: a conversation not kept is only slower to go on."""
        try:
            return self.store.snapshots(slots, columns)
        except torch.cuda.OutOfMemoryError:
            pass
        torch.cuda.empty_cache()  # here, not in the handler, whose traceback still holds the failed copies
        return None

    def restore(self, snapshots: list, slots: list[int], columns: int) -> None:
        """Slot slots[i] holds snapshots[i]'s tokens, each with room for `columns`."""
        self.store.reserve(max(slots) + 1, columns)
        self.store.restore(snapshots, slots)

    @staticmethod
    def pieces(tensor: torch.Tensor, rows: list[int]) -> list[torch.Tensor] | None:
        """The tensor's rows cut into pieces of rows[i] rows, each a copy of its own (an image's features, kept
        apart from its request's: app.engine.encoded_images), or None where the GPU has no room for them: an
        image not kept is only slower to come again."""
        try:
            return [piece.clone() for piece in tensor.split(rows)]
        except torch.cuda.OutOfMemoryError:
            pass
        torch.cuda.empty_cache()  # here, not in the handler, whose traceback still holds the failed copies
        return None

    @staticmethod
    def joined(parts: list[torch.Tensor]) -> torch.Tensor:
        """Rows of several parts as one tensor, in order: a wave's prefills' logits, or next input tokens."""
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def rows(self, tensor: torch.Tensor, index: list[int]) -> torch.Tensor:
        """tensor's rows index[0], index[1], ..., gathered on its device without waiting for the GPU."""
        return tensor.index_select(0, on_device(index, torch.long, tensor.device))

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """One step for slots [0, n) fed `tokens` [n]; next-token logits [n, vocab]."""
        logits = self.steps.run(tokens)
        self.store.lengths[:tokens.shape[0]] += 1
        return logits

    def choose(self, logits: torch.Tensor, rows: list, seen: list, barred: list[bool],
               generators: list | None = None) -> Choice:
        """Each row's next token from `logits` (app.model.sampling.choose), this model's end tokens barred
        where `barred`; a row with a generator (see `generator`) draws with it."""
        return choose(logits, rows, seen, barred, self._end_tokens, generators)

    def generator(self, seed: int) -> torch.Generator:
        """A reply's own random draws on this device, repeatable from `seed`."""
        return torch.Generator(device=self.device).manual_seed(seed % 2**64)

    def tokens_on_device(self, tokens: list[int]) -> torch.Tensor:
        return on_device(tokens, torch.long, self.device)

    def move(self, sources: list[int], targets: list[int], columns: int) -> None:
        """Slot sources[i] into slot targets[i], for every i, each holding at most `columns` tokens (SlotStore.move)."""
        self.store.move(sources, targets, columns)

    def warm_up_shapes(self, max_rows: int, token_budget: int) -> list[tuple[int, int]]:
        """Run every shape the scheduler can use once, so that kernels built per shape (Triton's, on
        CUDA) are ready before users come: prefill waves of 1, 2, 4... rows at padded lengths filling
        each quarter of `token_budget`, then the captured decode step of each batch bucket up to the
        wave's rows. Uses the slots freely, then leaves the store reserved for `max_rows` (see
        _reserve_batch). Returns the (rows, length) prefill shapes run."""
        with self.serving():  # where the scheduler uses the store next: no wait between streams
            return self._warm_up_shapes(max_rows, token_budget)

    def _warm_up_shapes(self, max_rows: int, token_budget: int) -> list[tuple[int, int]]:
        multiple = tuning.PREFILL_LENGTH_MULTIPLE
        shapes, rows = [], 1
        while rows <= max_rows and rows * multiple <= token_budget:
            lengths = {max(multiple, token_budget * quarter // 4 // rows // multiple * multiple) for quarter in range(1, 5)}
            if rows == 1:  # a prompt alone is not padded: lengths off the multiple too
                lengths |= {length - 1 for length in lengths}
            for length in sorted(lengths):
                prompt = torch.randint(0, self.model.get_input_embeddings().num_embeddings, (1, length))
                # Several rows: one shorter, so the wave runs with padding and masks, as in service.
                prompts = [(prompt, None, None)] * rows
                if rows > 1:
                    prompts[0] = (prompt[:, 1:], None, None)
                self.prefill(prompts, 0, length + 1)
                shapes.append((rows, length))
            self.steps.capture_all(rows, above=rows // 2)
            self.release()
            rows *= 2
        self._reserve_batch(max_rows)
        return shapes

    def _reserve_batch(self, max_rows: int) -> None:
        """Take the store's slots for a whole batch now, and capture the decode step of every bucket (and
        the prefills of few tokens).

        Else the store grows with the batch in service, and each growth moves its tensors and so
        recaptures the decode step of each bucket met next (about 0.1 s each, every stream stalled):
        33 recaptures in one benchmark run on an H200. Columns still grow for long requests.
        """
        self.prefill([(torch.zeros((1, 1), dtype=torch.long), None, None)], 0, tuning.RESERVED_COLUMNS)  # every layer's state
        columns = self._reserved_columns(max_rows)
        if self.continues:  # a wave too large for a captured continued prefill goes on packed: its kernels built now
            rows, length = min(max_rows, 8), max(CONTINUED_GRAPH_LENGTHS[8]) + 64  # past 8 prompts' captured lengths
            self.prefill_continued([(torch.zeros((1, length), dtype=torch.long), None)] * rows, [1] * rows,
                                   list(range(rows)), columns)
        self.store.reserve(max_rows, columns)
        self.steps.capture_all(max_rows)
        self.text.capture(max_rows)

    def _reserved_columns(self, max_rows: int) -> int:
        """Columns to reserve for each of `max_rows` slots: RESERVED_COLUMNS, doubled up to
        RESERVED_COLUMNS_MAX while their keys and values stay within RESERVED_COLUMNS_SHARE of the card, where
        the decode step reads only each request's own columns (more costs memory, not reading; and spares a
        conversation past RESERVED_COLUMNS' growing the store, which captures every graph again: docs/DECISIONS.md D46)."""
        columns, column_bytes = tuning.RESERVED_COLUMNS, self.store.column_bytes() * max_rows
        if self.text.reads_every_column or self.device.type != "cuda" or not column_bytes:
            return columns
        budget = tuning.RESERVED_COLUMNS_SHARE * torch.cuda.get_device_properties(self.device).total_memory
        while columns * 2 <= tuning.RESERVED_COLUMNS_MAX and column_bytes * columns * 2 <= budget:
            columns *= 2
        return columns

    def release(self) -> None:
        self.store.release()
        self.steps.clear()
        self.text.clear()

    def close(self) -> None:
        """The model is being unloaded: wait for a wave's media launch in progress, and end its thread."""
        self.streams.close()

    @staticmethod
    def after_error(error: Exception) -> bool:
        """After `error`, if the GPU ran out of memory: what the allocator keeps cached goes back to the card.
        Whether it had (the caller lets go of what it keeps on the GPU too)."""
        if isinstance(error, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
            return True
        return False
