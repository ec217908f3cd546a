"""The documents' generated figures equal what their recipes print now (python -m spmd.observe.docs).

Each table or transcript between `<!-- recipe: NAME -->` and `<!-- end: NAME -->` in README.md is run from the sh
block beside it, at the documented size, and compared: text and numbers as printed, a measured column
(tracemalloc's peak) within 5%; a memory picture the block draws by the numbers it draws (kept in the PNG).
`make docs` rewrites them; this test (slow: make test-docs) fails when one drifts from the code. The comparison
itself is checked here too, quickly.
"""

import pytest

from spmd.observe.docs import Figure, differences, figures, is_table, picture_differences, run, stale

FIGURES = figures()


def test_the_documents_have_their_generated_figures_and_each_has_output():
    names = [f.name for f in FIGURES]
    assert len(names) == len(set(names)) >= 12
    for figure in FIGURES:
        assert figure.output.strip(), f"{figure.name}: empty (run make docs)"
        assert figure.script.strip().splitlines()[-1].startswith("python -m spmd"), figure.name


def figure(output: str, measured=("peak MiB",)) -> Figure:
    return Figure("README.md", "t", "python -m spmd x", measured, output)


def test_a_figure_differs_where_a_number_or_word_changed_and_not_where_a_measurement_moved_a_little():
    table = "| layout | held MiB | peak MiB |\n| --- | --- | --- |\n| dp=8 | 35.63 | 35.84 |\n"
    assert differences(figure(table), table) == []
    assert differences(figure(table), table.replace("35.84", "35.99")) == []  # measured, within 5%
    assert differences(figure(table), table.replace("35.84", "39.00"))  # measured, beyond
    assert differences(figure(table), table.replace("35.63", "35.64"))  # held: exact as printed
    assert differences(figure(table), table.replace("dp=8", "dp=4"))
    assert differences(figure(table), table + "| fsdp=8 | 1 | 1 |\n")  # a row more
    transcript = "```\nparameters: 8.03 B\n```\n"
    assert differences(figure(transcript), transcript) == []
    assert differences(figure(transcript), transcript.replace("8.03", "8.04"))


def test_a_timed_column_is_not_compared_and_a_caption_line_does_not_hide_the_header():
    table = "pp=4\n| schedule | T_F ms | held MiB |\n| --- | --- | --- |\n| zb-h1 | 11.21 | 22.02 |\n"
    timed = Figure("README.md", "t", "python -m spmd x", (), table, ("T_F ms",))
    assert differences(timed, table.replace("11.21", "19.00")) == []
    assert differences(timed, table.replace("22.02", "22.03"))
    assert differences(timed, table.replace("pp=4", "pp=2"))


def test_a_rewrite_takes_a_timed_regions_new_times_and_keeps_a_measurement_that_moved_a_little():
    table = "| schedule | T_F ms | held MiB |\n| --- | --- | --- |\n| zb-h1 | 11.21 | 22.02 |\n"
    timed = Figure("README.md", "t", "python -m spmd x", (), table, ("T_F ms",))
    measured = Figure("README.md", "m", "python -m spmd x", ("held MiB",), table)
    assert stale(timed, table.replace("11.21", "19.00"))  # beside the pictures drawn from the same run
    assert not stale(timed, table)
    assert not stale(measured, table.replace("22.02", "22.10"))
    assert stale(measured, table.replace("22.02", "29.00"))


def test_a_table_stays_markdown_and_anything_else_is_fenced():
    assert is_table("| a |\n|---|\n| 1 |\n") and is_table("caption\n| a |\n|---|\n")
    assert not is_table("parameters: 8.03 B\n") and not is_table("caption\n| a |\nmore text\n")
    assert not is_table("one\ntwo\n| a |\n")


@pytest.mark.slow  # every recipe at its documented size: about 5 minutes on 2 cores (make test-docs)
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", [f.name for f in FIGURES])
def test_a_generated_figure_is_what_its_recipe_prints_now(name, tmp_path):
    (found,) = [f for f in FIGURES if f.name == name]
    docs = tmp_path / "docs"
    docs.mkdir()
    found_now = differences(found, run(found, docs)) + picture_differences(found, docs)
    assert not found_now, f"{found.document}'s {name} differs from its recipe (make docs):\n" + "\n".join(found_now)


def test_a_memory_picture_keeps_the_numbers_it_draws(tmp_path):
    import json

    from spmd.observe.docs import drawn
    from spmd.observe.plot import main as plot

    report = {
        "strategy": "train",
        "mesh": "dp=2",
        "ranks": 2,
        "layout": "mesh dp=2",
        "model": {"model": "mlp", "layers": 2, "hidden": 4, "ffn": 8, "tokens": 8, "dtype": "float64"},
        "memory": [dict(params=2**20, master=0, grads=2**20, optimizer=2**21, activations=3 * 2**19, buffers=0)] * 2,
    }
    (tmp_path / "r.json").write_text(json.dumps(report))
    assert plot(["--memory", str(tmp_path / "r.json"), "--out", str(tmp_path / "m.png")]) == 0
    assert drawn(tmp_path / "m.png").splitlines()[0] == (
        "mesh dp=2 rank 0: params 1.00 master 0.00 grads 1.00 optimizer 2.00 activations 1.50 buffers 0.00"
    )
