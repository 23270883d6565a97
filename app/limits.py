"""Every limit of the demo and every message a user can see, in one place.

Each limit can be changed without code through the environment variable named beside it.
"""

import os


def _limit(name: str, default):
    """The limit `default`, or the MINICPMV_<name> environment variable when set."""
    value = os.environ.get(f"MINICPMV_{name}")
    return type(default)(value) if value not in (None, "") else default


# Uploads.
MAX_UPLOAD_MB = _limit("MAX_UPLOAD_MB", 200)  # any one file; Gradio refuses larger uploads before they land
# Gradio keeps every upload as a new file: app.uploads deletes those older than this, checking this often.
# A conversation older than the age loses its images (its follow-ups then say the file could not be read).
UPLOAD_MAX_AGE_S = _limit("UPLOAD_MAX_AGE_S", 2 * 3600)
UPLOAD_CLEAN_EVERY_S = _limit("UPLOAD_CLEAN_EVERY_S", 600)
# The upload folder's total size (the examples cached at start included): past it app.uploads deletes the
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
MAX_NEW_TOKENS = _limit("MAX_NEW_TOKENS", 8192)

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
# 1: the text model runs as app.engine.fused_text writes it (decode step and prefill) where the checkpoint
# allows; 0: through transformers' layers.
FUSED_TEXT_MODEL = _limit("FUSED_TEXT_MODEL", 1)
# 1: the vision tower runs as app.engine.fused_vision writes it where the checkpoint allows; 0: through
# transformers' modules (tuned by app.engine.vision_tower).
FUSED_VISION_TOWER = _limit("FUSED_VISION_TOWER", 1)
# 1: on CUDA a wave's media are encoded on a stream of their own while running replies decode
# (app.engine.batch_runner); 0: in the scheduler's turn, every reply waiting meanwhile.
MEDIA_ALONGSIDE_DECODING = _limit("MEDIA_ALONGSIDE_DECODING", 1)
# SMs that the vision tower's matrix products leave free while replies decode beside a wave (cuBLAS's SM
# carve-out, experimental in PyTorch): the products otherwise fill every SM, and decode steps wait. On an
# H200 at 200 users, 66 (half) gave 8-26% more tokens/s and a later first token (benchmarks/RESULTS.md):
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
# at 5 ms and 72 at 0.5 (67 alone; dev machine). benchmarks/RESULTS.md, "Night run (2026-12-01, 20:27
# UTC)" and "Uploads beside busy threads".
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

# User-facing messages.
MSG_EMPTY_REQUEST = "Type a question or attach an image or video first."
MSG_UNSUPPORTED_FILE = "“{name}” is not a supported file. Images: {images}. Videos: {videos}."
MSG_NOT_AN_UPLOAD = "“{name}” was not uploaded to this app: send files themselves, not links or server paths."
MSG_UNREADABLE_IMAGE = "“{name}” could not be read as an image (the file is corrupt, truncated or not an image)."
MSG_IMAGE_TOO_THIN = ("“{name}” is {width}x{height} pixels, longer than {limit} times its width or height. "
                      "Crop it, or pad it to a less extreme shape.")
MSG_IMAGE_TOO_LARGE = "“{name}” has more than {limit:,} pixels. Please downscale it."
MSG_TOO_MANY_IMAGES = "{count} images in one request; the limit is {limit}."
MSG_ONE_VIDEO = "Send one video at a time, without images beside it."
MSG_VIDEO_TOO_LONG = "“{name}” is {seconds:,.0f} s long; the limit is {limit:,} s."
MSG_UNREADABLE_VIDEO = "“{name}” could not be decoded as a video."
MSG_EMPTY_VIDEO = "“{name}” has no frames that could be decoded."
MSG_VIDEO_FRAME_TOO_LARGE = "“{name}” has frames of {width}x{height} pixels, more than {limit:,}. Please downscale it."
MSG_VIDEO_SAMPLED_TOO_LARGE = (
    "{frames} frames of {width}x{height} pixels from “{name}” are more than {limit:,} pixels in all. "
    "Lower “Max frames” or downscale the video."
)
MSG_VIDEO_FRAMES_MISSING = "Only {read} of the {planned} planned frames of “{name}” could be read."
MSG_NOT_TEXT = "The message holds a character that is not valid text (a lone surrogate, at character {position:,}); please type it again."
MSG_PROMPT_TOO_LONG = "The message is {count:,} characters; the limit is {limit:,}."
MSG_CONTEXT_TOO_LONG = (
    "This request needs {count:,} tokens (text, images and the reply), over the {limit:,}-token context. "
    "Start a new conversation, attach fewer images, or lower the slices or max new tokens."
)
MSG_OVER_VISUAL_BUDGET = (
    "{count} images need at least {needed:,} visual tokens even at 1 slice each, over the {budget:,}-token "
    "visual budget. Raise the budget or send fewer images."
)
MSG_BAD_SETTING = "Setting “{key}”: {problem}"
MSG_SETTINGS_NOT_OBJECT = "settings must be a JSON object such as {\"max_new_tokens\": 256}."
MSG_UNKNOWN_SETTING = "Unknown setting “{key}”. Known settings: {known}."
MSG_MEDIA_TRIMMED = ("The {count} oldest messages were left out so that the conversation holds at most {limit} images, "
                     "or one video alone.")
MSG_CONTEXT_TRIMMED = "The {count} oldest messages were left out so that the conversation fits the {limit:,}-token context."
MSG_BUSY = "The demo is busy: {waiting} requests are already waiting. Please try again in a minute."
MSG_WAITING = "⏳ Every place in the batch is taken; waiting for one to free up, {ahead} request(s) ahead of yours…"
MSG_ENGINE_DOWN = "The model server at {url} is not reachable. It may be starting or down; try again shortly."
MSG_ENGINE_SLOW = "The model server at {url} sent nothing for {seconds:.0f} s; try again shortly."
MSG_ENGINE_BROKE = "The model server at {url} stopped answering in the middle of the reply; try again."
MSG_ENGINE_REFUSED = "The model server refused the request (HTTP {status}): {detail}"
MSG_COSTS_ON_SERVER = "Visual token costs are counted by the model server and are not known here."
SWITCH_WAIT_S = _limit("SWITCH_WAIT_S", 600.0)  # how long a request waits for a model being switched in
MSG_SWITCHING = "The model is being switched and is not ready yet; try again in a minute."
MSG_ENGINE_PROCESS_LOST = "The model's process stopped in the middle of this reply; it is being restarted. Try again in a minute."
MSG_WEB_PROCESS_DOWN = "This part of the demo is restarting; reload the page in a few seconds."
MSG_ENGINE_PROCESS_DOWN = "The model's process is not running and could not be restarted; see the server's log."
MSG_SWITCH_FAILED = "Could not load “{model}” ({error}). Still serving “{current}”."
MSG_SWITCH_OFF = "Switching models is off; start the app with --allow-model-switch to allow it."
PROFILE_GPU_MAX_S = 60.0  # ModelManager.profile_gpu's longest window: the profiler keeps every kernel in memory
MSG_PROFILE_NEEDS_CUDA = "Profiling the GPU needs a CUDA GPU; this engine runs on the CPU."
MSG_PROFILE_SECONDS = "A GPU profile's window is more than 0 and at most {max:.0f} seconds."
MSG_MODEL_TYPE_NOT_SERVED = (
    "This app's engine does not serve model type “{model_type}” yet ({reason}): serve it with an engine "
    "that does (vLLM, SGLang, Ollama or transformers serve) and start this app with --backend openai "
    "(see the README's recipes)."
)
MSG_TRANSFORMERS_TOO_OLD = (
    "The installed transformers {installed} cannot read “{model}” (model type “{model_type}”){needed}. "
    "Upgrade transformers (pip install -U transformers) or pick another checkpoint."
)
MSG_QUANT_PACKAGES_MISSING = (
    "This checkpoint is quantized ({method}) and needs {packages}: pip install --no-deps -r requirements-quant.txt"
)
MSG_4BIT_NEEDS_CUDA = "--load-in-4bit needs a CUDA GPU: bitsandbytes' 4-bit kernels run there."
MSG_4BIT_NEEDS_BITSANDBYTES = "--load-in-4bit needs bitsandbytes: pip install bitsandbytes"
MSG_4BIT_ALREADY_QUANTIZED = "{model} is already quantized ({method}): load it without --load-in-4bit."
MSG_SAMPLING_FAILED = ("This reply could not go on: the model's probabilities for its next word were not finite "
                       "numbers. Try again, or with other decoding settings.")
MSG_OUT_OF_MEMORY = "The GPU ran out of memory for this request. Try fewer images, fewer slices or a shorter reply."
MSG_GENERATION_FAILED = "Generation failed: {error}"
MSG_MULTI_IMAGE_NEEDS_IMAGES = "Add at least one image to the gallery first."
MSG_VIDEO_NEEDS_VIDEO = "Upload a video first."
MSG_RANDOM_WEIGHTS = (
    "⚠️ **Random weights.** This is the tiny random-weight MiniCPM-V 4.6 built for tests: replies are "
    "meaningless tokens. Start with `--model openbmb/MiniCPM-V-4.6` for real answers."
)
MSG_SHARE_WITHOUT_AUTH = (
    "\n" + "!" * 78 + "\n"
    "!! --share without --auth: anyone who gets the share link can use this demo, your GPU and every\n"
    "!! upload. Protect it with --auth USER:PASSWORD (or MINICPMV_AUTH=USER:PASSWORD).\n" + "!" * 78
)
MSG_MODEL_UNAVAILABLE = (
    "Cannot load “{model}”: it is not a local folder and could not be fetched from the Hugging Face Hub "
    "({reason}). Pass a local checkpoint folder with --model PATH, or try the demo offline with --model tiny-random."
)
