"""The README's recipes run as pasted: every ```sh block, line by line in bash, in an empty folder.

Only `make ...` lines are left out: they are the install and this very test suite. A benchmark
(`python -m spmd.bench...`) runs as its quick twin (`--quick --steps 3 --rounds 1` added: a small model, one
round): its figures are `make bench`'s, measured for minutes; here the command is checked to run as written. The
folder holds links to the project's `.venv` and `launch/`, so `. .venv/bin/activate` and `launch/...` work as
they do in a clone.
The cited tests of docs/reliability.md must exist, so that page cannot drift either.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIPPED = ("make ",)  # the set-up and the test suite itself


def sh_blocks(text: str) -> list[str]:
    """The sh blocks but the recipes of generated figures (test_docs runs those, and compares what they print)."""
    return re.findall(r"(?<!-->\n)^```sh\n(.*?)^```", text, re.S | re.M)


BENCHMARK, QUICK_TWIN = "python -m spmd.bench", " --quick --steps 3 --rounds 1"


def runnable(block: str) -> str:
    lines = block.replace("\\\n", " ").splitlines()  # a continued command as one line
    return "\n".join(
        line + (QUICK_TWIN if line.startswith(BENCHMARK) else "") for line in lines if not line.startswith(SKIPPED)
    )


BLOCKS = [runnable(b) for b in sh_blocks((ROOT / "README.md").read_text())]


def test_the_readme_has_recipes():
    assert len(BLOCKS) >= 6 and all(BLOCKS[1:])


@pytest.mark.slow  # about 5 minutes on 2 cores: make test-all (make test-docs alone)
@pytest.mark.timeout(660)  # the subprocess's own limit is 600 s
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_block_runs_as_pasted(tmp_path, index):
    block = BLOCKS[index]
    if not block.strip():
        return  # the set-up block: make run / make test, which is how this suite runs
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))  # the venv this suite runs in
    (tmp_path / "launch").symlink_to(ROOT / "launch")
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"README block failed:\n{block}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert "Traceback" not in done.stderr and "MISMATCH" not in done.stdout and "FAILED" not in done.stdout


def test_every_test_the_reliability_page_cites_exists():
    page = (ROOT / "docs" / "reliability.md").read_text()
    cited = re.findall(r"(test_\w+\.py)((?:(?:::|, ::)test_\w+)+)", page)
    assert len(cited) > 20
    for file, names in cited:
        source = ROOT / "tests" / file
        assert source.exists(), f"docs/reliability.md cites {file}, which does not exist"
        for name in re.findall(r"test_\w+", names):
            assert re.search(rf"^def {name}\(", source.read_text(), re.M), f"{file}::{name} does not exist"
