"""Llama sizes: the published parameter counts of Llama 3 8B and 70B from their shapes, the flops convention,
and python -m spmd.plan --model llama."""

import dataclasses
import re
import subprocess
import sys

import pytest

from spmd.plan.llama_sizes import (
    PRESETS,
    LlamaShape,
    active_parameters,
    flops_per_token,
    llama_ffn,
    llama_parameters,
    resolve_shape,
    total_parameters,
)
from spmd.usage import UsageError


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spmd.plan", "--model", "llama", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("preset, count", [("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496)])
def test_the_published_llama_3_parameter_counts(preset, count):
    assert total_parameters(PRESETS[preset]) == count


def test_grok_1s_parameter_count_and_its_active_parameters_per_token():
    """xai-org/grok-1 publishes 314 B parameters; its shapes give 315.7 B with spmd's block (2 norms a block, Grok
    has 4: 0.8 M more). A token passes through its top-2 of 8 experts: 83.8 B active."""
    grok = PRESETS["grok-1"]
    h, layers, experts, f, vocab = 6144, 64, 8, 32768, 131072
    attention = 2 * h * h + 2 * h * 8 * 128
    per_expert = 3 * h * f
    assert total_parameters(grok) == layers * (attention + experts * per_expert + h * experts + 2 * h) + vocab * h + h
    assert abs(total_parameters(grok) / 314e9 - 1) < 0.01
    assert active_parameters(grok) == total_parameters(grok) - layers * (experts - 2) * per_expert
    assert round(active_parameters(grok) / 1e9, 1) == 83.8
    out = plan("--preset", "grok-1")
    assert out.returncode == 0, out.stderr
    assert "parameters: 316 B (315,684,034,560)" in out.stdout
    assert "active parameters per token: 83.8 B (83,755,800,576; its top-2 of 8 experts a block)" in out.stdout


def test_the_8b_breakdown_by_kind():
    params = llama_parameters(PRESETS["llama3-8b"])
    h, layers, vocab = 4096, 32, 128256
    assert params["embedding"] == params["lm_head"] == vocab * h
    assert params["attention.wq"] == params["attention.wo"] == layers * h * h
    assert params["attention.wk"] == params["attention.wv"] == layers * h * 8 * 128  # 8 kv heads of 128
    assert params["swiglu.w1"] == params["swiglu.w3"] == params["swiglu.w2"] == layers * h * 14336
    assert params["norms"] == layers * 2 * h and params["final_norm"] == h


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_tying_removes_exactly_the_head(preset):
    shape = dataclasses.replace(PRESETS[preset], tie_embeddings=False)
    tied = dataclasses.replace(shape, tie_embeddings=True)
    assert total_parameters(shape) - total_parameters(tied) == shape.vocab * shape.hidden
    assert flops_per_token(shape, 4096) == flops_per_token(tied, 4096)  # the head's matmul runs either way


def test_llamas_ffn_rule_gives_the_published_widths():
    assert llama_ffn(256) == PRESETS["debug"].ffn == 768
    assert llama_ffn(4096, 1024, 1.3) == 14336 and llama_ffn(8192, 4096, 1.3) == 28672


def test_flops_per_token_is_6n_plus_12lhqt_without_the_input_embedding():
    shape = PRESETS["llama3-8b"]
    n = 8_030_261_248 - 128256 * 4096
    assert flops_per_token(shape, 8192) == 6 * n + 12 * 32 * 32 * 128 * 8192 == 57_914_449_920


def test_flags_override_a_preset_and_describe_any_llama():
    assert resolve_shape("llama3-8b", layers=16, tie_embeddings=True) == dataclasses.replace(
        PRESETS["llama3-8b"], layers=16, tie_embeddings=True
    )
    assert resolve_shape(None, layers=6, hidden=256, heads=16, vocab=2048, seq=2048) == PRESETS["debug"]
    with pytest.raises(UsageError, match="--vocab"):
        resolve_shape(None, layers=2, hidden=256, seq=16)
    with pytest.raises(UsageError, match="--kv-heads 5"):
        LlamaShape(layers=1, hidden=256, heads=16, kv_heads=5, ffn=768, vocab=10)


def test_the_command_prints_the_8b_count_and_the_flops_convention():
    done = plan("--preset", "llama3-8b")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "parameters: 8.03 B (8,030,261,248)" in out
    assert "convention: PaLM's / nanoGPT's 6N + 12 L H Q T" in out and "embedding excluded" in out
    assert "active parameters per token: 8.03 B" in out
    for label in (
        "embedding",
        "attention Wq",
        "attention Wk",
        "attention Wv",
        "attention Wo",
        "SwiGLU W1",
        "SwiGLU W3",
        "SwiGLU W2",
        "norms",
        "final norm",
        "LM head",
        "total",
    ):
        assert any(line.startswith(label) for line in out.splitlines()), label


def test_the_command_prints_the_70b_count_and_the_fsdp_state():
    done = plan("--preset", "llama3-70b", "--devices", "8", "--memory-gb", "80")
    assert done.returncode == 0, done.stderr
    assert "parameters: 70.6 B" in done.stdout
    assert "pure FSDP (ZeRO-3) over 8 devices" in done.stdout and "does NOT fit in 80 GB" in done.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (["--preset", "llama3-9b"], "--preset"),
        (["--layers", "2", "--hidden", "64", "--seq", "8"], "--vocab"),
        (["--preset", "debug", "--kv-heads", "3"], "--kv-heads 3"),
    ],
)
def test_bad_llama_flags_are_refused_naming_them(args, words):
    done = plan(*args)
    assert done.returncode == 2 and words in done.stderr, done.stderr


def test_llama_flags_are_refused_for_the_other_models():
    done = subprocess.run(
        [sys.executable, "-m", "spmd.plan", "--preset", "llama3-8b", "--devices", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--preset is for --model llama" in done.stderr, done.stderr


def test_the_engines_units_hold_the_published_counts():
    """The model the engine trains (its registry's unit sizes) and the planner's count agree: Llama 3 8B's and
    70B's shapes as spmd's LM hold 8,030,261,248 and 70,553,706,496 parameters."""
    from spmd.model import Net
    from spmd.model.registry import full_sizes

    for preset, count in (("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496)):
        s = PRESETS[preset]
        net = Net(
            model="llama",
            layers=s.layers,
            hidden=s.hidden,
            ffn=s.ffn,
            heads=s.heads,
            kv_heads=s.kv_heads,
            vocab=s.vocab,
            seq=8,
            batch=1,
        )
        assert sum(full_sizes(net)) == count == sum(llama_parameters(s).values())


def test_the_runs_mfu_counts_the_flops_the_planner_does():
    """The MFU in a run's step lines (spmd.harness.mfu) and the planner count a token's flops alike (PaLM's
    6N + 12 L H Q T, N without the input embedding), untied and tied."""
    from spmd.harness.mfu import flops_per_token as run_flops
    from spmd.model import Net

    for tied in (False, True):
        s = dataclasses.replace(PRESETS["debug"], tie_embeddings=tied)
        net = Net(
            model="llama",
            layers=s.layers,
            hidden=s.hidden,
            ffn=s.ffn,
            heads=s.heads,
            kv_heads=s.kv_heads,
            vocab=s.vocab,
            seq=s.context,
            batch=1,
            tie_embeddings=tied,
        )
        assert run_flops(net) == flops_per_token(s, s.context)


def test_the_layout_table_names_every_layout_whole_and_merges_only_equal_rows():
    """No layout name cut short ("m 16" never reads "m 1"); two rows with the same numbers whose layouts differ in
    one part are one row naming both; refusals counted by reason."""
    from spmd.plan.__main__ import merged_rows

    assert merged_rows(
        [
            ("a, ZeRO-1, m 4", "1 2"),
            ("a, ZeRO-2, m 4", "1 2"),
            ("a, ZeRO-3, m 4", "1 3"),
            ("b, ZeRO-1, m 16", "1 3"),
            ("c, ZeRO-3, m 4", "1 3"),
        ]
    ) == [
        ("a, ZeRO-1|ZeRO-2, m 4", "1 2"),
        ("a, ZeRO-3, m 4", "1 3"),
        ("b, ZeRO-1, m 16", "1 3"),
        ("c, ZeRO-3, m 4", "1 3"),
    ]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "spmd.plan",
            "--model",
            "llama",
            "--preset",
            "llama3-8b",
            "--devices",
            "16",
            "--batch",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith(("pp=", "fsdp=", "dp=", "tp=", "cp="))]
    assert rows and all(re.search(r", m \d+ +\d", line) for line in rows)
    assert "ZeRO-1|ZeRO-2" in run.stdout and re.search(r"; \d+ refused", run.stdout)
