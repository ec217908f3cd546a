"""The training flags are generated from Net's fields: every field is a flag, parsed into the field itself."""

from dataclasses import fields

from spmd.harness import compose_cli, train_cli
from spmd.harness.net_flags import net_fields
from spmd.model.config import Net


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
    parser = train_cli.build_parser()
    args = parser.parse_args(["mlp-dp", "--optimizer", "adamw", "--weight-decay", "0.1"])
    assert net_fields(args, train_cli.OPTIMIZER_FIELDS) == {
        "optimizer": "adamw",
        "precision": "",
        "reduce_dtype": "",
        "weight_decay": 0.1,
    }
    flags = {s for a in parser._actions for s in a.option_strings}
    assert "--experts" not in flags and "--kv-heads" not in flags
