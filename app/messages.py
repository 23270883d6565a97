"""Every message a user can see, in one place (the limits they name are in app.limits)."""

MSG_EMPTY_REQUEST = "Type a question or attach an image or video first."
MSG_EMPTY_CHAT = "Type a question or attach an image first."  # the Chat tab takes images (videos: the Video tab)
MSG_EMPTY_QUESTION = "Type a question first."
MSG_STOPPED = "■ Stopped"  # marks a stopped reply (its stats line starts with it)
MSG_UNSUPPORTED_FILE = "“{name}” is not a supported file. Images: {images}. Videos: {videos}."
MSG_UPLOAD_GONE = "“{name}” is no longer on the server (uploads are deleted after a while): please attach it again."
MSG_NOT_AN_UPLOAD = "“{name}” was not uploaded to this app: send files themselves, not links or server paths."
MSG_FILE_TOO_LARGE = "“{name}” is {size_mb:,.1f} MB; the limit is {limit:,} MB."
# The MCP tools' files (app.ui.inline_files): base64, or the path of an upload.
MSG_INLINE_LINK = ("“{name}” is a link, and this app never fetches links: send the file itself as base64 (or a data: "
                   "URL), or upload it (POST /gradio_api/upload) and send the path that returns.")
MSG_INLINE_NOT_A_FILE = ("“{name}” is neither base64 data (or a data: URL) nor the path of a file uploaded to this app "
                         "(POST /gradio_api/upload).")
MSG_INLINE_WRONG_KIND = "“{name}” is {found}, and {tool} takes {wanted}: use {other} for it."
MSG_INLINE_NO_IMAGES = "Send at least one image."
MSG_UNREADABLE_IMAGE = "“{name}” could not be read as an image (the file is corrupt, truncated or not an image)."
MSG_IMAGE_TOO_THIN = ("“{name}” is {width}x{height} pixels, longer than {limit} times its width or height. "
                      "Crop it, or pad it to a less extreme shape.")
MSG_IMAGE_TOO_LARGE = "“{name}” has more than {limit:,} pixels. Please downscale it."
MSG_TOO_MANY_IMAGES = "{count} images in one request; the limit is {limit}."
MSG_ONE_VIDEO = "Send one video at a time, without images beside it."
MSG_IMAGES_TOO_LARGE_TOGETHER = ("These images have {pixels:,} pixels together; the limit for one request is {limit:,}. "
                                 "Please send fewer or smaller images.")
MSG_VIDEO_TOO_LONG = "“{name}” is {seconds:,.0f} s long; the limit is {limit:,} s."
MSG_UNREADABLE_VIDEO = "“{name}” could not be decoded as a video."
MSG_EMPTY_VIDEO = "“{name}” has no frames that could be decoded."
MSG_VIDEO_FRAME_TOO_LARGE = "“{name}” has frames of {width}x{height} pixels, more than {limit:,}. Please downscale it."
MSG_VIDEO_SAMPLED_TOO_LARGE = (
    "{frames} frames of {width}x{height} pixels from “{name}” are more than {limit:,} pixels in all. "
    "Lower “Max frames” or downscale the video."
)
MSG_VIDEO_FRAMES_MISSING = "Only {read} of the {planned} planned frames of “{name}” could be read."
MSG_VIDEO_FRAME_SIZES = "“{name}” changes its frame size midway; its frames were scaled to the first one's size."
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
MSG_NOTHING_TO_FOLLOW_UP = "follow_up: this client had no earlier /ask conversation to go on with, so this question starts one."
MSG_NOT_FILES = "{label} must be a list of uploaded files (with gradio_client: [handle_file(path), ...]); {what}."
MSG_TOO_FEW_VALUES = "Too few values: this call takes {count} ({names})."
MSG_NOT_TAKEN = "{label} cannot take the value {value}."
MSG_UNKNOWN_EVENT = "This app has no such event: see /gradio_api/info, or the page's \"Use via API\" link, for those it has."
MSG_UNKNOWN_SETTING = "Unknown setting “{key}”. Known settings: {known}."
MSG_MEDIA_TRIMMED = ("The {count} oldest messages were left out so that the conversation holds at most {limit} images "
                     "of {pixels:,} pixels together, or one video alone.")
MSG_CONTEXT_TRIMMED = "The {count} oldest messages were left out so that the conversation fits the {limit:,}-token context."
MSG_BUSY = "The demo is busy: {waiting} requests are already waiting. Please try again in a minute."
MSG_WAITING = "⏳ Every place in the batch is taken; waiting for one to free up, {ahead} request(s) ahead of yours…"
MSG_ENGINE_DOWN = "The model server at {url} is not reachable. It may be starting or down; try again shortly."
MSG_ENGINE_SLOW = "The model server at {url} sent nothing for {seconds:.0f} s; try again shortly."
MSG_ENGINE_BROKE = "The model server at {url} stopped answering in the middle of the reply; try again."
MSG_ENGINE_REFUSED = "The model server refused the request (HTTP {status}): {detail}"
MSG_COSTS_ON_SERVER = "Visual token costs are counted by the model server and are not known here."
MSG_SWITCHING = "The model is being switched and is not ready yet; try again in a minute."
MSG_PREPARER_LOST = ("The process that was reading this request's files stopped unexpectedly; it has been restarted. "
                     "Send the request again: if it fails the same way, one of its files is the likely cause.")
MSG_ENGINE_PROCESS_LOST = "The model's process stopped in the middle of this reply; it is being restarted. Try again in a minute."
MSG_WEB_PROCESS_DOWN = "This part of the demo is restarting; reload the page in a few seconds."
MSG_ENGINE_PROCESS_DOWN = "The model's process is not running and could not be restarted; see the server's log."
MSG_SWITCH_FAILED = "Could not load “{model}” ({error}). Still serving “{current}”."
MSG_SWITCH_OFF = "Switching models is off; start the app with --allow-model-switch to allow it."
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
MSG_BNB_NEEDS_CUDA = "This checkpoint is quantized (bitsandbytes) and needs a CUDA GPU: bitsandbytes' 4-bit kernels run there."
MSG_BNB_NEEDS_BITSANDBYTES = "This checkpoint is quantized (bitsandbytes) and needs bitsandbytes: pip install bitsandbytes"
MSG_4BIT_NEEDS_CUDA = "--load-in-4bit needs a CUDA GPU: bitsandbytes' 4-bit kernels run there."
MSG_4BIT_NEEDS_BITSANDBYTES = "--load-in-4bit needs bitsandbytes: pip install bitsandbytes"
MSG_4BIT_ALREADY_QUANTIZED = "{model} is already quantized ({method}): load it without --load-in-4bit."
MSG_SAMPLING_FAILED = ("This reply could not go on: the model's probabilities for its next word were not finite "
                       "numbers. Try again, or with other decoding settings.")
MSG_OUT_OF_MEMORY = "The GPU ran out of memory for this request. Try fewer images, fewer slices or a shorter reply."
MSG_GENERATION_FAILED = "Generation failed: {error}"
MSG_MULTI_IMAGE_NEEDS_IMAGES = "Add at least one image to the gallery first."
MSG_VIDEO_NEEDS_VIDEO = "Upload a video first."
MSG_MULTI_IMAGE_HINT = "Add two or more images, then ask about them together."
MSG_VIDEO_HINT = "Upload a video (mp4, webm, mov, avi or mkv), then ask about it."
MSG_VIDEO_SAMPLING = "{seconds:.1f} s at {fps:.1f} fps ({total:,} frames): **{count}** frames will be sampled."
MSG_VIDEO_NOT_PLAYABLE = ("Browsers cannot play this file's video codec ({codec}): a copy for the player is being "
                          "made. The model reads your file.")
MSG_VIDEO_BROWSER_COPY = ("The player shows a copy made for the browser (WebM, at most the first {seconds} s, at up "
                          "to {fps} frames a second). The model reads your file.")
MSG_VIDEO_NO_BROWSER_COPY = ("Browsers cannot play this file's video codec ({codec}), and no copy could be made for "
                             "the player. The model reads your file: the frames below are what it sees.")
MSG_RANDOM_WEIGHTS = "⚠️ **Random weights:** replies are noise. For real answers: `--model openbmb/MiniCPM-V-4.6`"
MSG_SETTINGS = "Settings"  # the settings sidebar's name, on the control that opens it
MSG_NO_GPU = "GPU memory: no GPU"
MSG_SHARE_WITHOUT_AUTH = (
    "\n" + "!" * 78 + "\n"
    "!! --share without --auth: anyone who gets the share link can use this demo, your GPU and every\n"
    "!! upload. Protect it with --auth USER:PASSWORD (or MINICPMV_AUTH=USER:PASSWORD).\n" + "!" * 78
)
MSG_SHARE_API_OPEN = (
    "\n" + "!" * 78 + "\n"
    "!! --share without --api-key: anyone who gets the share link can use the OpenAI-compatible API at\n"
    "!! /v1, and your GPU through it. Protect it with --api-key KEY (or MINICPMV_API_KEY=KEY).\n" + "!" * 78
)
# The OpenAI-compatible API (app.web.openai_api): what a client is told beyond the UI's own messages.
MSG_API_KEY_NOT_SET = ("This server's OpenAI-compatible API needs a key (it runs with --auth, or listens beyond this "
                       "machine) and has none: start it with --api-key KEY (or MINICPMV_API_KEY=KEY), then send "
                       "the header “Authorization: Bearer KEY”.")
MSG_API_KEY_MISSING = "Send this server's API key in the header “Authorization: Bearer KEY”."
MSG_API_KEY_WRONG = "Incorrect API key."
MSG_API_NOT_FOUND = "{method} {path} is not an endpoint of this server: it serves GET /v1/models and POST /v1/chat/completions."
MSG_API_MODEL_NOT_FOUND = "The model “{model}” is not served here; this server serves “{served}” (see GET /v1/models)."
MSG_API_NOT_READY = "The model is not ready (it is being loaded or switched, or its process restarted); try again shortly."
MSG_API_BODY_TOO_LARGE = "The request's body is over {limit} MB (MINICPMV_MAX_API_REQUEST_MB)."
MSG_API_BODY_BROKE_OFF = "The request's body broke off before its end."
MSG_API_BAD_JSON = "The request's body must be a JSON object ({error})."
MSG_API_UNKNOWN_FIELDS = "Unknown field(s) {names}. This server reads {known}."
MSG_API_FIELD_NOT_SUPPORTED = "“{name}” can only be {allowed} here."
MSG_API_WRONG_TYPE = "“{name}” must be {kind}."
MSG_API_MAX_TOKENS_DIFFER = "“max_tokens” and “max_completion_tokens” differ: send one of them."
MSG_API_NO_MESSAGES = "“messages” must be a list of one message or more."
MSG_API_BAD_MESSAGE = "{where} must be an object with a “role” (system, user or assistant) and its “content”."
MSG_API_BAD_PART = ("{where} is not a part this server reads: a user's content holds “text”, “image_url” and "
                    "“video_url” parts, an assistant's text alone.")
MSG_API_TOO_MANY_MEDIA = ("The messages hold {count:,} images and videos; the limit is {limit} in one request "
                          "(the model sees the latest {images} images).")
MSG_API_MEDIA_IN_SYSTEM = "{where}: a system message holds text only."
MSG_API_SYSTEM_LATE = "{where}: system messages come first, before the conversation."
MSG_API_TOOLS = "{where}: this server calls no tools, so it takes neither tool calls nor tool results."
MSG_API_LAST_NOT_USER = "The last message must be the user's: the reply answers it."
MSG_NOT_A_DATA_URL = ("{where}: “{url}” is not a data: URL. This server never fetches a link: send the image or video "
                      "itself, as data:<media type>;base64,<its bytes in base64>.")
MSG_DATA_URL_NOT_BASE64 = "{where}: the data: URL must hold base64 (data:<media type>;base64,...), and valid base64."
MSG_DATA_URL_TYPE = "{where}: “{type}” is not a supported {kind} type. Supported: {kinds}."
MSG_DATA_URL_TOO_LARGE = "{where}: the file is over the {limit} MB limit of one file."
MSG_MODEL_UNAVAILABLE = (
    "Cannot load “{model}”: it is not a local folder and could not be fetched from the Hugging Face Hub "
    "({reason}). Pass a local checkpoint folder with --model PATH, or try the demo offline with --model tiny-random."
)
