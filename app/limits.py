"""Every limit of the demo, in one place (the messages that name them are in app.messages).

Each limit can be changed without code through the environment variable named beside it.
"""

import os


def _limit(name: str, default):
    """The limit `default`, or the MINICPMV_<name> environment variable when set."""
    value = os.environ.get(f"MINICPMV_{name}")
    return type(default)(value) if value not in (None, "") else default


# Uploads.
MAX_UPLOAD_MB = _limit("MAX_UPLOAD_MB", 200)  # any one file; Gradio refuses larger uploads before they land
# Gradio keeps every upload as a new file: app.web.uploads deletes those older than this, checking this often.
# A conversation older than the age loses its images (its follow-ups then say the file could not be read).
UPLOAD_MAX_AGE_S = _limit("UPLOAD_MAX_AGE_S", 2 * 3600)
UPLOAD_CLEAN_EVERY_S = _limit("UPLOAD_CLEAN_EVERY_S", 600)
# The upload folder's total size (the examples cached at start included): past it app.web.uploads deletes the
# oldest uploads, within about a second of the upload that crossed it. 2,048 MB holds ten files at the
# 200 MB limit or about a thousand photos (more than a busy demo's two hours of uploads, which expire
# anyway), and still fits beside a model on a small disk (a Space has 50 GB). Keep it above MAX_UPLOAD_MB.
UPLOAD_MAX_TOTAL_MB = _limit("UPLOAD_MAX_TOTAL_MB", 2048)
# An upload that sends nothing for this long is given up and its partial file deleted; otherwise a client
# that stalls mid-upload holds its part of the disk until the connection dies.
UPLOAD_STALL_TIMEOUT_S = _limit("UPLOAD_STALL_TIMEOUT_S", 60.0)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".avi", ".mkv")
MAX_IMAGES_PER_REQUEST = _limit("MAX_IMAGES_PER_REQUEST", 16)
# PIL's own bomb guard only warns below 2x this; we refuse anything above it before decoding pixels.
MAX_IMAGE_PIXELS = _limit("MAX_IMAGE_PIXELS", 64_000_000)
# Long side over short side. The processor upscales a small image whole, its shape kept: a 1x65000 PNG
# of 339 bytes became one view of 32,640 patches, which the vision tower attends over as a whole
# (15-20 s of every user's streams on the CPU). Up to 100:1 no view of any size or slice count exceeds
# 1,300 patches (1,024 for a square).
MAX_IMAGE_ASPECT_RATIO = _limit("MAX_IMAGE_ASPECT_RATIO", 100)

# Visual token budget (MiniCPM-V slicing: a 448-px source view plus up to 9 slices of 64 tokens each).
DEFAULT_MAX_SLICE_NUMS = 9
MAX_SLICE_NUMS = 9
DEFAULT_VISUAL_TOKEN_BUDGET = 2560
MAX_VISUAL_TOKEN_BUDGET = _limit("MAX_VISUAL_TOKEN_BUDGET", 16384)
DOWNSAMPLE_MODES = ("16x", "4x")

# Video sampling.
DEFAULT_VIDEO_FPS = 1.0
MAX_VIDEO_FPS = _limit("MAX_VIDEO_FPS", 10.0)
DEFAULT_VIDEO_MAX_FRAMES = 64
MAX_VIDEO_FRAMES = _limit("MAX_VIDEO_FRAMES", 128)
DEFAULT_VIDEO_SLICES_PER_FRAME = 1
MAX_VIDEO_SECONDS = _limit("MAX_VIDEO_SECONDS", 4 * 3600)  # longer videos are sampled just as well; this bounds nonsense headers
# Frames to sample x pixels per frame (each frame is also held to MAX_IMAGE_PIXELS): the sampled frames'
# memory, 3 bytes a pixel (3 GiB at this default, which still lets a 3840x2160 video give 128 frames).
MAX_VIDEO_SAMPLED_PIXELS = _limit("MAX_VIDEO_SAMPLED_PIXELS", 2**30)

# Text.
MAX_PROMPT_CHARS = _limit("MAX_PROMPT_CHARS", 20_000)
MAX_CONTEXT_TOKENS = _limit("MAX_CONTEXT_TOKENS", 32_768)
DEFAULT_MAX_NEW_TOKENS = 1024
MIN_SAMPLING_TEMPERATURE = 0.01  # below it a reply is greedy in all but name
# The cap on any reply's length (the UI's slider ends there; the API refuses more). The default length is
# --max-new-tokens (MINICPMV_MAX_NEW_TOKENS), a variable of its own: once one variable set both, and raising
# the default lowered the cap.
MAX_NEW_TOKENS = _limit("MAX_NEW_TOKENS_LIMIT", 8192)

# Serving.
DEFAULT_QUEUE_SIZE = 64  # requests waiting while the batch is full; one more is told the demo is busy
DEFAULT_MAX_BATCH_SIZE = 256  # requests decoded together
# Generating requests that Gradio hands to the handlers at once beyond the engine's batch and wait line,
# so that a crowd arriving together reaches the engine's line and hears at once that the demo is busy
# (each such handler ends in milliseconds). Gradio's own queue, which held them and then turned the rest
# away with its "Queue is full", only waits past this many (and holds as many again, at most).
BUSY_HEADROOM = _limit("BUSY_HEADROOM", 256)
# Prompt tokens prefilled between two decode steps, padding included (requests in a wave x the longest
# prompt): a crowd arriving at once is admitted over several steps so that replies already running keep
# streaming.
PREFILL_TOKENS_PER_STEP = _limit("PREFILL_TOKENS_PER_STEP", 16384)
# Prefill shapes are kept to a few: waves of 1, 2, 4, 8... requests, prompts padded to a multiple of this
# many tokens (through transformers' layers; the fused text model packs prompts unpadded, and the budget
# above still counts them padded). On CUDA the linear-attention layers run Triton kernels that are
# compiled and tuned for each new shape they meet (seconds each): on an H200 a first crowd of 200 users
# spent 97% of its time there and got no answer in 18 s. The warm-up compiles every shape the engine can
# then use.
PREFILL_LENGTH_MULTIPLE = 64
# On CUDA the warm-up reserves the per-request state of a whole batch (--max-batch-size slots) for
# prompts and replies of up to this many tokens, so that the captured decode step is not captured again
# as the batch grows (longer ones grow it). About 19 MB + 12 KB per token per slot at the 4.6 shape:
# 7.9 GB for 256 slots. Attention in the decode step reads every reserved column, so not more.
RESERVED_COLUMNS = _limit("RESERVED_COLUMNS", 1024)
# 1: the text model runs as app.model.text.fused writes it (decode step and prefill) where the checkpoint
# allows; 0: through transformers' layers.
FUSED_TEXT_MODEL = _limit("FUSED_TEXT_MODEL", 1)
# 1: the vision tower runs as app.model.vision.fused writes it where the checkpoint allows; 0: through
# transformers' modules (tuned by app.model.vision.tower).
FUSED_VISION_TOWER = _limit("FUSED_VISION_TOWER", 1)
# 1: on CUDA a wave's media are encoded on a stream of their own while running replies decode
# (app.model.runner); 0: in the scheduler's turn, every reply waiting meanwhile.
MEDIA_ALONGSIDE_DECODING = _limit("MEDIA_ALONGSIDE_DECODING", 1)
# SMs that the vision tower's matrix products leave free while replies decode beside a wave (cuBLAS's SM
# carve-out, experimental in PyTorch): the products otherwise fill every SM, and decode steps wait. On an
# H200 at 200 users, 66 (half) gave 8-26% more tokens/s and a later first token (docs/DECISIONS.md D25):
# off by default, as a chat's users weigh the first token most.
VISION_SM_CARVEOUT = _limit("VISION_SM_CARVEOUT", 0)
STAGED_PIXELS_MB = _limit("STAGED_PIXELS_MB", 2048)  # waiting requests' pixels copied to the GPU ahead of their wave
WARM_UP_WAVES = (3, 16)  # requests sent together at warm-up (after one alone)
# How often Python hands the GIL from one thread to another in the app's serving processes (its default
# is 5 ms). A thread that gave the GIL up to wait (for the GPU, a pipe, a file write) gets it back only
# when the thread holding it is made to let go. In the engine's process the scheduler thread holds it
# while it launches kernels, and the threads taking each reply's tokens out waited: at 200 users on an
# H200 a first token's way from the scheduler to its consumer took 419-444 ms at p95 at 5 ms, 3.5-328
# ms at 0.5 ms (four runs; tokens/s did not change). In a web process Gradio writes an upload to disk
# chunk by chunk, each chunk through a thread: a 5.4 MB PNG's upload beside one busy thread took 235 ms
# at 5 ms and 72 at 0.5 (67 alone; dev machine). docs/DECISIONS.md D14.
SWITCH_INTERVAL_S = _limit("SWITCH_INTERVAL_S", 0.0005)
# A reply's stats say how long its preprocessing waited for a free preparer (a busy server) from this long.
PREPARATION_WAIT_SHOWN_MS = 50
PREPARE_CONCURRENCY = _limit("PREPARE_CONCURRENCY", 4)  # requests whose images are decoded and sliced at once
PREPARER_START_TIMEOUT_S = 300  # for every preparing worker process to load its processor at start
WEB_PROCESS_START_TIMEOUT_S = 300  # --web-processes: for each to import Gradio, build the UI and listen
# --web-processes: front processes (the proxy at the public address) when --front-processes is 0. The front
# spends about half a web process's CPU on an upload and carries every web process's traffic.
WEB_PROCESSES_PER_FRONT = 3
ENGINE_CONNECT_TIMEOUT_S = 600  # a web process waits this long for the engine process to listen (a model loading)
# A reply's text goes out at most this often (tokens in between are sent together): smooth to read,
# and hundreds of streams do not flood the server with one event per token.
STREAM_UPDATE_INTERVAL_S = _limit("STREAM_UPDATE_INTERVAL_S", 0.05)
# ...and all replies together at most about this many updates a second: each one is work for the web
# server's single Python process, which ran near a full core at 100-200 users through the app on an H200
# box while the GPU idled half the time. With 200 replies streaming, each is updated every 0.4 s.
STREAM_UPDATES_PER_S = _limit("STREAM_UPDATES_PER_S", 500)

# External OpenAI-compatible engine.
ENGINE_READ_TIMEOUT_S = _limit("ENGINE_READ_TIMEOUT_S", 120.0)  # longest silence between two streamed pieces
SWITCH_WAIT_S = _limit("SWITCH_WAIT_S", 600.0)  # how long a request waits for a model being switched in
PROFILE_GPU_MAX_S = 60.0  # ModelManager.profile_gpu's longest window: the profiler keeps every kernel in memory
