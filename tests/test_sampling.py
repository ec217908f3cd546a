"""python -m spmd generate's sampling controls and run.generate's: temperature, top-k and top-p in float64 on
hand-made logits; the seeds of several samples from one prompt; stop texts; the text streamed as it is final
(a multi-byte character once whole), equal to the text a whole call returns; the mistakes refused before any
text, one line naming the flag, exit 2."""

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from spmd.data.prepare import prepare
from spmd.data.tokenizer import ByteTokenizer, load_tokenizer
from spmd.harness import sampling
from spmd.harness.front import main as spmd_main
from spmd.harness.generate import load_units
from spmd.harness.generate import main as generate_main
from spmd.harness.sampling import Controls, NewText, TextSampler, stop_texts
from spmd.model.decode import generate, nucleus, probabilities, sample, sample_rng, tokens
from spmd.trainers import checkpoint

RNG = np.random.default_rng(2024)
LOGITS = [RNG.normal(scale=3.0, size=257) for _ in range(20)]  # no ties: one argmax each


@pytest.mark.parametrize("logits", LOGITS[:5])
def test_top_p_tiny_top_k_one_and_temperature_zero_all_take_the_most_likely(logits):
    best = int(np.argmax(logits))
    for seed in range(20):
        assert sample(logits.copy(), 0.8, 0, 1e-9, sample_rng(seed)) == best
        assert sample(logits.copy(), 1.5, 1, 1.0, sample_rng(seed)) == best
        assert sample(logits.copy(), 0.0, 40, 0.5, sample_rng(seed)) == best


def test_top_p_keeps_exactly_the_nucleus_and_renormalizes_it():
    """p = .40 .25 .15 .10 .06 .04 (shuffled): top_p .75 keeps the first three (.80 >= .75 > .65), .30 one,
    .90 four; the ids drawn over many seeds are that set, every one of it."""
    p = np.array([0.04, 0.25, 0.10, 0.40, 0.06, 0.15])
    logits = np.log(p) + 7.0  # a shift changes nothing
    for top_p, want in ((0.75, {3, 1, 5}), (0.30, {3}), (0.90, {3, 1, 5, 2}), (1.0, set(range(6)))):
        q = probabilities(logits, 1.0, 0, top_p)
        assert set(np.flatnonzero(q)) == want
        np.testing.assert_allclose(q[list(want)], p[list(want)] / p[list(want)].sum(), rtol=1e-12)
        drawn = {sample(logits, 1.0, 0, top_p, sample_rng(seed)) for seed in range(400)}
        assert drawn == want


def test_the_nucleus_comes_after_temperature_and_top_k_and_breaks_ties_by_id():
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    assert set(np.flatnonzero(probabilities(logits, 1.0, 0, 0.75))) == {0, 1}
    assert set(np.flatnonzero(probabilities(logits, 100.0, 0, 0.75))) == {0, 1, 2}  # nearly flat: all three
    assert set(np.flatnonzero(probabilities(logits, 100.0, 2, 0.75))) == {0, 1}  # top-k first, then p
    assert set(np.flatnonzero(nucleus(np.array([0.25, 0.5, 0.25]), 0.75))) == {0, 1}  # a sum of exactly P stops
    assert set(np.flatnonzero(nucleus(np.array([0.2, 0.2, 0.2, 0.2, 0.2]), 0.5))) == {0, 1, 2}


def test_temperature_and_top_k_are_todays_draws():
    """Without top-p, the same draws as before it existed: softmax(logits / T) over the top k, numpy's choice."""
    for logits in LOGITS:
        for seed in range(5):
            scaled = logits / 0.7
            scaled[scaled < np.sort(scaled)[-40]] = -np.inf
            p = np.exp(scaled - scaled.max())
            want = int(np.random.default_rng(seed).choice(257, p=p / p.sum()))
            assert sample(logits.copy(), 0.7, 40, 1.0, sample_rng(seed)) == want


def test_sample_zero_is_the_seeds_own_stream_and_other_samples_are_their_own():
    firsts = {seed: np.random.default_rng(seed).random(4).tolist() for seed in range(5)}
    streams = [tuple(sample_rng(seed, i).random(4)) for seed in range(5) for i in range(5)]
    assert len(set(streams)) == 25
    assert all(list(sample_rng(seed).random(4)) == firsts[seed] for seed in range(5))
    assert tuple(sample_rng(3, 2).random(4)) == tuple(sample_rng(3, 2).random(4))


# Text: the prompt and the new text, streamed as it is final, from a tiny checkpoint of a corpus with multi-byte
# characters (an untrained-looking model at a high temperature samples whole ones, split ones and bad bytes).

SEQ = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("text")
    for i in range(12):
        (root / f"doc{i:02d}.txt").write_text(f"def f{i}(a):  # café € π 😀 {i}\n    return a\n" * (1 + i % 3))
    out = tmp_path_factory.mktemp("corpus")
    prepare([str(root)], str(out), val_fraction=0.2)
    return out


@pytest.fixture(scope="module")
def checkpoint_dir(corpus, tmp_path_factory) -> Path:
    """One step of a 1-layer LM on one device, saved as `python -m spmd train --save` saves it."""
    folder = tmp_path_factory.mktemp("ck")
    flags = [
        "train",
        "--model",
        "llama",
        "--data",
        str(corpus),
        "--layers",
        "1",
        "--hidden",
        "8",
        "--ffn",
        "12",
        "--heads",
        "2",
        "--seq",
        str(SEQ),
        "--batch",
        "2",
        "--steps",
        "1",
        "--devices",
        "1",
        "--quiet",
        "--save",
        str(folder),
    ]
    assert spmd_main(flags) == 0
    return folder


@pytest.fixture(scope="module")
def model(checkpoint_dir, corpus):
    net, units, biases, _ = load_units(checkpoint.latest(str(checkpoint_dir)))
    return net, units, biases, load_tokenizer(corpus)


def sampler(model, prompt="def ", **controls) -> TextSampler:
    net, units, biases, tokenizer = model
    controls = {"max_tokens": 60, "temperature": 1.5, "top_k": 0, **controls}
    controls["stop"] = stop_texts(controls.get("stop"))
    return TextSampler(net, units, biases, tokenizer, prompt, Controls(**controls))


def generate_cli(*flags, capsys) -> tuple[int, str, str]:
    """python -m spmd generate, in this process: (exit status, stdout, stderr)."""
    try:
        code = generate_main(list(flags))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def whole(text: str) -> bool:
    """`text` has a character of more than one UTF-8 byte that is not a replaced bad byte."""
    return any(ord(c) > 127 and c != "\ufffd" for c in text)


def test_the_streamed_pieces_are_the_returned_text_and_the_plain_decode(model):
    """Over seeds at a high temperature: the pieces joined are text(), the prompt + decode(the tokens drawn);
    no piece ends in a split character, and some sample streams a multi-byte one."""
    net, units, biases, tokenizer = model
    streamed_a_whole_one = False
    for seed in range(8):
        s = sampler(model, seed=seed)
        pieces = list(s.pieces())
        ids = generate(net, units, s.start, 60, 1.5, 0, seed, biases)
        assert "".join(pieces) == s.text() == "def " + tokenizer.decode(ids)
        assert not any(piece.endswith("\ufffd") for piece in pieces[:-1])
        streamed_a_whole_one |= whole("".join(pieces[1:]))
    assert streamed_a_whole_one


def test_a_character_split_over_tokens_is_released_once_whole():
    """Byte by byte: 'a', '€' (3 bytes), 'b', an emoji (4), a bad byte then 'é' (2), and a split one at the end."""
    stream = NewText(ByteTokenizer(), ())
    data = "a€b😀".encode() + b"\xff" + "é".encode() + "€".encode()[:2]
    pieces = [stream.add(byte) for byte in data] + [stream.finish()]
    assert [p for p in pieces if p] == ["a", "€", "b", "😀", "\ufffdé", "\ufffd"]
    assert "".join(pieces) == ByteTokenizer().decode(list(data))


def test_a_stop_text_is_held_back_until_it_is_not_one_and_cut_when_it_is():
    stream = NewText(ByteTokenizer(), ("b😀", "zz"))
    pieces = [stream.add(byte) for byte in "a€bcb😀zz".encode()]
    assert [p for p in pieces if p] == ["a", "€", "bc"] and stream.stopped  # 'b' waited: it began 'b😀'


def test_a_stop_ends_the_sample_early_and_is_not_in_the_text(model):
    """A stop text taken from the middle of a sample's new text: the sample is the text before its first
    occurrence, fewer tokens are drawn, and of several stop texts the first found ends it."""
    full = sampler(model, seed=3).text()[len("def ") :]
    at = next(i for i in range(10, len(full) - 1) if full[i : i + 2].isascii() and full[i : i + 2].isprintable())
    stop = full[at : at + 2]
    counting = Counting(ByteTokenizer())
    s = sampler(model, seed=3, stop=[stop, "never-sampled"])
    s.tokenizer = counting
    assert s.text() == "def " + full[: full.index(stop)]
    assert counting.most < 60  # ended early: fewer tokens drawn than --max-tokens
    later = full[at + 3 : at + 5]  # listed first, found no earlier than `stop`
    first = min(i for i in (full.find(later), full.find(stop)) if i >= 0)
    assert sampler(model, seed=3, stop=[later, stop]).text() == "def " + full[:first]


class Counting:
    """A tokenizer that counts the most ids it decoded at once."""

    def __init__(self, tokenizer):
        self.tokenizer, self.end, self.most = tokenizer, tokenizer.end, 0

    def encode(self, text):
        return self.tokenizer.encode(text)

    def decode(self, ids):
        self.most = max(self.most, len(ids))
        return self.tokenizer.decode(ids)


def test_the_same_seed_gives_the_same_text_and_each_seed_and_sample_its_own(model):
    texts = [sampler(model, seed=seed).text(i) for seed in range(3) for i in range(3)]
    assert len(set(texts)) == 9 and sampler(model, seed=2).text(1) == texts[2 * 3 + 1]


def test_the_cli_prints_each_piece_as_it_comes_flushed_and_the_whole_is_the_apis_text(
    model, checkpoint_dir, monkeypatch
):
    writes = []

    class Recording(io.StringIO):
        def flush(self):
            writes.append(self.getvalue())

    def drawn(*args):  # the pieces printed when each token is drawn
        for token in tokens(*args):
            printed.append(len(writes))
            yield token

    out, printed = Recording(), []
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sampling, "tokens", drawn)
    assert (
        generate_main(
            [
                "--load",
                str(checkpoint_dir),
                "--prompt",
                "def ",
                "--max-tokens",
                "60",
                "--temperature",
                "1.5",
                "--top-k",
                "0",
                "--seed",
                "5",
            ]
        )
        == 0
    )
    monkeypatch.undo()
    pieces = [*sampler(model, seed=5).pieces(), "\n"]
    assert out.getvalue() == sampler(model, seed=5).text() + "\n" == "".join(pieces)
    assert writes == ["".join(pieces[:n]) for n in range(1, len(pieces) + 1)]  # flushed after every piece
    assert len(printed) == 60 and printed[0] == 1 and printed[-1] >= len(pieces) - 3  # all but the last token's


def test_num_samples_prints_each_after_a_line_and_sample_one_is_the_single_sample(model, checkpoint_dir, capsys):
    flags = ["--load", str(checkpoint_dir), "--prompt", "def ", "--max-tokens", "20", "--seed", "4", "--top-p", "0.9"]
    code, out, _ = generate_cli(*flags, "--num-samples", "3", capsys=capsys)
    s = sampler(model, seed=4, max_tokens=20, temperature=0.8, top_k=40, top_p=0.9)
    assert code == 0 and out == "".join(f"--- sample {i + 1} of 3 ---\n{s.text(i)}\n" for i in range(3))
    code, single, _ = generate_cli(*flags, capsys=capsys)
    assert code == 0 and single == s.text(0) + "\n"


def test_a_prompt_file_is_read_as_utf8_as_it_is(model, checkpoint_dir, tmp_path, capsys):
    (tmp_path / "prompt.txt").write_bytes("# café\r\n".encode())
    code, out, _ = generate_cli(
        "--load",
        str(checkpoint_dir),
        "--prompt-file",
        str(tmp_path / "prompt.txt"),
        "--max-tokens",
        "10",
        capsys=capsys,
    )
    assert code == 0 and out == sampler(model, "# café\r\n", max_tokens=10, temperature=0.8, top_k=40).text() + "\n"


MISTAKES = [  # (flags, what the one line says)
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt-file", "EMPTY"], "--prompt-file EMPTY is empty"),
    (["--prompt-file", "LATIN1"], "--prompt-file LATIN1: not UTF-8 (byte 0xe9 at offset 3)"),
    (["--prompt", "x", "--prompt-file", "EMPTY"], "argument --prompt-file: not allowed with argument --prompt"),
    (["--prompt", "x" * (SEQ + 1)], f"--prompt is {SEQ + 1} tokens, more than the model's {SEQ} positions"),
    (["--prompt", "ab\udcffc"], "--prompt: character 3 of 4, '\\udcff', the byte 0xff that is not UTF-8"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    (["--temperature", "-0.5"], "--temperature must be a number >= 0"),
    (["--top-k", "-1"], "--top-k must be >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.01"], "--top-p must be in (0, 1]"),
    (["--num-samples", "0"], "--num-samples must be >= 1, got 0"),
    (["--stop", ""], "--stop: an empty stop text"),
]


@pytest.mark.parametrize("flags, words", MISTAKES, ids=[" ".join(f)[:30] for f, _ in MISTAKES])
def test_a_mistake_is_one_line_naming_the_flag_exit_2_before_any_text(
    checkpoint_dir, tmp_path, monkeypatch, capsys, flags, words
):
    (tmp_path / "EMPTY").write_text("")
    (tmp_path / "LATIN1").write_bytes("caf\xe9".encode("latin-1"))
    monkeypatch.chdir(tmp_path)
    code, out, err = generate_cli("--load", str(checkpoint_dir), *flags, capsys=capsys)
    assert code == 2 and out == "" and words in err and err.count("\n") == 1, err


def test_a_command_line_byte_that_is_not_utf8_is_refused_naming_its_position(checkpoint_dir):
    done = subprocess.run(
        [sys.executable, "-m", "spmd", "generate", "--load", str(checkpoint_dir), "--prompt", b"def \xff"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.endswith(
        "error: --prompt: character 5 of 5, '\\udcff', the byte 0xff that is not UTF-8, "
        "cannot be encoded (give UTF-8 text)\n"
    ), done.stderr


def test_run_generate_takes_the_same_controls_and_path(corpus):
    """spmd.train(..., data=)'s run.generate: the sampler's text, the same for the same seed; stop, top_p and
    sample as the CLI's; a mistake raises naming the argument."""
    import spmd

    run = spmd.train(model="llama", data=str(corpus), layers=1, hidden=8, ffn=12, heads=2, seq=SEQ, batch=2, steps=1)
    model = (run.net, run.units, run.biases, load_tokenizer(corpus))
    text = run.generate("def ", max_tokens=30, temperature=1.5, top_k=0, seed=2, sample=1)
    assert text == sampler(model, max_tokens=30, seed=2).text(1) == run.generate("def ", 30, 1.5, 0, 2, sample=1)
    new = text[len("def ") :]
    stop = new[8:10]
    assert run.generate("def ", 30, 1.5, 0, 2, stop=stop, sample=1) == "def " + new[: new.index(stop)]
    assert (
        run.generate(max_tokens=5, top_p=0.5)
        == sampler(model, None, max_tokens=5, temperature=0.8, top_k=40, top_p=0.5).text()
    )
    for kwargs, words in (
        ({"top_p": 0.0}, "top_p must be"),
        ({"max_tokens": 0}, "max_tokens must be"),
        ({"prompt": ""}, "prompt is empty"),
        ({"stop": ""}, "stop: an empty"),
    ):
        with pytest.raises(ValueError, match=words):
            run.generate(**kwargs)
