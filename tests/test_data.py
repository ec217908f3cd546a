"""Real text for the language model: preparing a corpus, the loader's samples on any mesh, evaluation, resuming
on another mesh, generation, and files or resumes that must be refused."""

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from spmd.data.loader import Batch, Corpus
from spmd.data.prepare import prepare, unigram_entropy
from spmd.data.tokenizer import END, ByteTokenizer
from spmd.data.tokens import HEADER, TokenFile, TokenFileError
from spmd.model import Net
from spmd.model.decode import Decoder
from spmd.model.llama_reference import loss_and_grads
from spmd.observe import plot
from spmd.parallel.context import core_named
from spmd.parallel.strategy import Composition
from spmd.transport.group import Group
from spmd.transport.mesh import Mesh

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x = 0\n    y = 0\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small corpus prepared from 40 generated documents."""
    root = tmp_path_factory.mktemp("text")
    for i in range(40):
        (root / f"doc{i:02d}.py").write_text(TEXT * (1 + i % 3) + f"# document {i}\n")
    out = tmp_path_factory.mktemp("corpus")
    prepare([str(root)], str(out), val_fraction=0.2)
    return out


def test_prepare_writes_the_documents_tokens_split_and_summary(corpus):
    meta = json.loads((corpus / "meta.json").read_text())
    train, val = TokenFile(corpus / "train.bin"), TokenFile(corpus / "val.bin")
    assert meta["train_documents"] + meta["val_documents"] == 40 and meta["val_documents"] > 0
    assert (train.documents, val.documents) == (meta["train_documents"], meta["val_documents"])
    assert (train.count, val.count) == (meta["train_tokens"], meta["val_tokens"])
    assert int((np.asarray(val.tokens) == END).sum()) == val.documents  # each document ends with the end token
    assert meta["unigram_entropy"] == pytest.approx(unigram_entropy(np.asarray(val.tokens), 257))
    assert 0 < meta["unigram_entropy"] < np.log(257)
    text = ByteTokenizer().decode(np.asarray(train.tokens[: len(TEXT)]))
    assert text == TEXT


def test_a_damaged_or_truncated_token_file_is_refused_naming_it(corpus, tmp_path):
    data = (corpus / "train.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:-3])
    with pytest.raises(TokenFileError, match=r"cut.bin: the header counts .* truncated or damaged"):
        TokenFile(tmp_path / "cut.bin")
    (tmp_path / "magic.bin").write_bytes(b"NOTTOKEN" + data[8:])
    with pytest.raises(TokenFileError, match="magic.bin: not an spmd token file"):
        TokenFile(tmp_path / "magic.bin")
    (tmp_path / "short.bin").write_bytes(data[: HEADER.size - 1])
    with pytest.raises(TokenFileError, match="short.bin: .* shorter than the 64-byte header"):
        TokenFile(tmp_path / "short.bin")
    body = bytearray(data)
    body[HEADER.size : HEADER.size + 2] = (300).to_bytes(2, "little")  # a token outside the vocabulary
    for name in ("meta.json", "tokenizer.json", "val.bin"):
        (tmp_path / name).write_bytes((corpus / name).read_bytes())
    (tmp_path / "train.bin").write_bytes(bytes(body))
    with pytest.raises(TokenFileError, match="train.bin: holds token 300, outside its vocabulary"):
        Corpus(tmp_path, seq=8, batch=2, seed=0)  # refused when the run opens it


def test_the_sample_order_is_a_permutation_of_the_windows_each_epoch(corpus):
    c = Corpus(corpus, seq=8, batch=4, seed=5)
    for epoch in (0, 1):
        order = [c.window(epoch, i) for i in range(c.windows)]
        assert sorted(order) == list(range(c.windows))
    assert [c.window(0, i) for i in range(10)] != [c.window(1, i) for i in range(10)]  # reshuffled each epoch
    assert [c.window(0, i) for i in range(10)] == [Corpus(corpus, 8, 4, 5).window(0, i) for i in range(10)]


def test_a_batch_reads_the_rows_asked_for(corpus):
    c = Corpus(corpus, seq=8, batch=4, seed=0)
    ids, targets = c.batch_data(3)
    whole_ids, whole_targets = np.asarray(ids), np.asarray(targets)
    starts = c.sample_starts(12, 4)
    tokens = np.asarray(c.train.tokens, dtype=np.int64)
    for k, start in enumerate(starts):
        np.testing.assert_array_equal(whole_ids[k * 8 : (k + 1) * 8], tokens[start : start + 8])
        np.testing.assert_array_equal(whole_targets[k * 8 : (k + 1) * 8], tokens[start + 1 : start + 9])
    np.testing.assert_array_equal(ids[5:21], whole_ids[5:21])  # rows across samples


def test_the_loaders_memory_does_not_grow_with_the_steps(corpus):
    c = Corpus(corpus, seq=8, batch=4, seed=0)

    def peak(steps: int) -> int:
        tracemalloc.start()
        for step in range(steps):
            ids, targets = c.batch_data(step)
            ids[0 : len(ids)], targets[0 : len(targets)]  # noqa: B018 - read every row
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    peak(2000)  # a first pass imports what numpy loads lazily (under xdist, numpy.random's modules: 0.9 MB)
    assert peak(2000) - peak(20) < 4096


class Recording(Corpus):
    """A corpus whose batches note which (step, global row) each read touched."""

    def __init__(self, *args, seen: list):
        super().__init__(*args)
        self.seen = seen

    def batch_data(self, step):
        ids, targets = super().batch_data(step)
        return Reader(ids, step, "ids", self.seen), Reader(targets, step, "targets", self.seen)


class Reader(Batch):
    def __init__(self, batch: Batch, step: int, what: str, seen: list):
        super().__init__(batch.tokens, batch.starts, batch.seq, batch.shift)
        self.step, self.what, self.seen = step, what, seen

    def __getitem__(self, rows: slice):
        self.seen.append((self.what, self.step, rows.start, rows.stop, int(self.starts[rows.start // self.seq])))
        return super().__getitem__(rows)


def read_rows(comm, rank, mesh, layout, net, folder):
    seen: list = []
    source = Recording(folder, net.seq, net.batch, net.seed, seen=seen)
    strategy, world = Composition(**layout), Group.world(comm, rank)
    engine = strategy.build(world, strategy.validate(net, world.size, Mesh.parse(mesh)), net)
    for step in range(net.steps):
        engine.step(*source.batch_data(step))
    return seen, {a: engine.layout.dims.coord(a, rank) for a in engine.layout.dims.mesh.names}


NET = dict(model="llama", layers=2, hidden=8, ffn=12, heads=2, vocab=257, seq=8, batch=6, steps=3)


@pytest.mark.parametrize(
    "mesh, layout",
    [("dp=2,fsdp=2", {}), ("pp=2,cp=2", {"cp": core_named("ring")}), ("fsdp=3", {}), ("dp=2,tp=2", {"sp": True})],
)
def test_each_rank_reads_only_its_rows_and_the_data_ranks_cover_every_batch_once(corpus, mesh, layout):
    """The first stage reads ids, the last targets; tp ranks the same rows, cp ranks their chunks, data ranks
    disjoint samples; for each step and kind the rows read by one tp rank of each (data, cp) coordinate are every
    row of the global batch, each by one rank (a rank reads its rows again for a micro-batch's backward)."""
    from spmd.transport.threads import run_threads

    net = Net(**NET, microbatches=2 if "pp" in mesh else 1)
    results = run_threads(
        Mesh.parse(mesh).size, lambda comm, rank: read_rows(comm, rank, mesh, layout, net, corpus), timeout=60
    )
    for what in ("ids", "targets"):
        for step in range(net.steps):
            counts = np.zeros(net.batch * net.seq, dtype=int)
            for seen, coords in results:
                if coords.get("tp", 0):
                    continue  # tp ranks read the same rows as tp rank 0
                mine = np.zeros_like(counts)
                for kind, s, lo, hi, _ in seen:
                    if kind == what and s == step:
                        mine[lo:hi] = 1
                counts += mine
            assert (counts == 1).all(), (what, step, counts)


def evaluate_on(comm, rank, mesh, layout, net, folder, want):
    strategy, world = Composition(**layout), Group.world(comm, rank)
    engine = strategy.build(world, strategy.validate(net, world.size, Mesh.parse(mesh)), net)
    batches = Corpus(folder, net.seq, net.batch, net.seed).eval_batches(96)
    got = float(np.mean([engine.evaluate(a, b) for a, b in batches]))
    assert abs(got - want) <= 1e-10 * abs(want), (got, want)


EVAL_MESHES = {
    1: [("dp=1", {}, {})],
    2: [("pp=2", {}, {}), ("tp=2", {"sp": True}, {})],
    3: [("fsdp=3", {}, {})],
    4: [("pp=2,tp=2", {"sp": True}, {}), ("fsdp=2,cp=2", {"cp": core_named("ulysses")}, {})],
    8: [("pp=2,fsdp=2,tp=2", {"sp": True, "pipeline": "interleaved-1f1b"}, {"chunks": 2, "layers": 4})],
}


def test_the_validation_loss_is_one_devices_on_any_mesh(world, corpus):
    """Forward only, every micro-batch through every stage: the same number as the single-device reference's
    loss on the same validation batches (float64, 1e-10), on threads and under mpiexec."""
    for mesh, layout, fields in EVAL_MESHES[world.size]:
        net = Net(**{**NET, "heads": 4, "kv_heads": 2, "microbatches": 2, **fields})
        units = [net.initial_layer(u) for u in range(net.layers + 3)]
        batches = Corpus(corpus, net.seq, net.batch, net.seed).eval_batches(96)
        want = float(np.mean([loss_and_grads(net, units, np.asarray(a), np.asarray(b))[0] for a, b in batches]))
        world.run(evaluate_on, mesh, layout, net, corpus, want)


@pytest.mark.parametrize("moe", [{}, {"experts": 4, "top_k": 2}], ids=["dense", "experts"])
def test_the_kv_cache_decoder_gives_the_reference_loss_and_its_own_logits_token_by_token(moe):
    """Read at once, the decoder's logits give the single-device reference's loss on the same tokens; read token
    by token through the cache, the same logits (a mixture of experts routing each token alike)."""
    net = Net(**{**NET, "heads": 4, "kv_heads": 2, "seq": 12, "batch": 1, **moe})
    rng = np.random.default_rng(1)
    units = [u + 0.3 * rng.standard_normal(u.size) for u in (net.initial_layer(i) for i in range(5))]
    ids = rng.integers(0, 257, 13)
    logits = Decoder(net, units).read(ids[:12])
    shifted = logits - logits.max(axis=1, keepdims=True)
    losses = np.log(np.exp(shifted).sum(axis=1)) - shifted[np.arange(12), ids[1:]]
    want = loss_and_grads(net, units, ids[:12], ids[1:])[0]
    assert float(losses.mean()) == pytest.approx(want, rel=1e-12)
    decoder = Decoder(net, units)
    stepped = [decoder.read(ids[:5])] + [decoder.read(ids[i : i + 1]) for i in range(5, 12)]
    np.testing.assert_allclose(np.concatenate(stepped), logits, rtol=1e-10, atol=1e-12)


def run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "spmd", *args], capture_output=True, text=True, timeout=300, **kw)


def test_the_journey_prepare_train_resume_on_another_mesh_generate(corpus, tmp_path):
    """Train 4 steps on pp=2,tp=2 saving at step 2; resume on fsdp=3 for steps 3-4: the losses are the
    uninterrupted run's (float64, 1e-10); then generate text from the checkpoint, the same for the same seed."""
    flags = [
        "train",
        "--model",
        "llama",
        "--data",
        str(corpus),
        "--layers",
        "2",
        "--hidden",
        "16",
        "--ffn",
        "32",
        "--heads",
        "2",
        "--seq",
        "16",
        "--batch",
        "6",
        "--optimizer",
        "adamw",
        "--steps",
        "4",
        "--quiet",
        "--json",
        "-",
    ]
    whole = run(*flags, "--mesh", "pp=2,tp=2", "--devices", "4", "--eval-every", "2", "--eval-tokens", "96")
    assert whole.returncode == 0, whole.stderr
    report = json.loads(whole.stdout.splitlines()[-1])
    assert [v["step"] for v in report["validation"]] == [2, 4]
    # bits a byte: the one evaluation batch's 96 targets, their bytes (the end token stands for none), ln 2
    targets = np.asarray(TokenFile(corpus / "val.bin").tokens[1:97])
    for v in report["validation"]:
        assert v["bits_per_byte"] == pytest.approx(v["loss"] * 96 / ((targets != END).sum() * np.log(2)), rel=1e-12)
    assert plot.bits_a_nat([report]) == pytest.approx(
        report["validation"][0]["bits_per_byte"] / report["validation"][0]["loss"]
    )
    plot.draw_loss([report], str(tmp_path / "loss.png"))  # the loss plot, with a bits-a-byte axis
    assert (tmp_path / "loss.png").stat().st_size > 0
    first = run(
        *[f if f != "4" else "2" for f in flags],
        "--mesh",
        "pp=2,tp=2",
        "--devices",
        "4",
        "--save",
        str(tmp_path / "ck"),
    )
    assert first.returncode == 0, first.stderr
    resumed = run(
        *flags,
        "--mesh",
        "fsdp=3",
        "--devices",
        "3",
        "--load",
        str(tmp_path / "ck"),
        "--check",
        "--save",
        str(tmp_path / "ck"),
    )
    assert resumed.returncode == 0, resumed.stderr
    tail = json.loads(resumed.stdout.splitlines()[-1])
    assert tail["ok"] and tail["first_step"] == 2
    np.testing.assert_allclose(tail["losses"], report["losses"][2:], rtol=1e-10)
    texts = [
        run("generate", "--load", str(tmp_path / "ck"), "--prompt", "def ", "--max-tokens", "40", "--seed", "3")
        for _ in range(2)
    ]
    assert texts[0].returncode == 0, texts[0].stderr
    assert texts[0].stdout == texts[1].stdout and texts[0].stdout.startswith("def ") and len(texts[0].stdout) > 10


def test_a_resume_on_other_data_or_another_seed_or_batch_is_refused_naming_it(corpus, tmp_path):
    flags = [
        "train",
        "--model",
        "llama",
        "--layers",
        "2",
        "--hidden",
        "8",
        "--ffn",
        "12",
        "--heads",
        "2",
        "--seq",
        "8",
        "--devices",
        "2",
        "--quiet",
    ]
    assert (
        run(*flags, "--data", str(corpus), "--batch", "4", "--steps", "1", "--save", str(tmp_path / "ck")).returncode
        == 0
    )
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text(TEXT * 20)
    (tmp_path / "text" / "b.txt").write_text(TEXT * 10)
    prepare([str(tmp_path / "text")], str(tmp_path / "other"), val_fraction=0.5)
    for more, words in (
        (["--data", str(corpus), "--batch", "4", "--seed", "1"], "--seed differs: the checkpoint's 0, this run's 1"),
        (["--data", str(corpus), "--batch", "6"], "--batch differs"),
        (["--data", str(tmp_path / "other"), "--batch", "4"], "the corpus differs"),
        (["--vocab", "257", "--batch", "4"], "this run reads synthetic tokens"),
        (["--data", str(corpus), "--batch", "4", "--lr", "0.1"], "--lr differs"),
    ):
        done = run(*flags, *more, "--steps", "3", "--load", str(tmp_path / "ck"))
        assert done.returncode == 2 and words in done.stderr, done.stderr


def test_data_needs_the_language_model_and_its_vocabulary(corpus):
    done = run("train", "--model", "transformer", "--data", str(corpus), "--devices", "2")
    assert done.returncode == 2 and "--data feeds the language model's tokens" in done.stderr
    done = run("train", "--model", "llama", "--data", str(corpus), "--vocab", "64", "--devices", "2")
    assert done.returncode == 2 and "tokenizer has 257 tokens" in done.stderr
    cut = Path(corpus).parent / "cut"
    cut.mkdir(exist_ok=True)
    for name in ("meta.json", "tokenizer.json", "val.bin"):
        (cut / name).write_bytes((corpus / name).read_bytes())
    (cut / "train.bin").write_bytes((corpus / "train.bin").read_bytes()[:-5])
    done = run("train", "--model", "llama", "--data", str(cut), "--devices", "2")
    assert done.returncode == 2 and "train.bin: the header counts" in done.stderr


def test_the_python_api_trains_on_a_corpus_evaluates_and_generates(corpus):
    """spmd.train(..., data=DIR): the losses are one device's on the corpus's batches, validation losses come
    every eval_every steps, and run.generate samples the same text for the same seed."""
    import spmd
    from spmd.model.llama_reference import reference_run

    run = spmd.train(
        model="llama",
        mesh="pp=2,tp=2",
        sp=True,
        data=str(corpus),
        layers=2,
        hidden=8,
        ffn=12,
        heads=2,
        seq=8,
        batch=4,
        microbatches=2,
        steps=4,
        eval_every=2,
        eval_tokens=64,
        optimizer="adamw",
    )
    ref = reference_run(run.net, Corpus(corpus, 8, 4, 0))
    np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-10)
    assert [step for step, _ in run.validation] == [2, 4] and all(np.isfinite(v) for _, v in run.validation)
    text = run.generate("def ", max_tokens=20, seed=4)
    assert text.startswith("def ") and text == run.generate("def ", max_tokens=20, seed=4)
