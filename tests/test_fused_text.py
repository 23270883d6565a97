"""The fused decode step (app.model.text.fused): the same logits and state as transformers' layers,
and its Triton kernels the same as their PyTorch versions (run on the CPU by Triton's interpreter)."""

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForImageTextToText

from app.model.backends import FusedText
from app.model.runner import BatchRunner
from app.model.text.fused import padded_output_weight
from app.model.text.layers import TransformersText
from app.model.checkpoint.random_checkpoint import TINY_CONFIG, TINY_CONFIG_4_7, build_random_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What the fused model reads from the config rather than assumes, changed: head counts and sizes, the
# rotary share and base, eps, an untied output layer.
VARIED_CONFIG = {**TINY_CONFIG, "tie_word_embeddings": False, "text_config": {
    **TINY_CONFIG["text_config"], "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "linear_num_value_heads": 4, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000, "partial_rotary_factor": 0.5}}}
CONFIGS = {"4.6": TINY_CONFIG, "4.7": TINY_CONFIG_4_7, "4.6 varied": VARIED_CONFIG}


def tiny_model(config: dict, tmp_path):
    """A tiny random checkpoint of `config`, loaded in fp32 (rounding then hides no mistake)."""
    folder = str(tmp_path / "checkpoint")
    build_random_checkpoint(folder, config)
    return AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


def text_prompt(model, length: int) -> torch.Tensor:
    """Random token ids of a prompt without media: an image's or video's pad token would ask for features."""
    ids = torch.randint(0, model.config.text_config.vocab_size, (1, length))
    ids[torch.isin(ids, torch.tensor([model.config.image_token_id, model.config.video_token_id]))] = 0
    return ids


def state_kinds(store) -> tuple[dict, ...]:
    return store.keys, store.values, store.conv, store.recurrent


def snapshot(store) -> list[dict]:
    return [{layer: tensor.clone() for layer, tensor in states.items()} for states in state_kinds(store)]


def restore(store, saved: list[dict]) -> None:
    for states, copies in zip(state_kinds(store), saved):
        for layer, tensor in states.items():
            tensor.copy_(copies[layer])


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_fused_step_gives_transformers_logits_and_state(config, tmp_path):
    model = tiny_model(config, tmp_path)
    runner = BatchRunner(model)
    assert isinstance(runner.text, FusedText)
    store = runner.store
    vocab = model.config.text_config.vocab_size
    torch.manual_seed(0)
    # Prompts of different lengths in one wave, so slots sit at different columns; nonzero rope deltas
    # as 4.7's images give.
    prompts = [(text_prompt(model, length), None, None) for length in (5, 17, 9)]
    with torch.inference_mode():
        runner.prefill(prompts, 0, 64)
        store.rope_deltas[:3] = torch.tensor([0, 7, -3])
        positions = store.lengths[:3].clone()
        for _ in range(4):
            tokens = torch.randint(0, vocab, (3,))
            before = snapshot(store)
            expected = runner.text.through_transformers.decode_step(tokens, positions.clone())
            expected_state = snapshot(store)
            restore(store, before)
            fused = runner.text.fused.decode(tokens, positions.clone())
            torch.testing.assert_close(fused, expected, rtol=1e-4, atol=1e-4)
            for ours, theirs in zip(snapshot(store), expected_state):
                for layer in theirs:
                    torch.testing.assert_close(ours[layer], theirs[layer], rtol=1e-4, atol=1e-5)
            assert any(not torch.equal(now[layer], then[layer]) for now, then in zip(snapshot(store), before)
                       for layer in then)
            positions += 1


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_fused_prefill_gives_transformers_logits_and_state(config, tmp_path):
    model = tiny_model(config, tmp_path)
    runner = BatchRunner(model)
    store = runner.store
    torch.manual_seed(1)
    # Prompts packed back to back, one shorter than the convolution's window; visual features in one.
    prompts = [(text_prompt(model, length), None, None) for length in (5, 70, 2, 9)]
    features = torch.randn(3, model.config.text_config.hidden_size)
    prompts[1][0][0, 10:13] = model.config.image_token_id
    prompts[1] = (prompts[1][0], features, None)
    with torch.inference_mode():
        fused = runner.prefill(prompts, 1, 128)  # from slot 1: slot 0 holds another request
        ours = snapshot(store)
        assert store.lengths[1:5].tolist() == [5, 70, 2, 9]
        # Against each prompt alone through transformers' layers. (A padded wave of them differs from
        # that by up to 4e-5 in these logits, in float64 too; the packed prompts match it to 1e-15.)
        for index, prompt in enumerate(prompts):
            slot = 1 + index
            expected = runner.text.through_transformers.prefill([prompt], slot)
            torch.testing.assert_close(fused[index], expected[0], rtol=1e-4, atol=1e-4)
            for mine, theirs in zip(ours, snapshot(store)):
                assert mine.keys() == theirs.keys()
                for layer in theirs:
                    # Within 2e-4 of the state's largest entry: a few keys of the 70-token prompt differ by
                    # up to 2e-4 (values to 4e-4), as much between transformers' own fp32 and fp64 layers;
                    # how much varies with the CPU (the order of fp32 sums follows its vector width).
                    scale = float(theirs[layer][slot].abs().max().clamp_min(1))
                    torch.testing.assert_close(mine[layer][slot], theirs[layer][slot], rtol=1e-4,
                                               atol=2e-4 * scale)


@pytest.mark.parametrize("config", [TINY_CONFIG, VARIED_CONFIG], ids=["tied", "untied"])
def test_an_output_layer_padded_to_aligned_rows_gives_the_same_logits_and_takes_no_more_memory(config, tmp_path):
    # On a GPU the output layer's rows are padded (OUTPUT_ROWS_MULTIPLE); here it is done by hand.
    model = tiny_model(config, tmp_path)
    runner = BatchRunner(model)
    fused = runner.text.fused
    vocab = model.config.text_config.vocab_size
    weight, embedding = model.lm_head.weight.detach().clone(), model.model.language_model.embed_tokens.weight
    torch.manual_seed(2)
    prompts = [(text_prompt(model, length), None, None) for length in (5, 9)]
    tokens = torch.randint(0, vocab, (2,))
    with torch.inference_mode():
        runner.prefill(prompts, 0, 64)
        positions, before = runner.store.lengths[:2].clone(), snapshot(runner.store)
        expected = fused.decode(tokens, positions.clone())
        restore(runner.store, before)
    fused.output_weight = padded_output_weight(model.lm_head, 64)
    assert vocab % 64 and fused.output_weight.shape[0] == -(-vocab // 64) * 64
    assert not fused.output_weight[vocab:].any()
    # The layer keeps a view of the padded rows, the same values; a tied input embedding still shares it.
    assert model.lm_head.weight.data_ptr() == fused.output_weight.data_ptr()
    assert torch.equal(model.lm_head.weight, weight)
    assert (embedding is model.lm_head.weight) == config["tie_word_embeddings"]
    with torch.inference_mode():
        padded = fused.decode(tokens, positions.clone())
        assert padded.shape == (2, vocab)
        torch.testing.assert_close(padded, expected, rtol=0, atol=1e-6)
        restore(runner.store, before)
        assert torch.equal(runner.text.through_transformers.decode_step(tokens, positions.clone()).argmax(-1),
                           expected.argmax(-1))


class LinearSubclass(torch.nn.Linear):  # as bitsandbytes' 4-bit layers are
    pass


class PackedLinear(torch.nn.Module):  # as GPTQ's and AWQ's are: no nn.Linear, no plain weight
    def __init__(self, linear):
        super().__init__()
        self.packed = linear

    def forward(self, x):
        return self.packed(x)


@pytest.mark.parametrize("replace", [lambda mlp: setattr(mlp.down_proj, "__class__", LinearSubclass),
                                     lambda mlp: setattr(mlp, "down_proj", PackedLinear(mlp.down_proj))],
                         ids=["subclass", "packed"])
def test_quantized_layers_decode_through_transformers(replace, tmp_path):
    model = tiny_model(TINY_CONFIG, tmp_path)
    replace(model.model.language_model.layers[-1].mlp)
    assert isinstance(BatchRunner(model).text, TransformersText)


def test_triton_kernels_equal_their_pytorch_versions():
    pytest.importorskip("triton")
    script = os.path.join(ROOT, "tests", "kernels_check.py")
    run = subprocess.run([sys.executable, script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert "checked 14 kernels" in run.stdout


def test_without_runnable_triton_kernels_the_pytorch_operations_run(monkeypatch, caplog):
    from app.model.text import kernels as text_kernels
    from app.model.text import ops as text_ops

    def no_compiler(*args):
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(text_kernels, "add_rms_norm", no_compiler)
    text_ops.triton_kernels.cache_clear()
    try:
        # Any device: the tiny kernel it tries fails before running.
        assert text_ops.triton_kernels(torch.device("cpu")) is None
        assert "cannot run here (Failed to find C compiler)" in caplog.text
    finally:
        text_ops.triton_kernels.cache_clear()


def test_gpus_older_than_ampere_run_the_pytorch_operations(monkeypatch, caplog):
    from app.model.text import ops as text_ops

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a T4
    text_ops.triton_kernels.cache_clear()
    try:
        assert text_ops.triton_kernels(torch.device("cuda", 0)) is None
        assert "compute capability 8.0 or newer" in caplog.text
    finally:
        text_ops.triton_kernels.cache_clear()


@pytest.mark.parametrize("config", [TINY_CONFIG, TINY_CONFIG_4_7], ids=["4.6", "4.7"])
def test_front_padded_prefill_equals_packed_prefill(config, tmp_path):
    """What the captured prefill runs (prompts front-padded with zero embeddings to one length, as one
    batch) gives each prompt's logits and state as the packed prefill does, and its padding leaves no
    trace in the slots' states."""
    model = tiny_model(config, tmp_path)
    runner = BatchRunner(model, use_cuda_graphs=False)
    store = runner.store
    embed = model.get_input_embeddings()
    torch.manual_seed(2)
    lengths, length = (5, 61, 2), 64  # one prompt fills the row but for three rows; one is under the conv window
    prompts = [embed(torch.randint(0, model.config.text_config.vocab_size, (size,))) for size in lengths]
    with torch.inference_mode():
        store.reserve(4, 128)
        packed = runner.text.fused.prefill(torch.cat(prompts), list(lengths), 1)
        expected = snapshot(store)
        for states in state_kinds(store):  # what the padded run leaves must be its own
            for tensor in states.values():
                tensor.normal_()
        padded = torch.zeros(len(lengths) * length, prompts[0].shape[1])
        for row, prompt in enumerate(prompts):
            padded[(row + 1) * length - len(prompt):(row + 1) * length] = prompt
        pads = torch.tensor([length - size for size in lengths])
        logits = runner.text.fused.prefill_padded(padded, pads, torch.tensor([1, 2, 3]))
        # The delta rule runs in fp32 (transformers' version casts to it) in chunks that start elsewhere
        # here: 1e-3 (a mistake in the padding costs O(1): a wrong mask gave 2.6).
        torch.testing.assert_close(logits, packed, rtol=1e-3, atol=1e-3)
        keys, values, conv, recurrent = expected
        ours_k, ours_v, ours_c, ours_r = snapshot(store)
        for layer in conv:
            torch.testing.assert_close(ours_c[layer][1:4], conv[layer][1:4], rtol=1e-3, atol=1e-3)
            torch.testing.assert_close(ours_r[layer][1:4], recurrent[layer][1:4], rtol=1e-3, atol=1e-3)
        for layer in keys:
            for slot, size in zip((1, 2, 3), lengths):  # the prompt's columns; padding wrote after them
                torch.testing.assert_close(ours_k[layer][slot, :, :size], keys[layer][slot, :, :size],
                                           rtol=1e-3, atol=1e-3)
                torch.testing.assert_close(ours_v[layer][slot, :, :size], values[layer][slot, :, :size],
                                           rtol=1e-3, atol=1e-3)


def test_a_packed_prefills_prompts_attend_in_few_padded_groups_each_row_once():
    """A wave of like prompts attends in one padded call; a long prompt among short ones attends alone (its
    padding would be most of the work); every packed row is put back once."""
    from app.model.text.rows import PackedAttention

    like = [84, 85, 86] * 40
    plan = PackedAttention.planned(like, [0] * len(like), list(range(len(like))), "cpu")
    assert len(plan.groups) == 1 and not plan.alone and plan.groups[0].length == 86
    lengths, starts = [1700, 12, 9, 10, 600, 11], [0, 680, 0, 700, 0, 0]
    plan = PackedAttention.planned(lengths, starts, [5, 6, 7, 8, 9, 10], "cpu")
    assert [(slot, length) for slot, _, length, _ in plan.alone] == [(5, 1700), (9, 600)]
    rows = torch.cat([group.rows for group in plan.groups] +
                     [torch.arange(at, at + length) for _, _, length, at in plan.alone])
    assert sorted(rows.tolist()) == list(range(sum(lengths)))
    for group in plan.groups:  # a padding place sees one column, a token its slot's columns up to its own
        assert group.sees.any(-1).all() and group.sees.shape == (group.slots.shape[0], group.length, group.columns)
    continued = next(group for group in plan.groups if 6 in group.slots.tolist())
    row = continued.slots.tolist().index(6)
    assert continued.sees[row, 0].nonzero()[-1].item() == 680 and continued.sees[row, 11].nonzero()[-1].item() == 691


def test_a_prefill_of_any_count_replays_a_captured_graph_for_each_piece_of_2_to_the_k(monkeypatch):
    """19 prompts run as captured pieces of 16, 2 and 1 (each with its prompts' embeddings, lengths and slots,
    padded to its own bucket), their logits joined in order though each graph's output lies where the next
    replay writes (graphs of one pool may share memory); where a piece has no bucket, or its capture fails,
    no piece runs and the wave is launched whole (None)."""
    from types import SimpleNamespace

    from app.model.continued_graphs import ContinuedPrefillGraphs
    from app.model.cuda_graphs import PrefillGraphs

    store = SimpleNamespace(column_capacity=2048, generation=0, device=torch.device("cpu"))
    lengths = [80] * 16 + [200, 30, 300]
    embeddings = torch.arange(sum(lengths), dtype=torch.float32)[:, None].repeat(1, 4)
    shared = torch.zeros((64, 3))  # every graph's output, as a pool may lay them out
    pieces, replays = [], []

    class Graph:
        def __init__(self, number: int, rows: int):
            self.number, self.rows = number, rows

        def replay(self):
            replays.append(self.number)
            shared[:self.rows] = float(self.number)

    def ready(embeddings, lengths, *places_and_bucket):
        pieces.append((embeddings[:, 0].tolist(), lengths, *places_and_bucket))
        return None if lengths == ["fails"] else (Graph(len(pieces), len(lengths)), shared[:len(lengths)])

    graphs = PrefillGraphs(store, fused=None)
    monkeypatch.setattr(graphs, "_ready", ready)
    logits = graphs.run(embeddings, lengths, first_slot=5)
    firsts = [0, 16 * 80, 16 * 80 + 230]
    assert [(rows[0], len(rows), lens, slot, bucket) for rows, lens, slot, bucket in pieces] == [
        (firsts[0], 16 * 80, [80] * 16, 5, 128), (firsts[1], 230, [200, 30], 21, 256), (firsts[2], 300, [300], 23, 512)]
    assert replays == [1, 2, 3]  # once every piece is ready
    assert logits[:, 0].tolist() == [1.0] * 16 + [2.0] * 2 + [3.0]

    pieces.clear(), replays.clear()
    assert graphs.run(embeddings[:8 * 300 + 80], [300] * 8 + [80], first_slot=0) is None  # no bucket for 8 of 300
    assert pieces == [] and replays == []

    continued = ContinuedPrefillGraphs(store, fused=None)
    monkeypatch.setattr(continued, "_ready", ready)
    slots = [9, 3, 7]
    logits = continued.run(embeddings[:30], [10, 15, 5], [100, 1500, 40], slots)
    assert [(lens, starts, their_slots, bucket) for _, lens, starts, their_slots, bucket in pieces] == [
        ([10, 15], [100, 1500], [9, 3], (16, 2048)), ([5], [40], [7], (16, 2048))]
    assert replays == [1, 2] and logits[:, 0].tolist() == [1.0, 1.0, 2.0]
    pieces.clear(), replays.clear()
    assert continued.run(embeddings[:30], [10, 15, 5], [100, 2040, 40], slots) is None  # past the store's columns
    assert pieces == []
    store.column_capacity = 8192  # a store grown for longer conversations: graphs reading as many columns as they need
    continued.run(embeddings[:30], [10, 15, 5], [100, 2040, 4090], slots)
    assert [bucket for *_, bucket in pieces] == [(16, 4096), (16, 8192)]
    pieces.clear(), replays.clear()
    many = torch.zeros((64 * 164, 4))  # 64 generation prompts, one of a long conversation: more than a graph gathers
    logits = continued.run(many[:64], [1] * 64, [100] * 63 + [3000], list(range(64)))
    assert [(len(lens), bucket) for _, lens, _, _, bucket in pieces] == [(32, (16, 2048)), (32, (16, 4096))]
    assert replays == [1, 2] and logits.shape[0] == 64  # in halves, each within the gathering limit
    pieces.clear(), replays.clear()
    graphs_by_shape = {}

    def sharing_ready(embeddings, lengths, starts, slots, bucket):
        """As a captured graph is: one per shape, its inputs (here the slots) those put in place last."""
        graph = graphs_by_shape.setdefault((len(lengths), bucket), SimpleNamespace(output=torch.zeros((len(lengths), 3))))
        graph.slots = list(slots)
        pieces.append((len(lengths), bucket))

        def replay():
            replays.append(graph.slots)
            graph.output[:, 0] = torch.tensor(graph.slots, dtype=torch.float32)
        graph.replay = replay
        return graph, graph.output

    monkeypatch.setattr(continued, "_ready", sharing_ready)
    slots = list(range(100, 164))
    logits = continued.run(many[:64 * 15], [15] * 64, [3000] * 64, slots)  # 64 long conversations: two halves, one shape
    assert pieces == [(32, (16, 4096))] * 2 and replays == [slots[:32], slots[32:]]
    assert logits[:, 0].tolist() == slots  # each half's own inputs, its logits in order
    pieces.clear(), replays.clear()
    logits = continued.run(many[:48 * 15], [15] * 48, [3000] * 48, slots[:48])  # 32, then 16
    assert replays == [slots[:32], slots[32:48]] and logits[:, 0].tolist() == slots[:48]
    pieces.clear(), replays.clear()
    monkeypatch.setattr(continued, "_ready", ready)
    # 64 new turns of 164 tokens: no count holds them but in 16s padded to 192, so they are launched whole, packed.
    assert continued.run(many, [164] * 64, [1200] * 64, slots) is None and pieces == []
    assert continued.run(many[:2 * 164], [164] * 2, [1200, 8100], [0, 1]) is None  # the second is past the store's
    assert pieces == [] and replays == []
    store.column_capacity = 2048

    monkeypatch.setattr(continued, "_ready", lambda embeddings, lengths, *rest: ready(embeddings, ["fails"] if len(lengths) == 1 else lengths, *rest))
    assert continued.run(embeddings[:30], [10, 15, 5], [100, 1500, 40], slots) is None  # the second piece's capture fails
    assert replays == []  # the first piece did not run: a continued prefill run twice would go on twice


@pytest.mark.parametrize("column_capacity", [1024, 4096])
def test_the_warm_up_captures_the_continued_prefill_over_every_column_count_the_store_holds(column_capacity, monkeypatch):
    """A conversation past 2,048 tokens replays graphs that read 4,096 columns: captured at warm-up where the store
    holds them (one first met while serving stalls every stream), each piece within the gathering limit."""
    from types import SimpleNamespace

    from app.model.continued_graphs import CONTINUED_GRAPH_LENGTHS, ContinuedPrefillGraphs
    from app.model.text.rows import GROUP_AREA

    store = SimpleNamespace(column_capacity=column_capacity, generation=0, device=torch.device("cpu"))
    fused = SimpleNamespace(embed=SimpleNamespace(embedding_dim=4, weight=torch.zeros(1)))
    buckets = []

    def ready(embeddings, lengths, starts, slots, bucket):
        buckets.append((len(lengths), bucket))
        assert max(starts) + bucket[0] <= bucket[1]
        return SimpleNamespace(replay=lambda: None), torch.zeros((len(lengths), 3))

    graphs = ContinuedPrefillGraphs(store, fused)
    monkeypatch.setattr(graphs, "_ready", ready)
    graphs.capture_all(max_rows=64)
    every_columns = [1024] if column_capacity == 1024 else [2048, 4096]
    assert sorted(buckets) == sorted((rows, (length, columns)) for columns in every_columns
                                     for rows, lengths in CONTINUED_GRAPH_LENGTHS.items() for length in lengths
                                     if rows * columns <= 64 * 2048 and length <= columns
                                     and rows * length * columns <= GROUP_AREA)


def test_a_continued_bucket_with_no_memory_to_capture_is_launched_from_then_on_and_the_rest_still_captured(monkeypatch):
    """No memory for one capture (PyTorch's OutOfMemoryError, or cuBLAS's allocation failure) refuses that bucket
    alone, not tried again until the graphs are cleared, the slots' states as they were; any other failure gives
    every capture up. A bucket whose attention mask would pass GROUP_AREA is refused up front."""
    from types import SimpleNamespace

    from app.model.continued_graphs import ContinuedPrefillGraphs

    state = torch.arange(8.0).view(4, 2)
    store = SimpleNamespace(column_capacity=4096, generation=0, device=torch.device("cpu"), conv={0: state.clone()},
                            recurrent={})
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor: tensor)  # no CUDA here
    graphs = ContinuedPrefillGraphs(store, fused=None)
    failures = {4096: torch.cuda.OutOfMemoryError("CUDA out of memory"),
                1024: RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")}
    captures = []

    def capture(run, name):
        captures.append(name)
        store.conv[0][2].add_(1.0)  # the warm-up runs move the slot's states on
        columns = int(name.split(" over ")[1].split()[0])
        if columns in failures:
            raise failures[columns]
        return SimpleNamespace(replay=lambda: None), torch.ones((1, 3))

    monkeypatch.setattr(graphs, "_capture", capture)
    long_one = dict(embeddings=torch.zeros((10, 4)), lengths=[10], starts=[3000], slots=[2])
    assert graphs.run(**long_one) is None and graphs.run(**long_one) is None
    assert len(captures) == 1 and graphs.refused == {(1, 16, 4096)} and not graphs.given_up
    assert torch.equal(store.conv[0], state)
    assert graphs.run(torch.zeros((10, 4)), [10], [100], [2]) is not None  # over 2,048 columns: captured
    store.column_capacity = 8192
    assert graphs._bucket([1000] * 4, [5000] * 4, None) is None  # 4 x 1,024 x 8,192 places: past GROUP_AREA
    assert graphs._bucket([1000] * 2, [5000] * 2, None) == (1024, 8192)
    graphs.clear()
    assert graphs.refused == set()
    store.column_capacity = 1024
    assert graphs.run(torch.zeros((10, 4)), [10], [100], [2]) is None and not graphs.given_up  # cuBLAS's
    failures[1024] = RuntimeError("operation not permitted when stream is capturing")
    assert graphs.run(torch.zeros((40, 4)), [40], [200], [2]) is None  # another bucket (64 tokens): not memory
    assert graphs.given_up and graphs.run(torch.zeros((10, 4)), [10], [100], [2]) is None


def test_halves_of_one_shape_each_replay_their_own_inputs_through_the_graphs_static_buffers(monkeypatch):
    """64 generation prompts of conversations past 2,048 tokens run as two halves of 32 (64 would gather too many
    keys and values) that share one captured graph and so its static inputs (ContinuedPrefillGraphs._ready puts
    a piece's embeddings and slots there): the second's are put in place only after the first has replayed, so
    each replay runs its own prompts and their logits come out in order. The graph here reads its static inputs
    when replayed, as a CUDA graph does."""
    from types import SimpleNamespace

    from app.model.continued_graphs import ContinuedPrefillGraphs

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor: tensor)  # no CUDA here
    store = SimpleNamespace(column_capacity=4096, generation=0, device=torch.device("cpu"), conv={}, recurrent={})
    graphs = ContinuedPrefillGraphs(store, fused=None)
    replayed_slots = []

    def capture_bucket(static_embeddings, static_places, rows, length, columns):
        output = torch.zeros((rows, 1))

        def replay():
            replayed_slots.append(static_places[2 * rows:].tolist())
            output[:, 0] = static_embeddings.view(rows, length, -1)[:, 0, 0]  # each row's first embedding value
        graphs.captured[rows, length, columns] = (static_embeddings, static_places, SimpleNamespace(replay=replay), output)
        return graphs.captured[rows, length, columns]

    monkeypatch.setattr(graphs, "_capture_bucket", capture_bucket)
    embeddings = torch.cat([torch.full((15, 2), float(row)) for row in range(64)])
    logits = graphs.run(embeddings, [15] * 64, [3000] * 64, list(range(100, 164)))
    assert list(graphs.captured) == [(32, 16, 4096)]
    assert replayed_slots == [list(range(100, 132)), list(range(132, 164))]
    assert logits[:, 0].tolist() == [float(row) for row in range(64)]
