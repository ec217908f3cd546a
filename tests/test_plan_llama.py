"""Llama sizes: the published parameter counts of Llama 3 8B and 70B from their presets, counted through the
model's spec (the units the engine allocates), the flops convention, and python -m spmd.plan --model llama;
tests/llama_count.py counts the same shapes on its own, a cross-check that shares no code with the spec."""

import dataclasses
import re
import subprocess
import sys

import pytest
from llama_count import PRESETS as SHAPES
from llama_count import LlamaShape, llama_parameters, resolve_shape
from llama_count import active_parameters as counted_active
from llama_count import flops_per_token as counted_flops
from llama_count import total_parameters as counted_total

from spmd.model import Net
from spmd.model.llama import llama_ffn
from spmd.model.registry import full_sizes, parameters
from spmd.model.shapes import PRESETS
from spmd.plan.lm_report import by_label, flops_per_token, idle_parameters
from spmd.usage import UsageError

LLAMAS = sorted(name for name, (_, fields) in PRESETS.items() if fields["model"] == "llama")


def preset(name: str, **changes) -> Net:
    return Net(**{**PRESETS[name][1], **changes})


def active_parameters(net: Net) -> int:
    return parameters(net) - idle_parameters(net)


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spmd.plan", "--model", "llama", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("name, count", [("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496)])
def test_the_published_llama_3_parameter_counts(name, count):
    assert parameters(preset(name)) == count == counted_total(SHAPES[name])


def test_grok_1s_parameter_count_and_its_active_parameters_per_token():
    """xai-org/grok-1 publishes 314 B parameters; its shapes give 315.7 B with spmd's block (2 norms a block, Grok
    has 4: 0.8 M more). A token passes through its top-2 of 8 experts: 83.8 B active."""
    grok = preset("grok-1")
    h, layers, experts, f, vocab = 6144, 64, 8, 32768, 131072
    attention = 2 * h * h + 2 * h * 8 * 128
    per_expert = 3 * h * f
    assert parameters(grok) == layers * (attention + experts * per_expert + h * experts + 2 * h) + vocab * h + h
    assert abs(parameters(grok) / 314e9 - 1) < 0.01
    assert active_parameters(grok) == parameters(grok) - layers * (experts - 2) * per_expert
    assert round(active_parameters(grok) / 1e9, 1) == 83.8
    assert active_parameters(grok) == counted_active(SHAPES["grok-1"])
    out = plan("--preset", "grok-1")
    assert out.returncode == 0, out.stderr
    assert "parameters: 316 B (315,684,034,560)" in out.stdout
    assert "active parameters per token: 83.8 B (83,755,800,576; its top-2 of 8 experts a block)" in out.stdout


def test_the_8b_breakdown_by_kind():
    rows = by_label(preset("llama3-8b"))
    h, layers, vocab = 4096, 32, 128256
    assert rows["embedding (V x h)"][2] == rows["LM head (h x V)"][2] == vocab * h
    assert rows["attention Wq (h x H*Q)"] == rows["attention Wo (H*Q x h)"] == (h * h, layers, layers * h * h)
    assert rows["attention Wk (h x kv*Q)"][2] == rows["attention Wv (h x kv*Q)"][2] == layers * h * 8 * 128
    assert rows["SwiGLU W1 (h x f, gate)"][2] == rows["SwiGLU W2 (f x h, down)"][2] == layers * h * 14336
    assert rows["norms (2 RMSNorm of h)"] == (2 * h, layers, layers * 2 * h)
    assert rows["final norm (RMSNorm of h)"] == (0, 0, h) and "router (h x E)" not in rows
    counted = llama_parameters(SHAPES["llama3-8b"])  # the independent count, kind by kind
    assert [n for _, _, n in rows.values()] == [n for kind, n in counted.items() if kind != "router"]


@pytest.mark.parametrize("name", LLAMAS)
def test_tying_removes_exactly_the_head(name):
    untied, tied = preset(name, tie_embeddings=False), preset(name, tie_embeddings=True)
    assert parameters(untied) - parameters(tied) == untied.vocab * untied.hidden
    assert flops_per_token(untied) == flops_per_token(tied)  # the head's matmul runs either way


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_units_parameter_table_covers_the_unit(name):
    """Each unit's pieces (the spec's parameter table) tile its flat vector: their sizes sum to the unit's."""
    net = preset(name)
    spec = net.spec
    for kind, size in zip(spec.kinds(net), full_sizes(net), strict=True):
        assert sum(piece.size for piece in spec.table(net, kind)) == size, kind


def test_llamas_ffn_rule_gives_the_published_widths():
    assert llama_ffn(256) == PRESETS["debug"][1]["ffn"] == 768
    assert llama_ffn(4096, 1024, 1.3) == 14336 and llama_ffn(8192, 4096, 1.3) == 28672


def test_flops_per_token_is_6n_plus_12lhqt_without_the_input_embedding():
    n = 8_030_261_248 - 128256 * 4096
    assert flops_per_token(preset("llama3-8b")) == 6 * n + 12 * 32 * 32 * 128 * 8192 == 57_914_449_920
    for name in LLAMAS:
        assert flops_per_token(preset(name)) == counted_flops(SHAPES[name], SHAPES[name].context), name


def test_the_independent_counter_reads_its_shapes_as_the_presets_say():
    assert resolve_shape("llama3-8b", layers=16, tie_embeddings=True) == dataclasses.replace(
        SHAPES["llama3-8b"], layers=16, tie_embeddings=True
    )
    assert resolve_shape(None, layers=6, hidden=256, heads=16, vocab=2048, seq=2048) == SHAPES["debug"]
    with pytest.raises(UsageError, match="--kv-heads 5"):
        LlamaShape(layers=1, hidden=256, heads=16, kv_heads=5, ffn=768, vocab=10)
    for name in LLAMAS:
        shape, fields = SHAPES[name], PRESETS[name][1]
        assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.ffn, shape.vocab, shape.context) == (
            fields["layers"],
            fields["hidden"],
            fields["heads"],
            fields["kv_heads"],
            fields["ffn"],
            fields["vocab"],
            fields["seq"],
        )


def test_flags_override_a_preset_and_describe_any_llama():
    done = plan("--preset", "llama3-8b", "--layers", "16", "--tie-embeddings")
    assert done.returncode == 0, done.stderr
    assert "with the flags' changes" in done.stdout
    assert f"({counted_total(dataclasses.replace(SHAPES['llama3-8b'], layers=16, tie_embeddings=True)):,})" in (
        done.stdout
    )
    done = plan("--layers", "6", "--hidden", "256", "--heads", "16", "--vocab", "2048", "--seq", "2048")
    assert done.returncode == 0 and f"({counted_total(SHAPES['debug']):,})" in done.stdout, done.stderr


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


def test_a_preset_names_its_model_and_is_refused_for_another():
    def run(*args):
        return subprocess.run([sys.executable, "-m", "spmd.plan", *args], capture_output=True, text=True, timeout=60)

    done = run("--preset", "llama3-8b")
    assert done.returncode == 0 and "parameters: 8.03 B (8,030,261,248)" in done.stdout, done.stderr
    done = run("--model", "transformer", "--preset", "llama3-8b", "--devices", "4")
    assert done.returncode == 2 and "--preset llama3-8b is a --model llama" in done.stderr, done.stderr
    done = run("--model", "mlp", "--vocab", "8", "--layers", "2", "--hidden", "8", "--seq", "4", "--devices", "2")
    assert done.returncode == 2 and "--vocab is for a language model" in done.stderr, done.stderr


def test_the_runs_mfu_counts_the_flops_the_planner_does():
    """The MFU in a run's step lines (spmd.harness.mfu) and the planner count a dense token's flops alike (PaLM's
    6N + 12 L H Q T, N without the input embedding), untied and tied."""
    from spmd.harness.mfu import flops_per_token as run_flops

    for tied in (False, True):
        net = preset("debug", tie_embeddings=tied, batch=1)
        assert (
            run_flops(net)
            == flops_per_token(net)
            == counted_flops(dataclasses.replace(SHAPES["debug"], tie_embeddings=tied), 2048)
        )


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
