"""Every limit a user can meet, in one place (the messages that name them are in app.messages, the engine's
tuning knobs in app.tuning).

Each limit named in FROM_ENVIRONMENT can be changed without code through its MINICPMV_<NAME> variable:
app.config.apply_environment reads them when a process starts, never at import.
"""

# Uploads.
MAX_UPLOAD_MB = 200  # any one file; Gradio refuses larger uploads before they land
# Gradio keeps every upload as a new file: app.web.uploads deletes those older than this, checking this often.
# A conversation older than the age loses its images (its follow-ups then say the file could not be read).
UPLOAD_MAX_AGE_S = 2 * 3600
UPLOAD_CLEAN_EVERY_S = 600
# The upload folder's total size (the examples cached at start included): past it app.web.uploads deletes the
# oldest uploads, within about a second of the upload that crossed it. 2,048 MB holds ten files at the
# 200 MB limit or about a thousand photos (more than a busy demo's two hours of uploads, which expire
# anyway), and still fits beside a model on a small disk (a Space has 50 GB). Keep it above MAX_UPLOAD_MB.
UPLOAD_MAX_TOTAL_MB = 2048
# An upload that sends nothing for this long is given up and its partial file deleted; otherwise a client
# that stalls mid-upload holds its part of the disk until the connection dies.
UPLOAD_STALL_TIMEOUT_S = 60.0
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".avi", ".mkv")
MAX_IMAGES_PER_REQUEST = 16
# PIL's own bomb guard only warns below 2x this; we refuse anything above it before decoding pixels.
MAX_IMAGE_PIXELS = 64_000_000
# A request's images together (what its preparer decodes at full size before they are cut: 3 bytes a pixel,
# 768 MB here): 16 photos of 16 megapixels, or 4 at MAX_IMAGE_PIXELS. Without it, 16 black 8000x8000 PNGs
# (3 MB sent) held 7.6 GB of one preparing process. A conversation past it goes on without its oldest images.
MAX_REQUEST_IMAGE_PIXELS = 256_000_000
# Long side over short side. The processor upscales a small image whole, its shape kept: a 1x65000 PNG
# of 339 bytes became one view of 32,640 patches, which the vision tower attends over as a whole
# (15-20 s of every user's streams on the CPU). Up to 100:1 no view of any size or slice count exceeds
# 1,300 patches (1,024 for a square).
MAX_IMAGE_ASPECT_RATIO = 100
# A PNG's chunks, counted from their headers before any decoder reads them: PIL keeps and walks each one in
# Python, and 16.6 M empty chunks (199 MB) held its opening 49 s and 2.9 GB. A 200 MB PNG cut into libpng's
# 8 KB pieces has about 25,000.
MAX_PNG_CHUNKS = 100_000

# Visual token budget (MiniCPM-V slicing: a 448-px source view plus slices of 64 tokens each). 9 slices
# (640 tokens for a 1344x1344 image) is the processor's default; the model card recommends up to 36 for
# documents, OCR and large photos, which the UI's "High detail" asks for with a budget to match.
DEFAULT_MAX_SLICE_NUMS = 9
MAX_SLICE_NUMS = 36
HIGH_DETAIL_SLICE_NUMS = 36
HIGH_DETAIL_VISUAL_TOKEN_BUDGET = 8192  # three images at 36 slices (2,368 tokens each)
DEFAULT_VISUAL_TOKEN_BUDGET = 2560
MAX_VISUAL_TOKEN_BUDGET = 16384
DOWNSAMPLE_MODES = ("16x", "4x")

# Video sampling: the model card's defaults, 1 frame a second, up to 128 frames, one slice a frame.
DEFAULT_VIDEO_FPS = 1.0
MAX_VIDEO_FPS = 10.0
DEFAULT_VIDEO_MAX_FRAMES = 128
MAX_VIDEO_FRAMES = 128
DEFAULT_VIDEO_SLICES_PER_FRAME = 1
MAX_VIDEO_SLICES_PER_FRAME = 9
MAX_VIDEO_SECONDS = 4 * 3600  # longer videos are sampled just as well; this bounds nonsense headers
# Frames to sample x pixels per frame (each frame is also held to MAX_IMAGE_PIXELS): the sampled frames'
# memory, 3 bytes a pixel (3 GiB at this default, which still lets a 3840x2160 video give 128 frames).
MAX_VIDEO_SAMPLED_PIXELS = 2**30
# A video the browser cannot play (mp4v, common from OpenCV and phone editors) gets a WebM copy for the player
# alone (app.media.playback), made in the web process: its first seconds, at a lower rate and size, and no more
# decoding than a minute of 720p at 30 fps. Each bound caps the cost: about 10 s of one core at most here.
BROWSER_COPY_MAX_SECONDS = 60
BROWSER_COPY_MAX_FPS = 15
BROWSER_COPY_MAX_PIXELS = 640 * 360  # per frame of the copy
BROWSER_COPY_MAX_DECODED_PIXELS = 60 * 30 * 1280 * 720

# Text.
MAX_PROMPT_CHARS = 20_000
MAX_CONTEXT_TOKENS = 32_768
DEFAULT_MAX_NEW_TOKENS = 1024
MIN_SAMPLING_TEMPERATURE = 0.01  # below it a reply is greedy in all but name
# Stop texts of one request (each is looked for in the reply's text as every token comes: app.engine.replies).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 200
# The cap on any reply's length (the UI's slider ends there; the API refuses more). The default length is
# --max-new-tokens (MINICPMV_MAX_NEW_TOKENS), a variable of its own: once one variable set both, and raising
# the default lowered the cap.
MAX_NEW_TOKENS_LIMIT = 8192

# Serving.
DEFAULT_QUEUE_SIZE = 64  # requests waiting while the batch is full; one more is told the demo is busy
DEFAULT_MAX_BATCH_SIZE = 256  # requests decoded together

# The OpenAI-compatible API (app.web.openai_api): a request's whole body, its images and videos in base64
# included (a 200 MB video is 267 MB of base64). Each file in it is also held to MAX_UPLOAD_MB.
MAX_API_REQUEST_MB = 300
# Images and videos in one API request, its conversation's earlier turns included. Each is written to the upload
# folder before the engine sees any (which keeps the latest MAX_IMAGES_PER_REQUEST): 100,000 tiny images in one
# body took 42 s to write, left 200,000 files behind, and slowed every later upload's cleanup.
MAX_API_MEDIA_PER_REQUEST = 64

# External OpenAI-compatible engine.
ENGINE_READ_TIMEOUT_S = 120.0  # longest silence between two streamed pieces
SWITCH_WAIT_S = 600.0  # how long a request waits for a model being switched in

# What an environment variable MINICPMV_<NAME> may set (app.config.apply_environment, at the start of
# every process), with the defaults above.
FROM_ENVIRONMENT = {name: globals()[name] for name in (
    "MAX_UPLOAD_MB",
    "UPLOAD_MAX_AGE_S",
    "UPLOAD_CLEAN_EVERY_S",
    "UPLOAD_MAX_TOTAL_MB",
    "UPLOAD_STALL_TIMEOUT_S",
    "MAX_IMAGES_PER_REQUEST",
    "MAX_IMAGE_PIXELS",
    "MAX_PNG_CHUNKS",
    "MAX_REQUEST_IMAGE_PIXELS",
    "MAX_IMAGE_ASPECT_RATIO",
    "MAX_VISUAL_TOKEN_BUDGET",
    "MAX_VIDEO_FPS",
    "MAX_VIDEO_FRAMES",
    "MAX_VIDEO_SECONDS",
    "MAX_VIDEO_SAMPLED_PIXELS",
    "MAX_PROMPT_CHARS",
    "MAX_CONTEXT_TOKENS",
    "MAX_NEW_TOKENS_LIMIT",
    "MAX_API_REQUEST_MB",
    "MAX_API_MEDIA_PER_REQUEST",
    "ENGINE_READ_TIMEOUT_S",
    "SWITCH_WAIT_S",
)}
