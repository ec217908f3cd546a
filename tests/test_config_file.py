"""train --config run.toml: every flag a key, the command line wins, --print-config writes what --config reads back,
bad files are one line and exit 2 naming the key; a checkpoint records the flags; --keep N newest checkpoints."""

import json

import pytest

from spmd.harness import compose_cli
from spmd.trainers.presets import PRESETS

TINY = 'model = "llama"\nlayers = 1\nhidden = 8\nffn = 12\nheads = 2\nseq = 8\nbatch = 2\nsteps = 3\ndevices = 2\n'


def printed(main, argv, capsys) -> str:
    assert main([*argv, "--print-config"]) == 0
    return capsys.readouterr().out


def refused(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    return err


def test_print_config_is_a_file_config_reads_back_to_the_same_flags(tmp_path, capsys):
    (tmp_path / "run.toml").write_text(TINY + "kv_heads = 1\ntie-embeddings = true\nno-overlap = true\n")
    text = printed(compose_cli.main, ["--config", str(tmp_path / "run.toml"), "--steps", "5"], capsys)
    lines = text.splitlines()
    assert "steps = 5" in lines and "steps = 3" not in lines  # the command line wins over the file
    assert {"kv-heads = 1", "tie-embeddings = true", "no-overlap = true", 'model = "llama"', "hidden = 8"} <= set(lines)
    (tmp_path / "resolved.toml").write_text(text)
    assert printed(compose_cli.main, ["--config", str(tmp_path / "resolved.toml")], capsys) == text
    assert printed(compose_cli.main, [], capsys) != text  # not simply the defaults


def test_a_preset_command_reads_its_own_flags_from_a_file(tmp_path, capsys):
    (tmp_path / "mlp.toml").write_text("tokens = 4\nhidden = 8\n")
    mlp_dp = lambda argv: compose_cli.main(argv, PRESETS["mlp-dp"])  # noqa: E731
    lines = printed(mlp_dp, ["--config", str(tmp_path / "mlp.toml"), "--devices", "2"], capsys).splitlines()
    assert "tokens = 4" in lines and "hidden = 8" in lines
    (tmp_path / "bad.toml").write_text("heads = 2\n")  # a flag of train, not of the mlp commands
    assert "'heads' is not a flag of python -m spmd mlp-dp" in refused(
        mlp_dp, ["--config", str(tmp_path / "bad.toml")], capsys
    )


@pytest.mark.parametrize(
    "body, says",
    [
        ("layrs = 2", "'layrs' is not a flag of python -m spmd train (did you mean layers?)"),
        ('layers = "2"', "layers = '2': expected an integer"),
        ("layers = 2.5", "layers = 2.5: expected an integer"),
        ("lr = true", "lr = True: expected a number"),
        ("sp = 1", "sp = 1: expected true or false"),
        ("zero = 5", "zero = 5: expected one of 1, 2, 3"),
        ('model = "gpt9"', "model = 'gpt9': expected one of"),
        ('pipeline = "zbv:1,x"', "pipeline = 'zbv:1,x': pipeline schedule"),
        ("layers = ", "not TOML"),
    ],
)
def test_a_bad_config_is_one_line_naming_the_file_and_key(tmp_path, capsys, body, says):
    (tmp_path / "run.toml").write_text(body + "\n")
    err = refused(compose_cli.main, ["--config", str(tmp_path / "run.toml")], capsys)
    assert f"--config {tmp_path / 'run.toml'}: " in err and says in err


def test_a_missing_config_file_is_named(tmp_path, capsys):
    err = refused(compose_cli.main, ["--config", str(tmp_path / "none.toml")], capsys)
    assert "none.toml: cannot be read (No such file or directory)" in err


def test_checkpoints_record_the_flags_and_keep_the_newest(tmp_path, capsys):
    (tmp_path / "run.toml").write_text(TINY)
    argv = [
        "--config",
        str(tmp_path / "run.toml"),
        "--steps",
        "4",
        "--save",
        str(tmp_path / "ck"),
        "--save-every",
        "1",
        "--keep",
        "2",
        "--quiet",
        "--backend",
        "threads",
    ]
    assert compose_cli.main(argv) == 0
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000003", "step-00000004"]
    manifest = json.loads((tmp_path / "ck" / "step-00000004" / "manifest.json").read_text())
    assert manifest["config"]["steps"] == 4 and manifest["config"]["keep"] == 2 and manifest["config"]["heads"] == 2
    assert compose_cli.main(argv) == 0  # the same steps saved again: replaced, no old folder left beside them
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000003", "step-00000004"]
    assert "--keep 2: give N >= 1 newest checkpoints to keep, with --save DIR" in refused(
        compose_cli.main, ["--config", str(tmp_path / "run.toml"), "--keep", "2"], capsys
    )
