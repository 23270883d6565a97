"""The page's parts around the tabs: the settings sidebar, the reply controls under the tabs, and the
Server load and Model panels below them (app.ui.layout puts the page together)."""

import gradio as gr

from app import limits, tuning
from app.messages import MSG_SETTINGS
from app.model.checkpoint.presets import PRESETS
from app.ui.handlers import Handlers
from app.ui.load_charts import load_charts

# Checked with the real processors (tests/test_budget.py): 4.6's 14-px patches make a 448x448 view 64 tokens in
# "16x", 4.7's 16-px ones 49; a slice's count follows its shape (a 1920x1080 image: 66 + 2x4 x 64 = 578).
SLICES_INFO = ("An image is seen whole (its source view, about 448×448) and, if larger, in up to this many slices "
               "of about 448×448, in a grid that follows its shape. Each view is about 64 tokens in 16x (49 with "
               "MiniCPM-V 4.7): 1344×1344 at 9 slices is 64 + 3×3 × 64 = 640. Attached images show their cut.")


def settings_sidebar(defaults) -> dict:
    """The settings changed less often, in a sidebar that opens from the page's left edge."""
    with gr.Sidebar(label=MSG_SETTINGS, open=False, elem_id="settings"):
        gr.Markdown("### Decoding")
        components = {
            "do_sample": gr.Checkbox(value=defaults.do_sample, label="Sample (off: greedy)"),
            "temperature": gr.Slider(limits.MIN_SAMPLING_TEMPERATURE, 2.0, value=defaults.temperature, step=0.01, label="Temperature"),
            "top_p": gr.Slider(0.01, 1.0, value=defaults.top_p, step=0.01, label="Top-p"),
            "top_k": gr.Slider(0, 200, value=defaults.top_k, step=1, label="Top-k (0: off)"),
            "repetition_penalty": gr.Slider(1.0, 2.0, value=defaults.repetition_penalty, step=0.01, label="Repetition penalty"),
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


def reply_controls(defaults, thinking_by_default: bool) -> dict:
    """The two settings changed most, under every tab's input (one component each, after the tabs, so that
    all tabs share them), and a link down to the Server load panel."""
    with gr.Row(elem_id="reply-controls"):
        gr.Markdown("[How busy is the server? ↓](#server-load-panel)", elem_id="to-server-load")
        controls = {
            # The checkpoint's template's own default (ModelInfo.thinking_by_default), until the user says.
            "enable_thinking": gr.Checkbox(value=thinking_by_default, label="Thinking", container=False,
                                           elem_id="thinking", min_width=0, scale=0),
            # No minimum or maximum for Gradio to check: its refusal covered the chat and the box with "Error"
            # badges that outlived the fix. A value out of range is brought into it when the field is left, and
            # the engine refuses one sent before that as the reply to its turn.
            "max_new_tokens": gr.Number(defaults.max_new_tokens, precision=0, step=1, label="Max new tokens",
                                        elem_id="max-new-tokens", min_width=0, scale=0),
        }
    # In the page, at once: a question sent straight after (Enter in its box) reads the field as brought back.
    # On a server round trip it could read the value typed (a loaded CI machine did).
    controls["max_new_tokens"].blur(None, [controls["max_new_tokens"]], [controls["max_new_tokens"]],
                                    js=within_reply_limits(defaults.max_new_tokens))
    return controls


def within_reply_limits(default: int) -> str:
    """The page's function that brings a reply's length typed in the field within 1 to MAX_NEW_TOKENS_LIMIT
    (`default` if left empty)."""
    return (f"(value) => (value === null || value === '' || isNaN(value)) ? {default} : "
            f"Math.min(Math.max(Math.round(value), 1), {limits.MAX_NEW_TOKENS_LIMIT})")


# Gradio's sidebar opens from an unlabelled chevron: the sidebar's name is written along it (assets/style.css).
LABEL_SETTINGS_TOGGLE = f"""() => {{
    const toggle = document.querySelector("#settings .toggle-button");
    if (!toggle || toggle.querySelector(".toggle-label")) return;
    const label = document.createElement("span");
    label.className = "toggle-label";
    label.textContent = {MSG_SETTINGS!r};
    toggle.append(label);
    toggle.setAttribute("aria-label", {MSG_SETTINGS!r});
}}"""


# Closed, the settings sidebar is only slid out of view: Tab still walked through its dozen controls, unseen. Inert
# while closed, it takes no focus and no clicks; the toggle, outside it, stays.
CLOSED_SETTINGS_INERT = """() => {
    const sidebar = document.querySelector("#settings");
    const content = sidebar && sidebar.querySelector(":scope > .sidebar-content");
    if (!content) return;
    const follow = () => { content.inert = !sidebar.classList.contains("open"); };
    new MutationObserver(follow).observe(sidebar, {attributes: true, attributeFilter: ["class"]});
    follow();
}"""


# "How busy is the server? ↓" scrolled to the Server load panel and left it closed: it opens it too.
OPEN_SERVER_LOAD_FROM_LINK = """() => {
    const link = document.querySelector("#to-server-load a");
    if (!link || link.dataset.opensPanel) return;
    link.dataset.opensPanel = "1";
    link.addEventListener("click", (event) => {
        const panel = document.querySelector("#server-load-panel");
        const toggle = panel && panel.querySelector(":scope > button.label-wrap");
        if (!toggle) return;
        event.preventDefault();
        if (!toggle.classList.contains("open")) toggle.click();
        panel.scrollIntoView({block: "start"});
    });
}"""


def below_the_tabs(manager, handlers: Handlers, header: gr.Markdown, thinking: gr.Checkbox) -> None:
    """Below the tabs: the server-load panel and (if allowed) the model switch."""
    info = manager.info()
    with gr.Accordion("Server load", open=False, elem_id="server-load-panel") as load_accordion:
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
        load_model.click(handlers.switch_model, [model_choice], [header, thinking],
                         concurrency_id="model-switch", concurrency_limit=1, api_visibility="private")
