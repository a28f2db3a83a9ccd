"""``bench/vs_vllm.py`` without vLLM: workload generation, ratio arithmetic, arguments."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import _vs_vllm_workloads as workloads  # noqa: E402
import vs_vllm  # noqa: E402


def test_uniform_workloads_have_the_issue_shapes():
    shapes = {
        "w64": (64, 128, 64, 1),
        "b1": (1, 16, 256, 1),
        "long": (16, 2000, 32, 1),
        "decode": (32, 64, 512, 1),
        "w64_t2": (64, 128, 64, 2),
    }
    for name, (n, prompt_len, new, threads) in shapes.items():
        w = workloads.build(name)
        assert len(w.prompts) == n and {len(p) for p in w.prompts} == {prompt_len}
        assert w.outputs == [new] * n and w.threads == threads
        assert w.output_tokens == n * new
        ids = {i for p in w.prompts for i in p}
        assert min(ids) >= workloads.ID_LOW and max(ids) < workloads.ID_HIGH


def test_workloads_are_deterministic_across_builds():
    assert workloads.build("mixed") == workloads.build("mixed")
    assert workloads.build("w64").prompts != workloads.build("long").prompts[:64]


def test_mixed_draws_lengths_then_prompts_from_seed_2():
    w = workloads.build("mixed")
    rng = random.Random(2)
    lens = [rng.randint(32, 512) for _ in range(256)]
    outs = [rng.randint(16, 256) for _ in range(256)]
    assert [len(p) for p in w.prompts] == lens and w.outputs == outs
    assert w.prompts[0] == [rng.randrange(1000, 30000) for _ in range(lens[0])]


def test_prefix_workload_shares_a_prefix_in_every_other_request():
    mixed, pre = workloads.build("mixed"), workloads.build("prefix")
    assert [len(p) for p in pre.prompts] == [len(p) for p in mixed.prompts]
    assert pre.outputs == mixed.outputs
    shared = pre.prompts[0][: len(pre.prompts[0]) - 16]
    for i, (p, m) in enumerate(zip(pre.prompts, mixed.prompts, strict=True)):
        k = min(workloads.SHARED_PREFIX, len(p) - 16)
        if i % 2 == 0:
            assert p[:k] == shared[:k] and p[k:] == m[k:]
        else:
            assert p == m


def test_ratio_stats_pairs_rounds_by_index():
    best, low, high = vs_vllm.ratio_stats([100.0, 120.0, 90.0], [100.0, 80.0, 100.0])
    assert best == pytest.approx(1.2)
    assert (low, high) == (pytest.approx(0.9), pytest.approx(1.5))
    with pytest.raises(ValueError):
        vs_vllm.ratio_stats([1.0], [1.0, 2.0])


def test_scaling_needs_both_thread_counts_of_a_system():
    r = {"w64": vs_vllm.Result([100.0, 110.0], [90.0]), "w64_t2": vs_vllm.Result([150.0], [])}
    assert vs_vllm.scaling(r, "ours") == pytest.approx(150.0 / 110.0)
    assert vs_vllm.scaling(r, "vllm") is None
    assert vs_vllm.scaling({"w64": r["w64"]}, "ours") is None


def test_thread_groups_keep_order_and_split_by_threads():
    groups = vs_vllm.thread_groups(["mixed", "w64_t2", "b1", "b1_t2"])
    assert groups == {1: ["mixed", "b1"], 2: ["w64_t2", "b1_t2"]}


def test_parse_args_defaults_and_errors(tmp_path, capsys):
    args = vs_vllm.parse_args([])
    assert args.workloads == list(workloads.DEFAULT) and args.vllm_python is None
    assert vs_vllm.parse_args(["--workloads", " mixed, w64 "]).workloads == ["mixed", "w64"]
    for bad in (
        ["--workloads", "nope"],
        ["--rounds", "0"],
        ["--workloads", ","],
        ["--vllm-python", str(tmp_path / "missing")],
    ):
        with pytest.raises(SystemExit):
            vs_vllm.parse_args(bad)
    assert "nope" in capsys.readouterr().err


def test_vllm_thread_binding_follows_the_taskset_list():
    assert vs_vllm._bind("0", 1) == "0"
    assert vs_vllm._bind("0,1", 1) == "0"
    assert vs_vllm._bind("0,1", 2) == "0,1"
    assert vs_vllm._bind("2-3", 1) == "2"


def test_parse_args_ab_options(tmp_path):
    args = vs_vllm.parse_args(
        [
            "--base-root",
            str(Path(__file__).resolve().parents[2]),
            "--ours-config",
            '{"max_num_batched_tokens": 4096}',
        ]
    )
    assert args.ours_config == {"max_num_batched_tokens": 4096} and args.base_config == {}
    with pytest.raises(SystemExit):
        vs_vllm.parse_args(["--base-root", str(tmp_path)])  # no checkout there
    with pytest.raises(SystemExit):
        vs_vllm.parse_args(["--ours-config", "{not json"])
