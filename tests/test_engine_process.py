"""The engine in a process of its own (what `python app.py` runs): same replies, Stop, errors, crashes."""

import os
import signal
import threading
import time
from contextlib import closing

import pytest
import torch
from gradio_client import Client

from app.config import AppConfig
from app.engine.client import EngineProcess
from app.engine.settings import GenerationSettings
from app.errors import UserError
from tests.conftest import free_port, make_image, picture_requests, wait_for
from tests.test_api import FIXED, stream


def user(text: str, *images: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "path": path} for path in images]
             + [{"type": "text", "text": text}]}]


def reply(engine, messages, settings):
    last = None
    for last in engine.stream(messages, settings):
        pass
    return last


@pytest.fixture(scope="module")
def engine():
    # Two worker processes prepare the inputs, as on a GPU box (on the CPU the default is threads).
    engine = EngineProcess(AppConfig(model="tiny-random", port=free_port(), max_new_tokens=256, prepare_processes=2))
    engine.load()
    engine.warm_up()
    yield engine
    engine.close()
    assert engine._process.exitcode == 0


@pytest.fixture(scope="module")
def engine_url(engine):
    from app.web.server import launch

    demo = launch(engine.config, engine, prevent_thread_lock=True)
    yield demo.local_url
    demo.close()


def test_the_engine_runs_in_another_process(engine):
    import psutil

    assert engine._process.pid != os.getpid() and engine._process.is_alive()
    workers = psutil.Process(engine._process.pid).children()
    assert len([worker for worker in workers if "spawn" in " ".join(worker.cmdline())]) >= 2  # the preparers
    info = engine.info()
    assert info.name == "tiny-random" and info.random_weights
    assert engine.max_context_tokens > 1000 and engine.active_generations == 0


def test_every_preparing_worker_is_started_and_ready_with_the_preparer(tmp_path):
    """Not started one by one as requests find none idle (some were still importing as users came)."""
    import torch

    from app.engine.inputs import prepare_inputs
    from app.engine.processor import load_processor
    from app.engine.preparers import ProcessPreparer
    from app.model.checkpoint.random_checkpoint import ensure_tiny_checkpoint

    preparer = ProcessPreparer(ensure_tiny_checkpoint(), False, 2)
    try:
        workers = list(preparer._pool._processes.values())
        assert len(workers) == 2 and all(worker.is_alive() for worker in workers)
        assert preparer._slots is not None and len(preparer._slots.buffers) == 4
        one = user("What is it?", make_image(tmp_path, "p.png"))
        two = user("And these?", make_image(tmp_path, "q.png"), make_image(tmp_path, "r.png", (1200, 1300)))
        processor = load_processor(ensure_tiny_checkpoint(), False)
        # What came back (small tensors by value; the pixels in a slot, or for two images, too many for
        # one, in a segment of their own) is what is prepared here.
        for messages, visual_tokens in ((one, 640), (two, 1280), (one, 640)):
            prepared = preparer.prepare(messages, GenerationSettings(), 8192)
            assert prepared.visual_tokens == visual_tokens
            here = prepare_inputs(processor, messages, GenerationSettings(), 8192)
            assert prepared.tensors.keys() == here.tensors.keys()
            for key, value in here.tensors.items():
                if isinstance(value, torch.Tensor):
                    assert isinstance(prepared.tensors[key], torch.Tensor) and torch.equal(prepared.tensors[key], value), key
        assert sorted(preparer._slots._free.get() for _ in range(4)) == [0, 1, 2, 3]  # every slot given back
    finally:
        preparer.close()


def test_a_preparing_worker_that_dies_is_replaced_and_only_its_requests_fail(tmp_path):
    """A worker's death (a decoder's crash, the out-of-memory killer) broke the pool, and every request after it
    failed, text alone too, until the app was restarted."""
    from app.engine.preparers import ProcessPreparer
    from app.model.checkpoint.random_checkpoint import ensure_tiny_checkpoint

    preparer = ProcessPreparer(ensure_tiny_checkpoint(), False, 2)
    try:
        question = user("What is it?", make_image(tmp_path, "p.png"))
        assert preparer.prepare(question, GenerationSettings(), 8192).visual_tokens == 640
        first = set(preparer._pool._processes)
        os.kill(next(iter(first)), signal.SIGKILL)
        with pytest.raises(UserError, match="stopped unexpectedly; it has been restarted"):
            preparer.prepare(question, GenerationSettings(), 8192)
        assert preparer.prepare(question, GenerationSettings(), 8192).visual_tokens == 640
        assert preparer.prepare(user("And in words?"), GenerationSettings(), 8192).visual_tokens == 0
        assert not first & set(preparer._pool._processes)  # new workers, two of them
        assert len(preparer._pool._processes) == 2
        assert sorted(preparer._slots._free.get() for _ in range(4)) == [0, 1, 2, 3]  # every slot given back
    finally:
        preparer.close()


def test_replies_equal_the_in_process_engine_token_for_token(engine, manager, tmp_path):
    """Same checkpoint, greedy: the text decoded here from the engine process's tokens is the in-process text."""
    settings = GenerationSettings(max_new_tokens=40, min_new_tokens=40, do_sample=False)
    for messages in (user("Describe it.", make_image(tmp_path, "a.png", (700, 500))), user("Tell me a story.")):
        here, there = reply(manager, messages, settings), reply(engine, messages, settings)
        assert there.text == here.text and there.stats["new_tokens"] == 40
        assert {key: there.stats[key] for key in ("visual_tokens", "prompt_tokens")} == \
               {key: here.stats[key] for key in ("visual_tokens", "prompt_tokens")}
        for stats in (here.stats, there.stats):  # the preprocessing's stages, in order, add up to it
            stages = stats["preparation_ms"]
            assert list(stages) == ["to_preparer", "for_a_worker", "work", "way_back", "staging"]
            assert min(stages.values()) >= 0 and stages["work"] > 0
            assert abs(sum(stages.values()) - stats["preprocess_ms"]) <= 0.5


def test_the_ui_previews_come_from_the_engine_process(engine, manager, tmp_path):
    """The web side draws an image's cut from the engine's plan (it loads no processor of its own): over the
    pipe it is the in-process plan, and the preview drawn from it is the same."""
    from app.ui.previews import Previews

    paths = [make_image(tmp_path, "a.png", (1920, 1080)), make_image(tmp_path, "b.png", (448, 448))]
    settings = GenerationSettings(max_slice_nums=4)
    assert engine.plan_images(paths, settings) == manager.plan_images(paths, settings)
    there, here = (Previews(side).gallery_images(paths, {"max_slice_nums": 4}) for side in (engine, manager))
    assert there[1] == here[1] and "3×1 slices of 336×560" in there[1]


def answers_at_once(ask, keys) -> dict:
    """{key: ask(key)} with every call on a thread of its own, all at once; fails on any error."""
    answers, failures = {}, []

    def run(key):
        try:
            answers[key] = ask(key)
        except Exception as error:  # asserted below
            failures.append((key, error))

    threads = [threading.Thread(target=run, args=(key,)) for key in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures
    return answers


def test_16_users_through_the_app_each_get_the_in_process_answer(engine_url, manager, tmp_path):
    requests = picture_requests(tmp_path, 16, seed=1, question="User {i}: what is in picture {i}?")
    settings = GenerationSettings(**FIXED)
    expected = {key: reply(manager, user(text, path), settings).text for key, (text, path) in requests.items()}
    answers = answers_at_once(
        lambda key: stream(Client(engine_url, verbose=False), requests[key][0], [requests[key][1]], FIXED)[1][0], requests)
    assert len(set(expected.values())) > 8 and answers == expected  # nobody got anybody else's answer


def test_metrics_come_from_the_engine_process(engine, engine_url):
    import urllib.request

    before = engine.metrics.snapshot()
    reply(engine, user("Hello?"), GenerationSettings(max_new_tokens=5, min_new_tokens=5, do_sample=False))
    after = engine.metrics.snapshot()
    assert after["requests"]["finished"] == before["requests"]["finished"] + 1
    assert after["tokens_generated"] == before["tokens_generated"] + 5
    text = urllib.request.urlopen(engine_url.rstrip("/") + "/metrics", timeout=10).read().decode()
    assert f'minicpmv_requests_total{{outcome="finished"}} {after["requests"]["finished"]}' in text
    # The load's history, sampled in the engine process, comes over the pipe: a sample after that first token.
    assert wait_for(lambda: engine.metrics.history()[-1:] and engine.metrics.history()[-1]["ttft_p50_s"] is not None, 60)


def test_stop_takes_the_request_out_of_the_engine_process_batch(engine):
    stopped_before = engine.metrics.snapshot()["requests"]["stopped"]
    long = GenerationSettings(max_new_tokens=4000, min_new_tokens=4000, do_sample=False)
    with closing(engine.stream(user("Go on and on."), long)) as updates:
        for count, _ in enumerate(updates):
            if count == 3:
                break
        assert engine.active_generations == 1
    assert wait_for(lambda: engine.active_generations == 0, 10)  # long before 4000 tokens
    assert engine.metrics.snapshot()["requests"]["stopped"] == stopped_before + 1


def test_bad_input_is_a_clean_error_and_the_engine_serves_on(engine, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    with pytest.raises(UserError, match="(?i)image"):
        reply(engine, user("What is it?", str(broken)), GenerationSettings(max_new_tokens=5))
    assert reply(engine, user("Still there?"), GenerationSettings(max_new_tokens=5, min_new_tokens=5)).stats["new_tokens"] == 5


def test_a_full_line_is_refused_through_the_pipe(tmp_path):
    small = EngineProcess(AppConfig(model="tiny-random", max_batch_size=1, queue_size=0, warmup=False))
    small.load()
    try:
        long = GenerationSettings(max_new_tokens=4000, min_new_tokens=4000, do_sample=False)
        with closing(small.stream(user("Go on."), long)) as running:
            next(running)
            with pytest.raises(UserError, match="busy"):
                reply(small, user("Me too?"), GenerationSettings(max_new_tokens=5))
        assert small.metrics.snapshot()["requests"]["busy"] == 1
    finally:
        small.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the profile runs (next test)")
def test_a_gpu_profile_asked_of_an_engine_on_the_cpu_is_refused_clearly(engine):
    with pytest.raises(UserError, match="needs a CUDA GPU"):
        engine.profile_gpu(1.0)
    with pytest.raises(UserError, match="at most 60 seconds"):
        engine.profile_gpu(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_engine_process_profiles_its_gpu_while_it_serves(engine):
    long = GenerationSettings(max_new_tokens=200, min_new_tokens=200, do_sample=False)
    stop = threading.Event()

    def keep_it_busy():
        while not stop.is_set():
            list(engine.stream([{"role": "user", "content": [{"type": "text", "text": "Count."}]}], long))

    user = threading.Thread(target=keep_it_busy)
    user.start()
    try:
        timeline = engine.profile_gpu(1.0)
    finally:
        stop.set()
        user.join(60)
    assert timeline["busy_ms"] > 0 and timeline["kernel_ms_by_kind"]
    assert set(timeline["gc_pauses"]) == {"generation 0", "generation 1", "generation 2"}
    assert timeline["counters"]["end"]["decode_steps"] >= timeline["counters"]["start"]["decode_steps"]


def test_switching_the_model_of_the_engine_process(engine):
    """The picker's switch, through the pipe: the engine process loads the other checkpoint (here the
    same files by their folder), and a restarted engine process would load it too."""
    folder = engine.info().path
    result = engine.switch(folder)
    assert result["warmup_s"] is not None
    assert engine.info().name == folder and engine.config.model == folder
    answer = reply(engine, user("Hello again?"), GenerationSettings(max_new_tokens=5, min_new_tokens=5, do_sample=False))
    assert answer.stats["new_tokens"] == 5


def test_a_crashed_engine_process_is_restarted(engine):
    """A crash of the engine process (a GPU driver fault, say) ends the replies in flight with a clear
    message; a new engine process serves the next ones."""
    long = GenerationSettings(max_new_tokens=4000, min_new_tokens=4000, do_sample=False)
    first = engine._process
    with pytest.raises(UserError, match="restarted"):
        for count, _ in enumerate(engine.stream(user("Go on and on."), long)):
            if count == 2:
                os.kill(first.pid, signal.SIGKILL)
    assert wait_for(lambda: engine.loaded, 120)
    assert engine._process.pid != first.pid
    answer = reply(engine, user("Back?"), GenerationSettings(max_new_tokens=5, min_new_tokens=5, do_sample=False))
    assert answer.stats["new_tokens"] == 5
    # The new process's warm-up runs after its load, beside that reply: its replies end too, and it is done.
    assert wait_for(lambda: engine.info().warmup_s is not None and engine.active_generations == 0, 60)


def test_a_stop_signal_ends_a_reply_at_any_moment_in_the_engine_process(engine, tmp_path):
    """The StopSignal the web side sets when its client cancels: set before the request is sent, while its
    image is being prepared, while it waits in line, or while it streams, the reply ends at once (its
    thread never waits for the engine's next event) and the request leaves the engine process's batch."""
    from app.engine.stop_signal import StopSignal

    image = make_image(tmp_path, "big.png", (2000, 2000))
    long = GenerationSettings(max_new_tokens=4000, min_new_tokens=4000, do_sample=False)
    stopped_before = engine.metrics.snapshot()["requests"]["stopped"]
    for delay in (None, 0.0, 0.01, 0.05, 0.3):
        stop = StopSignal()
        if delay is None:
            stop.set()
        else:
            threading.Timer(delay, stop.set).start()
        started = time.monotonic()
        updates = list(engine.stream(user("Go on and on.", image), long, stop))
        # It ended there: a last update, if any (once prepared), marked stopped with the tokens that reached it.
        assert all(update.stats is None for update in updates[:-1])
        assert not updates or updates[-1].stats is None or (updates[-1].stopped and updates[-1].stats["new_tokens"] < 4000)
        assert time.monotonic() - started < 20
        assert wait_for(lambda: engine.active_generations == 0, 10), f"stopped after {delay} s, still in the batch"
    assert engine.metrics.snapshot()["requests"]["stopped"] - stopped_before >= 3


def test_the_engine_answers_only_the_calls_it_lists(engine):
    """Calls over the pipe are an EngineCall each, answered from a table: no attribute of the manager is
    looked up by a name the other side sends."""
    from app.engine.api import EngineCall

    assert engine._call(EngineCall.ACTIVE_GENERATIONS) == 0
    for name in ("model", "config", "metrics.__class__", "_unload"):
        with pytest.raises(Exception, match="is not a valid EngineCall"):
            engine._call(name)
    assert engine.info().parameters > 0 and engine.active_generations == 0  # and it serves on
