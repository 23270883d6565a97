"""A video that a kept conversation holds, prepared without decoding it.

A follow-up about a video repeats the video in its prompt, and the conversation's kept state
(app.engine.conversations) already holds what its frames gave, so the engine encodes none of them. Sampling
them again on a CPU core still cost every follow-up 0.34 s for a 16-second 720p clip and 3.4 s for two minutes
of it, where this takes 4 and 30 ms (docs/DECISIONS.md D70). Here such a video is matched by its file, its
settings and the frames its container header plans (app.media.video.planned_frames), and the processor is
handed the frames' sizes alone: the same placeholder tokens, no pixels. If the header misled the first
sampling (fewer frames read, another size), the planned frames do not match the kept ones, and the video is
decoded as before.

As for images (app.engine.inputs), never the last question's video: if another conversation held it, this
one would be prepared in a time that tells so. No torch at import, as everywhere in app.engine.
"""

from app.engine.conversations import video_key
from app.media.budget import image_slicing
from app.media.video import planned_frames


def held_video(processor, messages: list[dict], path: str, settings, kept_media: frozenset) -> "PlannedFrames | None":
    """The video processor's stand-in for the video of an earlier turn (`path`) if a kept conversation holds it
    (its key in `kept_media`) as its header plans it; else None, and the video is sampled."""
    video_processor = getattr(processor, "video_processor", None)
    if not kept_media or not PlannedFrames.plans(video_processor):
        return None
    if any(part["type"] == "video" for part in messages[-1]["content"]):
        return None
    shape = planned_frames(path, settings.video_fps, settings.video_max_frames)
    if video_key(path, shape, settings) not in kept_media:
        return None
    return PlannedFrames(video_processor, shape)


class PlannedFrames:
    """The video processor, as the processor calls it, for a video whose frames are not decoded: each frame's
    view sizes (in patches), grid and view count, by the video processor's own geometry for `shape`'s frames
    (frames, height, width: app.media.budget.image_slicing, which cuts a frame as an image is cut), and no pixels.
    Everything else is the video processor's own."""

    def __init__(self, video_processor, shape: tuple[int, int, int]):
        self._video_processor = video_processor
        self.shape = shape

    @staticmethod
    def plans(video_processor) -> bool:
        """Whether its frames' geometry is known here: MiniCPM-V 4.6's video processor as transformers ships its
        preprocessing and its resizing, each frame resized on its own (no sub-second frames stacked). 4.7 uses it
        too, but its prompts with media are never kept (their positions are its own: app.engine.inputs
        canvas_positions), so no video of theirs is held."""
        try:
            from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import MiniCPMV4_6VideoProcessor
        except ImportError:
            return False
        shipped = MiniCPMV4_6VideoProcessor
        return (isinstance(video_processor, shipped) and type(video_processor)._preprocess is shipped._preprocess
                and type(video_processor).resize_and_split_patches is shipped.resize_and_split_patches
                and bool(video_processor.do_resize) and (video_processor.stack_frames or 1) == 1)

    def __getattr__(self, name):
        if name == "_video_processor":  # not set yet: an object being copied or unpickled
            raise AttributeError(name)
        return getattr(self._video_processor, name)

    def __call__(self, videos, return_tensors=None, **kwargs):
        import torch
        from transformers.image_processing_utils import BatchFeature

        part = self._video_processor
        frames, height, width = self.shape
        slicing = image_slicing(part, height, width, kwargs.get("max_slice_nums") or part.max_slice_nums,
                                kwargs.get("downsample_mode") or part.downsample_mode)
        views, grid = slicing.views_in_patches(part.patch_size), slicing.grid
        return BatchFeature(
            data={"target_sizes_videos": torch.tensor(views * frames, dtype=torch.int32),
                  "grids_videos": torch.tensor([list(grid or (0, 0))] * frames, dtype=torch.int32),
                  "num_patches_per_frame": torch.tensor([len(views)] * frames, dtype=torch.int32),
                  "num_frames_per_video": [frames]},
            tensor_type=return_tensors,
            skip_tensor_conversion=["grids_videos", "num_patches_per_frame", "num_frames_per_video"])

    def stand_in(self):
        """What the processor is handed as the video's frames: it only counts the video."""
        import numpy as np

        return np.zeros((self.shape[0], 3, 1, 1), np.uint8)
