"""The Blocks layout: components and event wiring only; the work is done by app.ui.handlers."""

import os
from types import SimpleNamespace

import gradio as gr

from app import limits, tuning
from app.messages import MSG_MULTI_IMAGE_HINT, MSG_RANDOM_WEIGHTS, MSG_VIDEO_HINT
from app.chat import THINK_CLOSE, THINK_OPEN
from app.config import handler_slots
from app.media.files import BROWSER_COPY_SUFFIX
from app.model.checkpoint.presets import PRESETS
from app.ui.cancellable import StopControl
from app.ui.file_inputs import UploadsOnlyBlocks
from app.ui.handlers import SETTING_KEYS, Handlers, model_header, settings_dict
from app.ui.load_charts import load_charts
from app.ui.previews import Previews, ShownVideo
from app.ui.replying import MODEL_EVENTS, streaming, wire_answer, wire_question, wire_stop

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "assets")
EXAMPLES = os.path.join(ASSETS, "examples")
CSS_PATH = os.path.join(ASSETS, "style.css")
SLICING_KEYS = ("max_slice_nums", "downsample_mode", "visual_token_budget")  # the settings an image's cut depends on
# Checked with the real processors (tests/test_budget.py): 4.6's 14-px patches make a 448x448 view 64 tokens in
# "16x", 4.7's 16-px ones 49; a slice's count follows its shape (a 1920x1080 image: 66 + 2x4 x 64 = 578).
SLICES_INFO = ("An image is seen whole (its source view, about 448×448) and, if larger, in up to this many slices "
               "of about 448×448, in a grid that follows its shape. Each view is about 64 tokens in 16x (49 with "
               "MiniCPM-V 4.7): 1344×1344 at 9 slices is 64 + 3×3 × 64 = 640. Attached images show their cut.")


def _settings_sidebar(defaults, thinking_by_default: bool) -> dict:
    with gr.Sidebar(label="Settings", open=False):
        gr.Markdown("### Decoding")
        components = {
            "max_new_tokens": gr.Slider(1, limits.MAX_NEW_TOKENS_LIMIT, value=defaults.max_new_tokens, step=1, label="Max new tokens"),
            "do_sample": gr.Checkbox(value=defaults.do_sample, label="Sample (off: greedy)"),
            "temperature": gr.Slider(limits.MIN_SAMPLING_TEMPERATURE, 2.0, value=defaults.temperature, step=0.01, label="Temperature"),
            "top_p": gr.Slider(0.01, 1.0, value=defaults.top_p, step=0.01, label="Top-p"),
            "top_k": gr.Slider(0, 200, value=defaults.top_k, step=1, label="Top-k (0: off)"),
            "repetition_penalty": gr.Slider(1.0, 2.0, value=defaults.repetition_penalty, step=0.01, label="Repetition penalty"),
            # The checkpoint's template's own default (ModelInfo.thinking_by_default), until the user says.
            "enable_thinking": gr.Checkbox(value=thinking_by_default, label="Thinking (reason before answering)"),
        }
        gr.Markdown("### Visual tokens")
        detail = gr.Radio(["Standard", "High detail"], value="Standard", label="Image detail", elem_id="image-detail",
                          info=f"High detail: up to {limits.HIGH_DETAIL_SLICE_NUMS} slices per image, for documents, "
                               f"small text and large photos (more visual tokens: slower).")
        components.update({
            "max_slice_nums": gr.Slider(1, limits.MAX_SLICE_NUMS, value=defaults.max_slice_nums, step=1,
                                        label="Max slices per image", info=SLICES_INFO),
            "downsample_mode": gr.Radio(list(limits.DOWNSAMPLE_MODES), value=defaults.downsample_mode, label="Downsampling",
                                        info="4x keeps 4 times more tokens per view: finer detail, slower."),
            "visual_token_budget": gr.Slider(64, limits.MAX_VISUAL_TOKEN_BUDGET, value=defaults.visual_token_budget, step=64,
                                             label="Visual token budget per request",
                                             info="Shared by all images; slices are lowered to fit."),
        })
    standard = (defaults.max_slice_nums, defaults.visual_token_budget)
    high = (limits.HIGH_DETAIL_SLICE_NUMS, max(defaults.visual_token_budget, limits.HIGH_DETAIL_VISUAL_TOKEN_BUDGET))
    detail.change(lambda choice: high if choice == "High detail" else standard, [detail],
                  [components["max_slice_nums"], components["visual_token_budget"]], api_visibility="private", queue=False)
    return components


def _video_controls(defaults) -> dict:
    with gr.Row():
        return {
            "video_fps": gr.Slider(0.1, limits.MAX_VIDEO_FPS, value=defaults.video_fps, step=0.1, label="Frames per second"),
            "video_max_frames": gr.Slider(1, limits.MAX_VIDEO_FRAMES, value=defaults.video_max_frames, step=1, label="Max frames"),
            "video_slices_per_frame": gr.Slider(1, limits.MAX_VIDEO_SLICES_PER_FRAME, value=defaults.video_slices_per_frame, step=1,
                                                label="Slices per frame"),
        }


def _chatbot(label: str, placeholder: str, elem_id: str) -> gr.Chatbot:
    return gr.Chatbot(label=label, height=480, placeholder=placeholder, reasoning_tags=[(THINK_OPEN, THINK_CLOSE)],
                      buttons=["copy", "copy_all"], feedback_options=None, elem_id=elem_id)


def build_demo(manager) -> gr.Blocks:
    """The whole page: the header and side panels, one builder per tab, then each tab's events."""
    handlers, previews = Handlers(manager), Previews(manager)
    defaults = manager.default_settings()
    # Every generating request reaches the engine at once (its batch and wait line, and far more beyond:
    # handler_slots), so that the engine's line is the only one: it orders them, reports their places,
    # and answers "busy" at once past its end.
    concurrency = handler_slots(manager.config)

    with UploadsOnlyBlocks(title="MiniCPM-V demo") as demo:
        header, sidebar = _header_and_panels(manager, handlers, defaults)
        with gr.Tabs():
            chat = _chat_tab()
            multi = _multi_image_tab()
            video = _video_tab(defaults)
        api = _api_components()
        settings = [{**sidebar, **video.settings}[key] for key in SETTING_KEYS]
        wiring = SimpleNamespace(blocks=demo, handlers=handlers, previews=previews, settings=settings,
                                 concurrency=concurrency, slicing=[sidebar[key] for key in SLICING_KEYS],
                                 previewing={"concurrency_id": "image-previews", "concurrency_limit": tuning.PREVIEWS_AT_ONCE})
        _wire_chat(wiring, chat)
        _wire_multi_image(wiring, multi)
        _wire_video(wiring, video)
        demo.load(lambda: model_header(manager.info()), None, [header], api_visibility="private")
        _wire_api(wiring, api)
    return demo


def _header_and_panels(manager, handlers: Handlers, defaults) -> tuple[gr.Markdown, dict]:
    """The model's header, the settings sidebar, the server-load panel and (if allowed) the model switch."""
    info = manager.info()
    header = gr.Markdown(model_header(info), elem_id="model-header")
    if info.random_weights:
        gr.Markdown(MSG_RANDOM_WEIGHTS, elem_id="random-weights")
    sidebar = _settings_sidebar(defaults, info.thinking_by_default)
    with gr.Accordion("Server load", open=False) as load_accordion:
        load = [gr.Markdown(elem_id="server-load"), *load_charts(on_gpu=info.gpu_memory_bytes is not None)]
    # Filled when opened, then refreshed as often as the engine samples, only while someone has the panel
    # open: hundreds of idle tabs should not poll.
    load_timer = gr.Timer(tuning.LOAD_SAMPLE_S, active=False)
    load_timer.tick(handlers.server_load, None, load, api_visibility="private", show_progress="hidden", queue=False)
    load_accordion.expand(lambda: [gr.Timer(active=True), *handlers.server_load()], None, [load_timer, *load],
                          api_visibility="private", show_progress="hidden", queue=False)
    load_accordion.collapse(lambda: gr.Timer(active=False), None, [load_timer], api_visibility="private", queue=False)
    if manager.config.allow_model_switch:
        with gr.Accordion("Model", open=False):
            model_choice = gr.Dropdown(
                [(preset.label, preset.model) for preset in PRESETS], value=info.name, allow_custom_value=True,
                label="Checkpoint", info="A preset, any Hub id or a local folder. Changes the model for everyone.")
            load_model = gr.Button("Load this model")
        # One switch at a time, in a group of its own: a concurrency group's limit is the lowest any of
        # its events asks for (gradio.queueing.Queue.create_event_queue_for_fn), so in MODEL_EVENTS a
        # switch's 1 held every reply after it to one at a time. Replies wait for a switch in the engine.
        # The new checkpoint's header, and its template's thinking default on the switch.
        load_model.click(handlers.switch_model, [model_choice], [header, sidebar["enable_thinking"]],
                         concurrency_id="model-switch", concurrency_limit=1, api_visibility="private")
    return header, sidebar


def _chat_tab() -> SimpleNamespace:
    with gr.Tab("Chat", id="chat"):
        chat = _chatbot("Chat", "Ask anything, or attach photos (upload, paste, or the camera below).", "chat")
        box = gr.MultimodalTextbox(
            file_count="multiple", file_types=list(limits.IMAGE_EXTENSIONS), sources=["upload"],
            placeholder="Message MiniCPM-V… (attach or paste images)", autofocus=True,
            show_label=False, elem_id="chat-input",
        )
        pictures, costs = _image_previews("chat")
        attached = gr.Textbox(visible="hidden")  # what the previews show (ATTACHMENTS_KEY)
        with gr.Accordion("Camera", open=False):
            camera = gr.Image(sources=["webcam", "clipboard"], type="filepath", label="Photo for the next message")
        gr.Examples(
            examples=[[{"text": "What is in this picture?", "files": [os.path.join(EXAMPLES, "shapes.jpg")]}],
                      [{"text": "Read the text in this image.", "files": [os.path.join(EXAMPLES, "sign.jpg")]}]],
            inputs=[box], label="Examples",
        )
    return SimpleNamespace(chat=chat, box=box, camera=camera, pictures=pictures, costs=costs, attached=attached)


def _image_previews(tab: str, hint: str | None = None) -> tuple[gr.Gallery, gr.Markdown]:
    """Each image as the model will see it (its source view and slices), and what the images cost (or `hint`)."""
    pictures = gr.Gallery(label="What the model will see", visible=False, columns=3, height="auto", object_fit="contain",
                          interactive=False, buttons=["fullscreen"], elem_id=f"{tab}-previews", elem_classes="seen-by-model")
    return pictures, gr.Markdown(hint, visible=hint is not None, elem_id=f"{tab}-costs")


def _multi_image_tab() -> SimpleNamespace:
    with gr.Tab("Multi-image", id="multi"):
        gallery = gr.Gallery(type="filepath", interactive=True, file_types=list(limits.IMAGE_EXTENSIONS),
                             columns=4, height=260, label="Images, in the order the model sees them",
                             elem_id="multi-gallery")
        selected = gr.State(None)
        with gr.Row():
            earlier = gr.Button("◀ Move earlier", size="sm")
            later = gr.Button("Move later ▶", size="sm")
            remove = gr.Button("✕ Remove", size="sm")
        pictures, costs = _image_previews("multi", MSG_MULTI_IMAGE_HINT)
        chat = _chatbot("Conversation about these images", "Compare them, find the differences, ask what changed.",
                        "multi-chat")
        box = gr.Textbox(placeholder="Ask about all the images together…", submit_btn=True,
                         show_label=False, elem_id="multi-input")
        gr.Examples(
            examples=[[[os.path.join(EXAMPLES, "shapes.jpg"), os.path.join(EXAMPLES, "shapes-moved.jpg")],
                       "What changed between the two images?"]],
            inputs=[gallery, box], label="Examples",
        )
    return SimpleNamespace(gallery=gallery, selected=selected, earlier=earlier, later=later, remove=remove,
                           pictures=pictures, costs=costs, chat=chat, box=box)


def _video_tab(defaults) -> SimpleNamespace:
    with gr.Tab("Video", id="video"):
        video = gr.Video(sources=["upload"], label="Video", height=320, elem_id="video-player")
        note = gr.Markdown(visible=False, elem_id="video-player-note")
        settings = _video_controls(defaults)
        info = gr.Markdown(MSG_VIDEO_HINT, elem_id="video-sampling")
        shown = gr.State(ShownVideo())
        frames = gr.Gallery(label="The frames the model will see", visible=False, columns=8, height="auto",
                            object_fit="contain", interactive=False, buttons=["fullscreen"], elem_id="video-frames",
                            elem_classes="seen-by-model")
        chat = _chatbot("Conversation about the video", "Ask what happens in the video.", "video-chat")
        box = gr.Textbox(placeholder="Ask about the video…", submit_btn=True,
                         show_label=False, elem_id="video-input")
        gr.Examples(examples=[[os.path.join(EXAMPLES, "ball.webm"), "Describe what happens in this video."]],
                    inputs=[video, box], label="Examples")
    return SimpleNamespace(video=video, note=note, settings=settings, info=info, frames=frames, chat=chat, box=box,
                           shown=shown)


def _api_components() -> SimpleNamespace:
    """/ask's inputs and outputs: hidden components, since an API event needs components."""
    with gr.Row(visible=False):
        text = gr.Textbox(label="text")
        files = gr.File(file_count="multiple", type="filepath", label="files")
        settings = gr.JSON(label="settings")
        reply = gr.Textbox(label="reply_text")
        stats = gr.JSON(label="stats")
        button = gr.Button()
    conversation = gr.State([])
    return SimpleNamespace(text=text, files=files, settings=settings, reply=reply, stats=stats, button=button,
                           conversation=conversation)


# What the Chat tab's previews show, as one string made in the page: the attachments and the slicing settings.
ATTACHMENTS_KEY = ("(message, camera, ...slicing) => "
                   "JSON.stringify([(message?.files ?? []).map(file => file.path), camera?.path ?? null, slicing])")


def _wire_chat(wiring: SimpleNamespace, tab: SimpleNamespace) -> None:
    handlers, chat = wiring.handlers, tab.chat
    control = StopControl()
    asked = wire_question(wiring, tab.box, handlers.add_chat_message, [tab.box, tab.camera, chat],
                           [chat, tab.box, tab.camera], control)
    retried = chat.retry(handlers.retry, [chat], [chat], api_visibility="undocumented")
    wire_stop(tab.box, chat, control, [asked, wire_answer(wiring, retried, chat, tab.box, control)])
    chat.undo(handlers.undo, [chat], [chat, tab.box], api_visibility="undocumented")
    chat.clear(lambda: [], None, [chat], api_visibility="undocumented")

    def chat_images(message, camera, history, *values):
        return wiring.previews.chat_images(message, camera, history, settings_dict(values))

    # The box changes at every key typed: the page itself tells when what the previews show has changed.
    for trigger in (tab.box, tab.camera, *wiring.slicing):
        trigger.change(None, [tab.box, tab.camera, *wiring.slicing], [tab.attached], js=ATTACHMENTS_KEY)
    tab.attached.change(chat_images, [tab.box, tab.camera, chat, *wiring.settings], [tab.pictures, tab.costs],
                        api_visibility="private", show_progress="hidden", **wiring.previewing)


def _gallery_at(paths: list[str], index: int | None):
    """The gallery holding `paths` with image `index` highlighted and previewed, and the index kept: the
    page's own highlight stays on its slot, which after a move holds another image."""
    return gr.Gallery(value=paths, selected_index=index), index


def _wire_multi_image(wiring: SimpleNamespace, tab: SimpleNamespace) -> None:
    """A changed set of images starts a new conversation."""
    handlers = wiring.handlers
    cost_inputs = [tab.gallery, *wiring.settings]

    def gallery_images(gallery, *values):
        return wiring.previews.gallery_images(gallery, settings_dict(values))

    for trigger in (tab.gallery, *wiring.slicing):
        trigger.change(gallery_images, cost_inputs, [tab.pictures, tab.costs], api_visibility="undocumented",
                       **wiring.previewing)
    tab.gallery.upload(lambda: [], None, [tab.chat], api_visibility="undocumented")
    tab.gallery.select(Handlers.selected_index, None, [tab.selected], api_visibility="undocumented")
    for button, offset in ((tab.earlier, -1), (tab.later, 1)):
        button.click(lambda g, i, o=offset: _gallery_at(*Handlers.move_image(g, i, o)), [tab.gallery, tab.selected],
                     [tab.gallery, tab.selected], api_visibility="undocumented").then(
            lambda: [], None, [tab.chat], api_visibility="undocumented")
    tab.remove.click(lambda g, i: _gallery_at(*Handlers.remove_image(g, i)), [tab.gallery, tab.selected],
                     [tab.gallery, tab.selected],
                     api_visibility="undocumented").then(lambda: [], None, [tab.chat], api_visibility="undocumented")
    control = StopControl()
    asked = wire_question(wiring, tab.box, handlers.add_multi_image_question, [tab.box, tab.gallery, tab.chat],
                           [tab.chat, tab.box], control)
    wire_stop(tab.box, tab.chat, control, [asked])


# Gradio's player says "Video not playable" of a video the browser cannot play; once its copy is in the player,
# that message is about a file no longer shown.
DISMISS_UNPLAYABLE_ERROR = f"""(video) => {{
    if (!video?.path?.endsWith({BROWSER_COPY_SUFFIX!r})) return;
    for (const toast of document.querySelectorAll("[data-testid=toast-body]"))
        if (toast.textContent.includes("Video not playable")) toast.querySelector("[data-testid=toast-close]")?.click();
}}"""


def _wire_video(wiring: SimpleNamespace, tab: SimpleNamespace) -> None:
    """A new video starts a new conversation and shows the frames the model will see; one the browser cannot
    play is then replaced in the player by a copy it can (the model still reads the original: app.chat)."""
    handlers, previews = wiring.handlers, wiring.previews
    sampling = [tab.video, tab.settings["video_fps"], tab.settings["video_max_frames"]]
    # A group of its own: a video's browser copy takes seconds, and the images' previews need not wait for it.
    previewing = {"concurrency_id": "video-previews", "concurrency_limit": tuning.PREVIEWS_AT_ONCE}
    # First, and not queued: a copy made meanwhile for the video this one replaces must see it at once.
    tab.video.change(previews.video_put, [tab.video, tab.shown], None, queue=False, api_visibility="private")
    tab.video.change(previews.video_chosen, [*sampling, tab.shown], [tab.info, tab.frames, tab.chat, tab.note, tab.video],
                     api_visibility="undocumented", trigger_mode="multiple", **previewing)
    tab.video.change(None, [tab.video], None, js=DISMISS_UNPLAYABLE_ERROR)
    for control in (tab.settings["video_fps"], tab.settings["video_max_frames"]):
        control.change(previews.video_frames, sampling, [tab.info, tab.frames], api_visibility="undocumented", **previewing)
    control = StopControl()
    asked = wire_question(wiring, tab.box, handlers.add_video_question, [tab.box, tab.video, tab.chat],
                           [tab.chat, tab.box], control)
    wire_stop(tab.box, tab.chat, control, [asked])


def _wire_api(wiring: SimpleNamespace, api: SimpleNamespace) -> None:
    """The scripting API: gradio_client.Client(url).submit(text, files, settings, api_name="/ask")."""
    api.button.click(streaming(wiring.handlers.ask, wiring.blocks), [api.text, api.files, api.settings, api.conversation],
                     [api.reply, api.stats, api.conversation], api_name="ask", concurrency_id=MODEL_EVENTS,
                     concurrency_limit=wiring.concurrency,
                     api_description="Ask about images or one video; streams (reply_text, stats).")
