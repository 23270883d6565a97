"""The engine's and the servers' tuning knobs, each with the reason for its value (the measurements are in
docs/DECISIONS.md). Those named in FROM_ENVIRONMENT can be set through MINICPMV_<NAME>, read by
app.config.apply_environment when a process starts, never at import.
"""

# Generating requests that Gradio hands to the handlers at once beyond the engine's batch and wait line,
# so that a crowd arriving together reaches the engine's line and hears at once that the demo is busy
# (each such handler ends in milliseconds). Gradio's own queue, which held them and then turned the rest
# away with its "Queue is full", only waits past this many (and holds as many again, at most).
BUSY_HEADROOM = 256
# Prompt tokens prefilled between two decode steps, padding included (requests in a wave x the longest
# prompt): a crowd arriving at once is admitted over several steps so that replies already running keep
# streaming.
PREFILL_TOKENS_PER_STEP = 16384
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
# 7.9 GB for 256 slots. Through transformers' layers the decode step's attention reads every reserved
# column (the fused one reads each request's own), so not more.
RESERVED_COLUMNS = 1024
# Where the decode step reads only each request's own columns (the fused text model), the warm-up doubles the
# reserved columns, up to RESERVED_COLUMNS_MAX, while a whole batch's keys and values take at most this share of
# the GPU's memory: 4,096 on an H100 or H200 (12.9 GB for 256 slots), 2,048 for 256 slots on a 48 GB card. A
# conversation past them grows the store, which captures every graph again at its next use, each stalling every
# stream: a conversation about a photo with replies of 128 tokens passes 2,048 tokens within ten turns, a video's
# sooner (docs/DECISIONS.md D46, D49).
RESERVED_COLUMNS_SHARE = 0.16
RESERVED_COLUMNS_MAX = 4096
# 1: the text model runs as app.model.text.fused writes it (decode step and prefill) where the checkpoint
# allows; 0: through transformers' layers.
FUSED_TEXT_MODEL = 1
# 1: the fused text model's matrix products of one row (the decode step of a lone reply) run on CUDA through
# its own Triton GEMV, which streams the weights closer to the memory's speed than the kernels cuBLAS picks
# at these shapes (docs/DECISIONS.md D44); 0: cuBLAS always.
ONE_ROW_LINEAR = 1
# 1: a conversation's state is kept between its turns (app.engine.conversations), so that a follow-up
# prefills only what is new and its earlier images are not encoded again; 0: every prompt is prefilled
# whole. Kept states take at most CONVERSATION_CACHE_GB of GPU memory, the least recently used let go
# first: one conversation's, after a 1344x1344 image, is about 26 MB at the 4.6 shape (19 MB of DeltaNet
# state, 12 KB a token), and about 40 MB ten turns on. Left negative, the app sizes it: CONVERSATION_CACHE_SHARE
# of the GPU's memory (9.4 GB of an H100's 80, 16.9 of an H200's 141), 4 GB on the CPU. A fixed 4 GB held about
# 150 conversations' latest states, and 200 users of follow-ups let each other's go: 7,813 tokens/s and 3.2 s a
# reply at 200 users against 10,537 and 1.2 s at 100 on an H100 (docs/DECISIONS.md D42).
CONVERSATION_CACHE = 1
CONVERSATION_CACHE_GB = -1.0
CONVERSATION_CACHE_SHARE = 0.12
# A prompt is kept only where its last turn starts at least this many tokens in (visual tokens counted): keeping
# splits its prefill in two passes and copies its state out, which cost a wave about what prefilling 400-700
# tokens again costs. A single text question, or one with a 448x448 photo (64 visual tokens), is prefilled
# whole; a 1344x1344 photo's conversation (about 690 tokens) is kept from its first turn (docs/DECISIONS.md D48).
# A prompt with a video is kept whatever its length: its follow-ups would otherwise sample its frames again (D70).
CONVERSATION_CACHE_MIN_TOKENS = 512
# The visual features of earlier turns' images, kept once encoded, take at most this many MB of GPU memory
# (app.engine.encoded_images): a conversation whose kept state was let go, or that starts again from its first
# turn, neither decodes nor encodes its images again. A 1344x1344 image's are 1.3 MB at the 4.6 shape. 0: none
# kept (docs/DECISIONS.md D56).
ENCODED_IMAGES_MB = 1024
# 1: the vision tower runs as app.model.vision.fused writes it where the checkpoint allows; 0: through
# transformers' modules (tuned by app.model.vision.tower).
FUSED_VISION_TOWER = 1
# 1: on CUDA a wave's media are encoded on a stream of their own while running replies decode
# (app.model.runner); 0: in the scheduler's turn, every reply waiting meanwhile.
MEDIA_ALONGSIDE_DECODING = 1
# SMs that the vision tower's matrix products leave free while replies decode beside a wave (cuBLAS's SM
# carve-out, experimental in PyTorch): the products otherwise fill every SM, and decode steps wait. On an
# H200 at 200 users, 66 (half) gave 8-26% more tokens/s and a later first token (docs/DECISIONS.md D25):
# off by default, as a chat's users weigh the first token most.
VISION_SM_CARVEOUT = 0
STAGED_PIXELS_MB = 2048  # waiting requests' pixels copied to the GPU ahead of their wave
# 1: on CUDA, where torchvision decodes JPEGs on the GPU (tried once as the model loads), a request's images are
# prepared without their slices, which the engine makes on the GPU as it stages them (the processor's resize and
# cut: app.model.jpegs), from the JPEGs' files (nvJPEG) and the other images' pixels their preparer decoded (up to
# app.engine.jpegs_on_device.DECODED_PIXELS_MAX_BYTES a request; past it, the preparer slices them).
# Preparing a 1344x1344 JPEG on a CPU core was most of a lone request's first token on an H200 (docs/DECISIONS.md
# D43). 0: preparers decode and slice every image.
JPEG_ON_DEVICE = 1
WARM_UP_WAVES = (3, 16)  # requests sent together at warm-up (after one alone)
# On CUDA, larger waves too: the first waves of 32 and 64 small photos met shapes nothing had run yet, and on an
# H100 the first 50 users of 448x448 photos waited up to a second for them (first token p95 988 ms, 107 ms once
# run; docs/DECISIONS.md D48). About 4 s more of warm-up there.
WARM_UP_WAVES_ON_CUDA = (32, 64)
# How often Python hands the GIL from one thread to another in the app's serving processes (its default
# is 5 ms). A thread that gave the GIL up to wait (for the GPU, a pipe, a file write) gets it back only
# when the thread holding it is made to let go. In the engine's process the scheduler thread holds it
# while it launches kernels, and the threads taking each reply's tokens out waited: at 200 users on an
# H200 a first token's way from the scheduler to its consumer took 419-444 ms at p95 at 5 ms, 3.5-328
# ms at 0.5 ms (four runs; tokens/s did not change). In a web process Gradio writes an upload to disk
# chunk by chunk, each chunk through a thread: a 5.4 MB PNG's upload beside one busy thread took 235 ms
# at 5 ms and 72 at 0.5 (67 alone; dev machine). docs/DECISIONS.md D14.
SWITCH_INTERVAL_S = 0.0005
# A reply's stats say how long its preprocessing waited for a free preparer (a busy server) from this long.
PREPARATION_WAIT_SHOWN_MS = 50
PREPARE_CONCURRENCY = 4  # requests whose images are decoded and sliced at once
# A preparing worker process keeps up to this many MB of freed memory for its next request, rather than
# handing it back and faulting it in again: glibc returned a PNG's file bytes and pixels after each one,
# 4.6 of 39 ms of a 1344x1344 noise PNG's preparation on a dev core (docs/DECISIONS.md D54). 0: glibc's own
# thresholds.
PREPARER_HELD_MEMORY_MB = 64
# Threads FFmpeg decodes a video with (OpenCV's CAP_PROP_N_THREADS; 0: one a core). A video is sampled by seeking
# to each frame, and every seek drains and refills a frame-threaded decoder: the video-16 workload's 16 seeks took
# 37 ms with one thread, 69 with two and 124 with 16 on the 2-core dev machine, and preparing workers decode side
# by side (docs/DECISIONS.md D69).
VIDEO_DECODE_THREADS = 1
PREPARER_START_TIMEOUT_S = 300  # for every preparing worker process to load its processor at start
WEB_PROCESS_START_TIMEOUT_S = 300  # --web-processes: for each to import Gradio, build the UI and listen
# --web-processes: front processes (the proxy at the public address) when --front-processes is 0. The front
# spends about half a web process's CPU on an upload and carries every web process's traffic.
WEB_PROCESSES_PER_FRONT = 3
ENGINE_CONNECT_TIMEOUT_S = 600  # a web process waits this long for the engine process to listen (a model loading)
# A reply's text goes out at most this often (tokens in between are sent together): smooth to read,
# and hundreds of streams do not flood the server with one event per token.
STREAM_UPDATE_INTERVAL_S = 0.05
# ...and all replies together at most about this many updates a second: each one is work for the web
# server's single Python process, which ran near a full core at 100-200 users through the app on an H200
# box while the GPU idled half the time. With 200 replies streaming, each is updated every 0.4 s.
STREAM_UPDATES_PER_S = 500
# The chat page renders a reply's whole Markdown again at every update: with lists, code and tables a 12 KB
# reply cost the browser's main thread 30-110 ms an update, and one updated every 50 ms kept it busy for 24 s
# of its 29 (a click waited up to 1.2 s). So a reply's updates to the page are at least len(text) / this
# many seconds apart (12 KB: 0.5 s) and at most CHAT_UPDATE_MAX_INTERVAL_S (docs/DECISIONS.md D41).
CHAT_UPDATE_CHARS_PER_S = 25_000
CHAT_UPDATE_MAX_INTERVAL_S = 1.0
# The engine samples its load this often into the history behind the Server load panel's charts, which
# show the last LOAD_HISTORY_S; the open panel refreshes as often. Every web process's open panels poll
# the one history in the engine (app.engine.metrics): 120 samples, one engine call a panel a refresh.
LOAD_SAMPLE_S = 5.0
LOAD_HISTORY_S = 600.0
# Each sample's first-token p50 and p95 are of the first tokens of this last while: a lone request shows as a
# stretch of line, not as one point (which a line chart does not draw).
LOAD_FIRST_TOKEN_WINDOW_S = 60.0
# The previews of what the model will see (app.ui.previews) run in the web process: each decodes thumbnails,
# a video's sampled frames, or makes a video's browser copy (app.media.playback: up to about 10 s of a core).
# A few at once, of images and of videos each, keep one long video from holding up everyone's previews, and
# a crowd of uploads from taking every core of the box.
PREVIEWS_AT_ONCE = 4
# The OpenAI-compatible API reads this many requests at once on worker threads (JSON parsed, base64 images and
# videos decoded and written: a 270 MB body is about a second of a core), so that a flood of large bodies
# leaves the other cores to the replies in progress; the rest wait their turn.
API_REQUESTS_READ_AT_ONCE = 4
PROFILE_GPU_MAX_S = 60.0  # ModelManager.profile_gpu's longest window: the profiler keeps every kernel in memory

# What an environment variable MINICPMV_<NAME> may set (app.config.apply_environment, at the start of
# every process), with the defaults above.
FROM_ENVIRONMENT = {name: globals()[name] for name in (
    "BUSY_HEADROOM",
    "PREFILL_TOKENS_PER_STEP",
    "RESERVED_COLUMNS",
    "RESERVED_COLUMNS_SHARE",
    "RESERVED_COLUMNS_MAX",
    "FUSED_TEXT_MODEL",
    "ONE_ROW_LINEAR",
    "CONVERSATION_CACHE",
    "CONVERSATION_CACHE_GB",
    "CONVERSATION_CACHE_SHARE",
    "CONVERSATION_CACHE_MIN_TOKENS",
    "ENCODED_IMAGES_MB",
    "FUSED_VISION_TOWER",
    "MEDIA_ALONGSIDE_DECODING",
    "VISION_SM_CARVEOUT",
    "STAGED_PIXELS_MB",
    "JPEG_ON_DEVICE",
    "SWITCH_INTERVAL_S",
    "PREPARE_CONCURRENCY",
    "PREPARER_HELD_MEMORY_MB",
    "VIDEO_DECODE_THREADS",
    "STREAM_UPDATE_INTERVAL_S",
    "STREAM_UPDATES_PER_S",
    "CHAT_UPDATE_CHARS_PER_S",
    "LOAD_SAMPLE_S",
)}
