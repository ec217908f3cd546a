"""A byte-level BPE corpus (the bpe extra, the tokenizers library) and `data prepare` on the user's own files:
folders, globs, JSON lines; the BPE's round trip and byte counts, its determinism, the files and flags refused,
and a BPE corpus trained on and generated from end to end."""

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from spmd.data.prepare import in_validation, prepare
from spmd.data.sources import Documents, Progress
from spmd.data.tokenizer import BYTE_OF_CHAR, END_TEXT, NEEDS_LIBRARY, BPETokenizer, load_tokenizer
from spmd.data.tokens import TokenFile, write_tokens
from spmd.usage import UsageError

CODE = "def add(a, b):\n    return a + b\n\nclass Point:\n    x = 0\n    y = 0\n"
WORDS = ["naïve café", "Grüße aus Köln", "日本語のテキスト", "emoji 🙂 and ∑ math", "plain ascii words"]
TEXTS = [
    "",
    "def add(a, b): return a + b",
    "naïve café 日本語 🙂",
    "\t\n  spaces  \r\n",
    "unseen: Ωμέγα ǅ 𝄞",
    f"a literal {END_TEXT} in a document",
]


def run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "spmd", *args], capture_output=True, text=True, timeout=120, **kw)


def refused(capsys, *args) -> str:
    """`python -m spmd ARGS` run in this process (fast: no interpreter to start), which must exit 2 with one line
    on stderr: that line."""
    from spmd.harness.front import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        main(list(args))
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1, err
    return err


def write_folder(root: Path) -> Path:
    """30 Python files, a JSON-lines file of non-ASCII lines, a binary file, and a hidden folder."""
    (root / "sub").mkdir(parents=True)
    for i in range(30):
        (root / f"doc{i:02d}.py").write_text(CODE * (1 + i % 3) + f"# {WORDS[i % len(WORDS)]} {i}\n")
    lines = [json.dumps({"text": f"{w} {i}", "source": "x"}, ensure_ascii=i % 2 == 0) for i, w in enumerate(WORDS)]
    (root / "sub" / "lines.jsonl").write_text("\n".join(lines) + "\n\n")
    (root / "image.txt").write_bytes(b"\xff\xfe\x00\x01 not text")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "secret.txt").write_text("left out")
    (root / "notes.rst").write_text("not a suffix a folder gives")
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("text"))


@pytest.fixture(scope="module")
def corpus(folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    prepare([str(folder)], str(out), tokenizer="bpe", vocab=400, val_fraction=0.2)
    return out


@pytest.fixture(scope="module")
def bpe(corpus) -> BPETokenizer:
    coder = load_tokenizer(corpus)
    assert isinstance(coder, BPETokenizer)
    return coder


def test_the_byte_alphabet_is_the_libraries(bpe):
    """Our byte of each alphabet character is the library pre-tokenizer's: every byte UTF-8 text can hold (all
    but C0, C1, F5-FF) read back from its output."""
    from tokenizers import pre_tokenizers

    assert set(BYTE_OF_CHAR) == set(pre_tokenizers.ByteLevel.alphabet()) and len(BYTE_OF_CHAR) == 256
    three = [0x900] + [0x1000 * k + 0x100 for k in range(1, 16)]  # lead bytes E0 ... EF, no surrogate
    text = "".join(map(chr, range(0x800))) + "".join(map(chr, three))
    text += "".join(chr(c) for c in (0x10000, 0x40000, 0x80000, 0xC0000, 0x100000))
    assert len(set(text.encode())) == 256 - 2 - 11
    split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
    assert bytes(BYTE_OF_CHAR[c] for piece, _ in split for c in piece) == text.encode()


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trips_and_token_bytes_count_the_utf8_bytes(bpe, text):
    ids = bpe.encode(text)
    assert ids.dtype == np.uint16 and (ids < bpe.vocab).all() and bpe.end not in ids.tolist()
    assert bpe.decode(ids) == text == bpe.inner.decode(ids.tolist())
    assert int(bpe.token_bytes()[ids].sum()) == len(text.encode("utf-8"))


def test_the_tokenizer_has_the_end_token_and_merges(bpe, corpus):
    lengths = bpe.token_bytes()
    assert bpe.vocab == lengths.size and lengths[bpe.end] == 0 and (np.delete(lengths, bpe.end) >= 1).all()
    assert lengths.max() > 3  # merges learned: tokens of several bytes
    assert len(bpe.encode(CODE)) < len(CODE.encode()) / 2
    assert bpe.decode([bpe.end]) == "\n\n"  # as the byte tokenizer shows a document's end
    spec = json.loads((corpus / "tokenizer.json").read_text())
    assert spec["model"]["type"] == "BPE" and spec["added_tokens"][0]["content"] == END_TEXT


def test_the_corpus_holds_each_documents_tokens_and_end_split_by_name(corpus, folder, bpe):
    meta = json.loads((corpus / "meta.json").read_text())
    names = [f"doc{i:02d}.py" for i in range(30)] + [f"sub/lines.jsonl:{n}" for n in range(1, 6)]
    val = sum(in_validation(name, 0.2) for name in names)
    assert (meta["val_documents"], meta["train_documents"]) == (val, len(names) - val)
    assert meta["skipped_documents"] == 1 and meta["tokenizer"] == "bpe" and meta["vocab"] == bpe.vocab <= 400
    tokens = np.concatenate([TokenFile(corpus / f"{s}.bin").tokens for s in ("train", "val")])
    assert int((tokens == bpe.end).sum()) == len(names) and tokens[-1] == bpe.end
    texts = [bpe.decode(doc[:-1]) for doc in np.split(tokens, np.flatnonzero(tokens == bpe.end)[:-1] + 1)]
    assert sorted(t for t in texts if not t.startswith("def")) == sorted(f"{w} {i}" for i, w in enumerate(WORDS))


def test_training_is_deterministic(folder, corpus, tmp_path):
    """Another process trains the same tokenizer.json, byte for byte, and the same fingerprint."""
    done = run(
        "data",
        "prepare",
        str(folder),
        "--out",
        str(tmp_path / "again"),
        "--tokenizer",
        "bpe",
        "--vocab",
        "400",
        "--val-fraction",
        "0.2",
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (corpus / "tokenizer.json").read_bytes()
    again, first = (json.loads((f / "meta.json").read_text()) for f in (tmp_path / "again", corpus))
    assert again["fingerprint"] == first["fingerprint"]


@pytest.mark.parametrize("vocab, width", [(257, 2), (1 << 16, 2), ((1 << 16) + 1, 4), (1 << 20, 4)])
def test_ids_are_uint16_up_to_65536_tokens_and_uint32_above(tmp_path, vocab, width):
    ids = np.array([0, 1, vocab - 1, vocab // 2], dtype=np.uint32)
    write_tokens(tmp_path / "t.bin", ids, vocab, 1)
    read = TokenFile(tmp_path / "t.bin")
    assert read.tokens.dtype.itemsize == width and (tmp_path / "t.bin").stat().st_size == 64 + 4 * width
    np.testing.assert_array_equal(read.tokens, ids)
    read.check_ids()


class WideTokenizer:
    """A stand-in of 70,000 tokens (a BPE that large needs far more text than a test has): each character an id
    above 65,535, the end id the last."""

    kind, vocab, end = "bpe", 70_000, 69_999

    def encode(self, text: str) -> np.ndarray:
        return np.array([65_536 + ord(c) % 4000 for c in text], dtype=np.uint32)

    def save(self, folder: Path) -> None:
        (folder / "tokenizer.json").write_text("{}")


def test_prepare_writes_uint32_ids_for_a_vocabulary_above_65536(folder, tmp_path, monkeypatch):
    monkeypatch.setattr("spmd.data.prepare.make_tokenizer", lambda *args: WideTokenizer())
    meta = prepare([str(folder)], str(tmp_path / "wide"), tokenizer="bpe", vocab=70_000, val_fraction=0.2)
    train = TokenFile(tmp_path / "wide" / "train.bin")
    assert train.tokens.dtype == np.uint32 and train.vocab == meta["vocab"] == 70_000
    ids = np.asarray(train.tokens)
    assert ids.min() >= 65_536 and int((ids == 69_999).sum()) == train.documents  # the end id kept whole
    train.check_ids()


def damaged_copy(corpus: Path, into: Path, tokenizer_text: str) -> Path:
    into.mkdir()
    for name in ("meta.json", "train.bin", "val.bin"):
        (into / name).write_bytes((corpus / name).read_bytes())
    (into / "tokenizer.json").write_text(tokenizer_text)
    return into


def test_a_damaged_tokenizer_file_is_refused_in_one_line_naming_it(corpus, tmp_path, capsys):
    text = (corpus / "tokenizer.json").read_text()
    spec = json.loads(text)
    spec["model"]["vocab"][max(spec["model"]["vocab"], key=spec["model"]["vocab"].get)] += 5  # a gap in the ids
    for kind, bad in (("cut", text[:-40]), ("gap", json.dumps(spec)), ("model", text.replace('"BPE"', '"XY"'))):
        folder = damaged_copy(corpus, tmp_path / kind, bad)
        with pytest.raises(ValueError, match=rf"{folder / 'tokenizer.json'}: "):
            load_tokenizer(folder)
    with pytest.raises(ValueError, match=r"gap/tokenizer.json: its \d+ ids are not 0 ... \d+: damaged"):
        load_tokenizer(tmp_path / "gap")
    assert "cut/tokenizer.json: cannot be read" in refused(
        capsys, "train", "--model", "llama", "--data", str(tmp_path / "cut"), "--devices", "2"
    )


def test_json_lines_without_a_text_string_or_not_json_are_refused_naming_file_and_line(tmp_path, capsys):
    for lines, words in (
        ([{"text": "ok"}, {"body": "no text"}], "lines.jsonl:2: a JSON line must be an object"),
        ([{"text": "ok"}, {"text": 3}], "lines.jsonl:2: a JSON line must be"),
        ([{"text": "ok"}, "{not json"], "lines.jsonl:2: not a JSON line"),
    ):
        (tmp_path / "lines.jsonl").write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines))
        with pytest.raises(UsageError, match=words):
            list(Documents([str(tmp_path / "lines.jsonl")]).read("reading"))
    with pytest.raises(UsageError, match="lines.jsonl:2: not a JSON line"):  # raised inside the BPE's training too
        prepare([str(tmp_path / "lines.jsonl")], str(tmp_path / "out"), tokenizer="bpe", vocab=300)
    assert "lines.jsonl:2: not a JSON line" in refused(
        capsys, "data", "prepare", str(tmp_path / "lines.jsonl"), "--out", str(tmp_path / "out")
    )


def test_folders_globs_and_files_give_their_documents(folder, tmp_path, monkeypatch):
    """A folder its .txt .md .py .jsonl files (not hidden ones), a glob what it matches (named within its fixed
    part, as the folder names them), a file named explicitly whatever its suffix; a file given twice once."""
    names = [name for name, _ in Documents([str(folder)]).files]
    assert "doc07.py" in names and "sub/lines.jsonl" in names and "image.txt" in names
    assert not any("secret" in n or n.endswith(".rst") for n in names)
    assert [n for n, _ in Documents([f"{folder}/**/*.jsonl"]).files] == ["sub/lines.jsonl"]
    monkeypatch.chdir(folder)
    assert [n for n, _ in Documents(["doc0*.py", "doc01.py"]).files] == [f"doc0{i}.py" for i in range(10)]
    assert [n for n, _ in Documents(["notes.rst"]).files] == ["notes.rst"]
    (tmp_path / "rst").mkdir()
    (tmp_path / "rst" / "a.rst").write_text("a suffix a folder does not give")
    with pytest.raises(UsageError, match=r"0 text documents .* \(a folder gives its .txt, .md, .py and .jsonl"):
        prepare([str(tmp_path / "rst")], str(tmp_path / "out"))
    docs = Documents(["sub/lines.jsonl", "image.txt"])
    assert [n for n, _ in docs.read("reading")] == [f"lines.jsonl:{i}" for i in range(1, 6)] and docs.skipped == 1


def test_a_glob_that_matches_nothing_or_a_missing_path_is_refused_naming_it(tmp_path, capsys):
    for given, words in (
        (f"{tmp_path}/**/*.md", "**/*.md: the pattern matches no file"),
        (str(tmp_path / "absent.txt"), "absent.txt: no such file or folder"),
    ):
        assert words in refused(capsys, "data", "prepare", given, "--out", str(tmp_path / "out"))


def test_the_vocab_flag_needs_the_bpe_and_at_least_257_tokens(folder, tmp_path, capsys):
    out = ["--out", str(tmp_path / "out")]
    for flags, words in (
        (["--vocab", "400"], "--vocab 400 sizes a BPE: give it with --tokenizer bpe"),
        (["--tokenizer", "bpe", "--vocab", "256"], "--vocab 256: a BPE has 257 tokens at least"),
        (["--tokenizer", "bpe"], "--tokenizer bpe needs --vocab N"),
    ):
        assert words in refused(capsys, "data", "prepare", str(folder), *out, *flags)
    assert not (tmp_path / "out").exists()


def test_without_the_library_one_line_says_to_install_it(folder, corpus, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers now raises ImportError
    with pytest.raises(UsageError) as caught:
        prepare([str(folder)], str(tmp_path / "out"), tokenizer="bpe", vocab=300)
    assert str(caught.value) == NEEDS_LIBRARY == "--tokenizer bpe needs the tokenizers library: pip install 'spmd[bpe]'"
    with pytest.raises(UsageError, match=r"tokenizer.json: a BPE tokenizer; reading it needs the tokenizers library"):
        load_tokenizer(corpus)
    prepare([str(folder)], str(tmp_path / "bytes"), val_fraction=0.2)  # the byte tokenizer needs nothing


def test_importing_spmd_does_not_import_tokenizers():
    code = (
        "import sys, spmd, spmd.data.prepare, spmd.data.loader, spmd.harness.generate, spmd.harness.compose_cli; "
        "assert 'tokenizers' not in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_shows_on_large_inputs_only(folder):
    quiet = io.StringIO()
    list(Documents([str(folder)]).read("reading", quiet))
    assert quiet.getvalue() == ""
    log, terminal = io.StringIO(), Terminal()
    list(Documents([str(folder)]).read("reading", log, large=0))  # every input counts as large
    assert log.getvalue().splitlines()[-1].startswith("reading: 100% of 0 MB") and "\r" not in log.getvalue()
    assert len(log.getvalue().splitlines()) <= 10
    list(Documents([str(folder / "sub" / "lines.jsonl")]).read("reading", terminal, large=0))
    assert terminal.getvalue().count("\r") >= 5 and "[" + "#" * 30 + "] 100%" in terminal.getvalue()
    bar = Progress("x", 200, io.StringIO(), large=100)
    bar.advance(50)
    assert bar.stream.getvalue() == "x: 25% of 0 MB\n"  # one line: a tenth passed


def test_a_bpe_corpus_trains_on_threads_and_generates(corpus, bpe, tmp_path, capsys):
    """The run's vocabulary is the corpus's (another --vocab refused); generate decodes with its BPE, the same
    text for the same seed, and a damaged tokenizer is refused in one line."""
    data = damaged_copy(corpus, tmp_path / "corpus", (corpus / "tokenizer.json").read_text())
    flags = [
        "train",
        "--model",
        "llama",
        "--data",
        str(data),
        "--layers",
        "1",
        "--hidden",
        "16",
        "--ffn",
        "32",
        "--heads",
        "2",
        "--seq",
        "16",
        "--batch",
        "2",
        "--steps",
        "2",
        "--devices",
        "2",
        "--backend",
        "threads",
        "--eval-every",
        "2",
        "--eval-tokens",
        "32",
    ]
    done = run(*flags, "--save", str(tmp_path / "ck"), "--json", str(tmp_path / "run.json"))
    assert done.returncode == 0, done.stderr
    assert f"vocabulary {bpe.vocab}" in done.stdout
    report = json.loads((tmp_path / "run.json").read_text())
    assert report["validation"][0]["step"] == 2 and np.isfinite(report["losses"]).all()
    assert f"tokenizer has {bpe.vocab} tokens" in refused(capsys, *flags, "--vocab", "257")
    text = run("generate", "--load", str(tmp_path / "ck"), "--prompt", "def ", "--max-tokens", "12", "--seed", "1")
    assert text.returncode == 0 and text.stdout.startswith("def ") and len(text.stdout) > 6, text.stderr
    from spmd.harness.generate import main as generate

    capsys.readouterr()
    assert generate(["--load", str(tmp_path / "ck"), "--prompt", "def ", "--max-tokens", "12", "--seed", "1"]) == 0
    assert capsys.readouterr().out == text.stdout  # the same seed, the same text
    (data / "tokenizer.json").write_text((corpus / "tokenizer.json").read_text().replace('"BPE"', '"XY"'))
    assert "tokenizer.json: neither" in refused(capsys, "generate", "--load", str(tmp_path / "ck"))
