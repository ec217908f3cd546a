"""The training flags are generated from Net's fields: every field is a flag, parsed into the field itself."""

from dataclasses import fields

import pytest

from spmd.harness import compose_cli
from spmd.harness.net_flags import net_fields
from spmd.model.config import Net
from spmd.trainers.presets import PRESETS


def test_every_net_field_is_a_train_flag_whose_value_lands_in_that_field():
    parser = compose_cli.build_parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    missing = [f.name for f in fields(Net) if "--" + f.name.replace("_", "-") not in flags]
    assert missing == []
    args = parser.parse_args(["--model", "llama", "--kv-heads", "2", "--top-k", "1", "--tie-embeddings"])
    chosen = net_fields(args)
    assert set(chosen) == {f.name for f in fields(Net)}
    assert (chosen["model"], chosen["kv_heads"], chosen["top_k"], chosen["tie_embeddings"]) == ("llama", 2, 1, True)


OWN = {"microbatches", "chunks", "vocab"}  # the command fills these from the mesh and the corpus


def net_of(argv: list[str]) -> Net:
    return Net(**{k: v for k, v in net_fields(compose_cli.build_parser().parse_args(argv)).items() if k not in OWN})


def test_the_defaults_of_the_flags_are_nets_own():
    assert net_of([]) == Net()


def test_a_model_ties_its_embeddings_as_it_does_by_default_and_either_flag_overrides_it():
    tied = {
        (model, tuple(flags)): net_of(["--model", model, *flags]).tie_embeddings
        for model in ("llama", "gpt2")
        for flags in ([], ["--tie-embeddings"], ["--no-tie-embeddings"])
    }
    assert tied == {
        ("llama", ()): False,
        ("llama", ("--tie-embeddings",)): True,
        ("llama", ("--no-tie-embeddings",)): False,
        ("gpt2", ()): True,
        ("gpt2", ("--tie-embeddings",)): True,
        ("gpt2", ("--no-tie-embeddings",)): False,
    }


def test_the_mlp_commands_take_nets_optimizer_flags_and_no_other_net_flag():
    parser = compose_cli.build_parser(PRESETS["mlp-dp"])
    args = parser.parse_args(["--optimizer", "adamw", "--weight-decay", "0.1", "--tokens", "8"])
    chosen = net_fields(args)
    assert {k: chosen[k] for k in ("optimizer", "precision", "reduce_dtype", "weight_decay", "batch")} == {
        "optimizer": "adamw",
        "precision": "",
        "reduce_dtype": "",
        "weight_decay": 0.1,
        "batch": 8,
    }
    flags = {s for a in parser._actions for s in a.option_strings}
    assert not {"--experts", "--kv-heads", "--batch", "--seq", "--heads", "--model", "--sp", "--data"} & flags


# every flag the mlp-* commands had before they became presets of train's parser, with its default
MLP_COMMAND_FLAGS = {
    "--mesh": None,
    "--layers": 4,
    "--hidden": 64,
    "--ffn": 256,
    "--tokens": 64,
    "--steps": None,
    "--microbatches": None,
    "--chunks": None,
    "--dtype": "float64",
    "--lr": None,
    "--momentum": 0.5,
    "--integers": False,
    "--seed": 0,
    "--optimizer": "sgd",
    "--precision": "",
    "--reduce-dtype": "",
    "--weight-decay": 0.01,
    "--no-overlap": True,
    "--devices": None,
    "--backend": "auto",
    "--check": False,
    "--json": None,
    "--trace": None,
    "--out-dir": None,
    "--log-every": 10,
    "--save": None,
    "--save-every": 0,
    "--keep": 0,
    "--load": None,
    "--quiet": False,
    "--schedule": False,
    "--timeout": 300.0,
    "--blas-threads": None,
    "--memory-limit": None,
    "--debug": False,
    "--config": None,
    "--print-config": False,
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_has_every_flag_the_mlp_commands_had_with_its_default_and_lists_them(name):
    parser = compose_cli.build_parser(PRESETS[name])
    defaults = {a.option_strings[-1]: a.default for a in parser._actions if a.option_strings[-1] != "--help"}
    assert defaults == MLP_COMMAND_FLAGS
    shown = parser.format_help()
    assert all(flag in shown for flag in MLP_COMMAND_FLAGS) and f"python -m spmd {name}" in shown
    for action in parser._actions:  # each says what it does, and its default where it has one
        if action.option_strings[-1] != "--help" and action.default not in (None, False, "") and action.nargs != 0:
            assert "default" in action.help, action.option_strings


def test_a_preset_fills_its_defaults_from_the_run():
    """Without the flags: 2 micro-batches a pipeline stage (at most a row each), 2 chunks for an interleaved
    pipeline, 1 step with --integers, --lr 0.2 / (tokens x hidden); one token a sequence, the MLP."""
    pp, _ = PRESETS["mlp-pp-interleaved"].resolve(4, layers=8)
    assert (pp.microbatches, pp.chunks, pp.steps, pp.seq, pp.batch, pp.model) == (8, 2, 2, 1, 64, "mlp")
    few, _ = PRESETS["mlp-pp-1f1b"].resolve(4, batch=5)
    assert few.microbatches == 5
    exact, _ = PRESETS["mlp-dp"].resolve(2, integers=True, layers=2, hidden=16, ffn=32)
    assert (exact.steps, exact.microbatches, exact.chunks, exact.rate) == (1, 1, 1, 0.2 / (64 * 16))


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--sp"], "--sp is python -m spmd train's: python -m spmd mlp-sp sets it itself"),
        (["--heads", "2", "--tokns", "4"], "--heads is python -m spmd train's: python -m spmd mlp-sp sets it itself; "),
        (["--tokns", "4"], "--tokns: did you mean --tokens?"),
        (["--batch", "4"], "--batch: python -m spmd mlp-sp spells it --tokens"),
    ],
)
def test_a_flag_a_preset_does_not_have_is_refused_naming_whose_it_is(argv, says, capsys):
    with pytest.raises(SystemExit) as stop:
        compose_cli.main(argv, PRESETS["mlp-sp"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and says in err and err.count("\n") == 1, err
