"""Starting the app as a user does: python app.py, from a subprocess."""

import os
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import ROOT, free_port, wait_for


def run_app(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "app.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_help_documents_every_option():
    result = run_app("--help")
    assert result.returncode == 0
    for option in ("--model", "--device", "--dtype", "--attn-implementation", "--host", "--port", "--share",
                   "--max-new-tokens", "--visual-token-budget", "--queue-size", "MINICPMV_MODEL", "tiny-random"):
        assert option in result.stdout


def test_missing_model_offline_is_one_clear_line(tmp_path):
    started = time.monotonic()
    result = run_app("--model", "openbmb/MiniCPM-V-4.6", env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)})
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "tiny-random" in error_lines[0] and "local" in error_lines[0]
    assert time.monotonic() - started < 60


def test_unreachable_hub_fails_fast(tmp_path):
    env = {"HF_HUB_OFFLINE": "0", "HF_HUB_CACHE": str(tmp_path), "HF_ENDPOINT": "http://127.0.0.1:9"}
    result = run_app("--model", "openbmb/MiniCPM-V-4.6", env=env)
    assert result.returncode == 2 and "unreachable" in result.stderr and "Traceback" not in result.stderr


def test_start_from_environment_with_share_and_a_small_line_keeps_serving_locally(tmp_path):
    port = free_port()
    log_path = tmp_path / "app.log"
    # A line shorter than the warm-up's waves (16 requests at once) once stopped the start with a traceback.
    env = {**os.environ, "MINICPMV_MODEL": "tiny-random", "GRADIO_SERVER_PORT": str(port), "MINICPMV_SHARE": "1",
           "MINICPMV_QUEUE_SIZE": "4", "MINICPMV_MAX_BATCH_SIZE": "2"}
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline and status != 200:
            assert process.poll() is None, log_path.read_text()
            try:
                status = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).status
            except OSError:
                time.sleep(0.1)
        assert status == 200, log_path.read_text()
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        # The warm-up's requests are not counted as users' requests.
        assert 'minicpmv_requests_total{outcome="finished"} 0' in metrics
        assert "minicpmv_decode_steps_total 0" in metrics
        # The share attempt is over once the log says how it went (without a network, at once).
        assert wait_for(lambda: any(outcome in log_path.read_text()
                                    for outcome in ("Could not create share link", "public URL")), 60), log_path.read_text()
        output = log_path.read_text()
        assert "Warm-up took" in output and "--share without --auth" in output
        assert "--share without --api-key" in output  # the OpenAI-compatible API is as open as the page
        assert "Could not create share link" in output or "public URL" in output
        assert process.poll() is None  # still serving
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).status == 200
    finally:
        process.terminate()
        process.wait(30)


def test_matplotlib_never_picks_a_backend_in_the_event_loop(server_url):
    """Gradio switches matplotlib's backend around every event step when matplotlib is installed; left to
    choose, matplotlib imports pyplot and builds its font cache there (13 s on a fresh GPU machine)."""
    assert os.environ.get("MPLBACKEND") == "agg"


def test_every_process_hands_the_gil_over_often_and_freezes_what_it_started_with():
    """An upload's chunks each wait for the GIL in a web process, and the engine's token consumers in the
    engine process: at Python's 5 ms they waited in line behind busy threads (docs/DECISIONS.md D14).
    Every kind of process starts through app.startup, which also reads the environment's knobs."""
    from app import tuning

    script = ("import gc, sys; from app.startup import start_process, started; from app import limits; "
              "start_process('web 0', torch_threads=1); started(); "
              "print(sys.getswitchinterval(), gc.get_freeze_count() > 0, limits.MAX_IMAGES_PER_REQUEST)")
    default = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert default.stdout.split() == [str(tuning.SWITCH_INTERVAL_S), "True", "16"], default.stderr[-2000:]
    assert tuning.SWITCH_INTERVAL_S < 0.005
    env = {**os.environ, "MINICPMV_SWITCH_INTERVAL_S": "0.002", "MINICPMV_MAX_IMAGES_PER_REQUEST": "3"}
    changed = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert changed.stdout.split() == ["0.002", "True", "3"], changed.stderr[-2000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("megabytes", [0, 64])
def test_a_process_that_holds_freed_memory_decodes_a_png_without_faulting_its_memory_in_again(megabytes, tmp_path):
    """A preparing worker keeps freed memory (tuning.PREPARER_HELD_MEMORY_MB): without it, glibc handed a
    PNG's file bytes and pixels back after each decode, and the next one faulted them in again page by page
    (docs/DECISIONS.md D54)."""
    import numpy as np
    from PIL import Image

    path = str(tmp_path / "noise.png")
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (1024, 1024, 3), dtype=np.uint8)).save(path)
    script = ("import resource, sys; from app.startup import hold_freed_memory; "
              "from app.media.images import load_image_pixels\n"
              "if int(sys.argv[1]) and not hold_freed_memory(int(sys.argv[1])): sys.exit(3)\n"
              "faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
              "for _ in range(3): load_image_pixels(sys.argv[2], True)\n"
              "before = faults()\n"
              "for _ in range(5): load_image_pixels(sys.argv[2], True)\n"
              "print((faults() - before) // 5)")
    result = subprocess.run([sys.executable, "-c", script, str(megabytes), path], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    if result.returncode == 3:
        pytest.skip("this C library's malloc does not take the thresholds (not glibc)")
    faults_a_png = int(result.stdout)
    # The file (3.2 MB) and its pixels (3.1 MB) are about 1,600 pages of 4 KB.
    assert faults_a_png > 1_000 if megabytes == 0 else faults_a_png < 50, (faults_a_png, result.stderr[-2000:])


def test_a_limit_that_is_not_a_number_is_refused_in_one_line():
    result = subprocess.run([sys.executable, "app.py", "--model", "tiny-random"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "MINICPMV_MAX_IMAGE_PIXELS": "lots"})
    assert result.returncode == 2 and "MINICPMV_MAX_IMAGE_PIXELS='lots' is not a whole number" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_batch_or_line_size_that_cannot_serve_is_refused_in_one_line():
    from app.config import parse_config

    for argv, message in ((["--max-batch-size", "0"], "--max-batch-size is 1 or more"),
                          (["--queue-size", "-1"], "--queue-size is 0 or more")):
        result = run_app(*argv, "--model", "tiny-random")
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert parse_config(["--queue-size", "0", "--max-batch-size", "1"]).queue_size == 0
