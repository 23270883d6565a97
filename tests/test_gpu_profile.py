"""app/model/gpu_profile.py's account of a GPU timeline (the profile itself needs a GPU), and its answer on the CPU."""

from app.model.gpu_profile import Span, summary

MS = 1_000_000


def test_busy_time_overlap_gaps_and_kinds_of_a_timeline():
    spans = [
        Span(0, 4 * MS, 7, "ampere_bf16_gemm_128x128", False),  # vision stream
        Span(1 * MS, 2 * MS, 13, "void cudnn::fmha_fwd", False),  # serving stream, beside it
        Span(4 * MS, 5 * MS, 13, "triton_chunk_gated_delta_rule", True),
        Span(6 * MS, 7 * MS, 13, "Memcpy DtoH (Device -> Pinned)", False),  # after a 1 ms gap
        Span(7 * MS + 10_000, 8 * MS, 7, "elementwise_kernel", False),  # 0.01 ms: not a gap
    ]
    report = summary(spans)
    assert report["window_ms"] == 8.0 and report["busy_ms"] == 6.99 and report["busy_share"] == 0.874
    assert report["busy_ms_by_stream"] == {"7": 4.99, "13": 3.0}
    assert report["two_streams_at_once_ms"] == 1.0
    assert report["gaps"] == {"at_least_ms": 0.05, "count": 1, "total_ms": 1.0, "longest_ms": [1.0]}
    assert report["kernel_ms_by_kind"] == {"matrix products": 4.0, "attention": 1.0, "Triton kernels": 1.0,
                                           "copies": 1.0, "other kernels": 0.99}
    assert report["from_graphs_ms"] == 1.0
    assert report["top_kernels"]["ampere_bf16_gemm_128x128"] == {"ms": 4.0, "count": 1}
    assert list(report["top_kernels"])[-1] == "elementwise_kernel"
    assert report["idle_ms_after"] == {"triton_chunk_gated_delta_rule": 1.0}  # the last to end before the gap
    assert summary([]) == {}


def test_long_kernel_names_are_cut_and_the_costliest_come_first():
    from app.model.gpu_profile import NAME_CHARS, TOP_NAMES

    spans = [Span(i * MS, i * MS + (i + 1) * 1000, 7, f"kernel_{i}_" + "<float, 128>" * 50, False) for i in range(20)]
    report = summary(spans)
    names = list(report["top_kernels"])
    assert len(names) == TOP_NAMES and all(len(name) == NAME_CHARS and name.endswith("...") for name in names)
    assert names[0].startswith("kernel_19_") and report["top_kernels"][names[0]] == {"ms": 0.02, "count": 1}
    assert sum(report["idle_ms_after"].values()) <= report["gaps"]["total_ms"]


def test_the_collectors_pauses_are_timed_while_the_block_runs():
    import gc

    from app.model.gpu_profile import collector_pauses

    with collector_pauses() as pauses:
        gc.collect()
        gc.collect(0)
    assert len(pauses[2]) == 1 and len(pauses[0]) >= 1 and all(ms >= 0 for ms in pauses[0] + pauses[2])
    gc.collect()
    assert len(pauses[2]) == 1  # not timed after the block
