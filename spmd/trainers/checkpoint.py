"""Distributed checkpoints: each rank writes what it owns, any mesh reads back what it needs.

A checkpoint is a folder DIR/step-00000004 holding one .npy file per (writer, layer, kind) and manifest.json:
the step, the model's shape, the optimizer and precision, and for every file its layer, kind ("params": the
fp32 master under mixed precision, else the parameters; then the optimizer's state, e.g. "m", "v"), the
global ranges of the layer's flat vector its values fill (in order), its dtype, count and sha256.
- Writing: one replica per shard (the ranks at dp and cp coordinate 0; a parameter every tp rank holds,
  a norm's gain, is written by tp rank 0), into step-N.partial; rank 0 writes the manifest from every rank's
  part, then renames the folder: a run killed while saving leaves a .partial folder, never read.
- Reading, onto any mesh, strategy or world size: every rank maps its layers' indices to the files that hold
  them and reads those elements through a memory map (np.load(mmap_mode="r"), allow_pickle=False); each
  file it opens is checked against its sha256 first. Refused with one line naming the problem: another
  model's checkpoint, another optimizer's, a missing or corrupted file, ranges that do not cover a layer.
- The data position is the step: batch_data(step) is a function of (seed, step), so a resumed run reads the
  batches it would have read.
- A mixture of experts' balancing bias (--bias-balance, one per layer and expert, the same on every rank that
  holds the layer) is kind "bias" of its layer, E values, written by the layer's first holder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np

from spmd.collectives import barrier
from spmd.model.blocks import EXPERT_KIND
from spmd.model.config import Net
from spmd.model.optimizers import STATE
from spmd.model.registry import full_sizes, shape_of
from spmd.parallel.engine import ComposedRank

FORMAT = "spmd-checkpoint-1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this run; the message names the folder or file and why."""


def parts_of(engine: ComposedRank) -> list:
    """(layer, kind, global indices, values) of what this rank writes: the optimizer's part of each layer
    ("params": the fp32 master under mixed precision) and its state, if it is the replica that writes
    (dp and cp coordinate 0); a value every tp rank holds (a gain) only from tp rank 0."""
    dims, rank = engine.layout.dims, engine.rank
    if dims.coord("dp", rank) or dims.coord("cp", rank):
        return []
    parts = []
    moments = engine.state.optimizer
    for i, (layer, index, values) in enumerate(engine.owned()):
        keep = engine.layout.first_holder(engine.net, rank, layer, index)
        parts.append((layer, "params", index[keep], values[keep]))
        parts += [(layer, kind, index[keep], arrays[i][keep]) for kind, arrays in moments.items()]
    experts = engine.experts
    if experts is not None and experts.gamma and not any(dims.coord(a, rank) for a in ("fsdp", "ep", "tp")):
        for layer in (u for u, kind in zip(engine.layers, engine.kinds, strict=True) if kind == EXPERT_KIND):
            bias = experts.bias.setdefault(layer, np.zeros(experts.e))
            parts.append((layer, "bias", np.arange(experts.e), bias))
    return parts


def restore(engine: ComposedRank, reader: Reader, step: int) -> None:
    """Set this rank's parameters, master weights and optimizer state from a checkpoint at `step`."""
    state, experts = engine.state, engine.experts
    for i, layer in enumerate(engine.layers):
        held, part = engine.indices(i)
        values = np.empty(len(held), dtype=engine.policy.state)
        reader.read(layer, "params", held, values)
        state.params[i][...] = values  # cast to the compute dtype
        if state.master is not None:
            reader.read(layer, "params", part, state.master[i])
        for kind, arrays in state.optimizer.items():
            reader.read(layer, kind, part, arrays[i])
        if experts is not None and experts.gamma and engine.kinds[i] == EXPERT_KIND and reader.has(layer, "bias"):
            bias = experts.bias.setdefault(layer, np.zeros(experts.e))
            reader.read(layer, "bias", np.arange(bias.size), bias)
    state.steps_done = step


def step_folder(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def runs(indices: np.ndarray) -> list[list[int]]:
    """`indices` as runs [start, stop) of consecutive integers, in their order."""
    if indices.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(indices) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [indices.size]])
    return [[int(indices[a]), int(indices[b - 1]) + 1] for a, b in zip(starts, stops, strict=True)]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save(
    engine: ComposedRank,
    root: str | Path,
    step: int,
    data: dict | None = None,
    config: dict | None = None,
    keep: int = 0,
) -> Path:
    """Every rank of the engine's world: write this rank's part of step `step`'s state; returns the folder.
    `data`: the corpus's description (spmd.data.loader.Corpus.describe, the seed, batch and seq), recorded
    with the data position, the samples consumed (step x batch); `config`: the command's resolved flags, recorded;
    `keep`: the newest checkpoints left under `root` once this one is complete (0: all)."""
    world, final = engine.world, step_folder(root, step)
    partial = final.with_name(final.name + ".partial")
    if world.rank == 0:
        partial.mkdir(parents=True, exist_ok=True)
    barrier(world)
    entries = write_parts(engine, partial)
    (partial / f"rank{world.rank}.json").write_text(json.dumps(entries))
    barrier(world)
    if world.rank == 0:
        files = []
        for r in range(world.size):
            part = partial / f"rank{r}.json"
            files += json.loads(part.read_text())
            part.unlink()
        net: Net = engine.net
        manifest = {
            "format": FORMAT,
            "step": step,
            "shape": shape_of(net),
            "optimizer": net.optimizer,
            "state": ["params", *STATE[net.optimizer]],
            "precision": net.precision,
            "run": asdict(net),
            "data": data,
            "consumed_samples": step * net.batch,
            "config": config,
            "files": files,
        }
        (partial / "manifest.json.tmp").write_text(json.dumps(manifest, indent=1))
        os.replace(partial / "manifest.json.tmp", partial / "manifest.json")
        replaced = final.with_name(final.name + ".old")
        if final.exists():  # the same step saved again: the new one replaces it, the old goes once it has
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(final, replaced)
        os.replace(partial, final)
        shutil.rmtree(replaced, ignore_errors=True)
        if keep:
            prune(root, keep, final)
    barrier(world)
    return final


def write_parts(engine: ComposedRank, partial: Path) -> list[dict]:
    """This rank's parts of every unit and state kind, one .npy file each, and their manifest entries."""
    entries = []
    for layer, kind, indices, values in parts_of(engine):
        name = f"rank{engine.world.rank}-layer{layer}-{kind}.npy"
        np.save(partial / name, np.ascontiguousarray(values), allow_pickle=False)
        entries.append(
            {
                "layer": layer,
                "kind": kind,
                "file": name,
                "ranges": runs(indices),
                "dtype": str(values.dtype),
                "count": int(values.size),
                "sha256": sha256(partial / name),
            }
        )
    return entries


def complete(root: str | Path) -> list[Path]:
    """The complete checkpoints under `root` (step-N folders with a manifest), oldest first."""
    return sorted(
        p
        for p in Path(root).glob("step-*")
        if p.is_dir() and not p.name.endswith((".partial", ".old")) and (p / "manifest.json").exists()
    )


def prune(root: str | Path, keep: int, written: Path) -> None:
    """Remove all but the `keep` newest complete checkpoints (--keep), never the one just `written` (a run started
    again into a folder that holds later steps); a folder being written is never complete."""
    for old in complete(root)[:-keep]:
        if old != written:
            shutil.rmtree(old)


def latest(root: str | Path) -> Path:
    """The newest complete checkpoint under `root` (a step folder with a manifest); CheckpointError if none."""
    root = Path(root)
    if (root / "manifest.json").exists():
        return root
    if not root.is_dir():
        raise CheckpointError(f"--load {root}: no such folder")
    done = complete(root)
    if not done:
        raise CheckpointError(f"--load {root}: holds no complete checkpoint (a step-N folder with manifest.json)")
    return done[-1]


# the run's fields a resume must repeat (beside the model's shape): its optimizer, schedule and routing rules
SAME_RUN = (
    "optimizer",
    "lr",
    "momentum",
    "weight_decay",
    "clip_grad",
    "lr_schedule",
    "warmup",
    "lr_min",
    "top_k",
    "router",
    "renormalize",
    "aux_loss",
    "capacity_factor",
    "expert_activation",
)


def read_manifest(folder: Path, net: Net, data: dict | None = None) -> dict:
    """The manifest of `folder`, checked against the run `net` (shape, optimizer) and its data (the corpus, its
    tokenizer, the seed and the global batch: a resume on other data would not continue the same sample order),
    and for full coverage."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"--load {folder}: manifest.json cannot be read ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"--load {folder}: not an spmd checkpoint (format {manifest.get('format')!r})")
    check_model(folder, manifest, net)
    check_run(folder, manifest, net, data)
    if manifest["step"] >= net.steps:
        raise CheckpointError(f"--load {folder}: is at step {manifest['step']}, and --steps {net.steps} is no later")
    check_coverage(folder, manifest, net)
    return manifest


def check_model(folder: Path, manifest: dict, net: Net) -> None:
    """The checkpoint's model is this run's: the same shape and optimizer state."""
    shape = shape_of(net)
    saved_shape = {**{k: getattr(Net(), k) for k in shape}, **manifest["shape"]}  # older: without newer fields
    if saved_shape != shape:
        diff = ", ".join(
            f"--{k.replace('_', '-')} {saved_shape.get(k)} (this run: {shape[k]})"
            for k in shape
            if saved_shape.get(k) != shape[k]
        )
        raise CheckpointError(f"--load {folder}: a checkpoint of another model: {diff}")
    if manifest["optimizer"] != net.optimizer:
        raise CheckpointError(
            f"--load {folder}: holds {manifest['optimizer']} state; this run asks for --optimizer {net.optimizer}"
        )


def check_run(folder: Path, manifest: dict, net: Net, data: dict | None) -> None:
    """The resume continues the same run: its rules (SAME_RUN) and its data, sample for sample."""
    run = manifest.get("run", {})
    same = list(SAME_RUN)
    same += ["steps"] if net.lr_schedule == "cosine" else []  # the cosine ends at --steps
    same += ["seed", "batch", "seq"] if data is None else []  # the synthetic data's identity
    for key in same:
        if key in run and run[key] != getattr(net, key):
            raise CheckpointError(
                f"--load {folder}: --{key.replace('_', '-')} differs: the checkpoint's {run[key]}, "
                f"this run's {getattr(net, key)} (a resume continues the same run)"
            )
    saved = manifest.get("data")
    if (saved is None) != (data is None):
        was, now = (f"--data {d['folder']}" if d else "synthetic tokens" for d in (saved, data))
        raise CheckpointError(f"--load {folder}: was trained on {was}; this run reads {now}")
    if saved is not None and data is not None:
        for key in ("fingerprint", "tokenizer", "seed", "batch", "seq"):
            if saved.get(key) != data[key]:
                flag = {"fingerprint": "the corpus", "tokenizer": "the tokenizer"}.get(key, f"--{key}")
                raise CheckpointError(
                    f"--load {folder}: {flag} differs: the checkpoint's {saved.get(key)}, this "
                    f"run's {data[key]} (a resume continues the same samples in the same order)"
                )


def check_coverage(folder: Path, manifest: dict, net: Net) -> None:
    """Every unit's every state saved exactly once, and every file there."""
    for layer, size in enumerate(full_sizes(net)):
        for kind in manifest["state"]:
            ranges = sorted(
                r for f in manifest["files"] if f["layer"] == layer and f["kind"] == kind for r in f["ranges"]
            )
            at = 0
            for start, stop in ranges:
                if start != at:
                    break
                at = stop
            if at != size or ranges and ranges[-1][1] != at:
                raise CheckpointError(
                    f"--load {folder}: the {kind} of unit {layer} are not all there "
                    f"(the saved ranges do not cover 0..{size} exactly once)"
                )
    missing = [f["file"] for f in manifest["files"] if not (folder / f["file"]).exists()]
    if missing:  # found before any rank starts; a corrupted file only when read (hashing it means reading it)
        raise CheckpointError(
            f"--load {folder}: {missing[0]} is missing"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )


class Reader:
    """Reads any indices of any (layer, kind) from a checkpoint's files, opening (and checking) a file once."""

    def __init__(self, folder: Path, manifest: dict):
        self.folder, self.manifest = folder, manifest
        self.open: dict[str, np.ndarray] = {}

    def _file(self, entry: dict) -> np.ndarray:
        name = entry["file"]
        if name not in self.open:
            path = self.folder / name
            if not path.exists():
                raise CheckpointError(f"--load {self.folder}: {name} is missing")
            if sha256(path) != entry["sha256"]:
                raise CheckpointError(
                    f"--load {self.folder}: {name} is corrupted (its sha256 differs from the manifest's)"
                )
            self.open[name] = np.load(path, mmap_mode="r", allow_pickle=False)
        return self.open[name]

    def has(self, layer: int, kind: str) -> bool:
        """Whether the checkpoint holds `kind` of `layer` (a balancing bias: only a run with --bias-balance's)."""
        return any(f["layer"] == layer and f["kind"] == kind for f in self.manifest["files"])

    def read(self, layer: int, kind: str, indices: np.ndarray, out: np.ndarray) -> None:
        """out[k] = the saved value of element indices[k] of layer `layer`'s `kind`."""
        entries = [f for f in self.manifest["files"] if f["layer"] == layer and f["kind"] == kind]
        starts, owner, offset = [], [], []  # every run: where it starts, its file, where it begins in the file
        for e, entry in enumerate(entries):
            at = 0
            for start, stop in entry["ranges"]:
                starts.append(start)
                owner.append(e)
                offset.append(at)
                at += stop - start
        order = np.argsort(starts)
        starts_a, owner_a, offset_a = (np.array(a, dtype=np.int64)[order] for a in (starts, owner, offset))
        run = np.searchsorted(starts_a, indices, side="right") - 1
        for e, entry in enumerate(entries):
            mine = np.flatnonzero(owner_a[run] == e)
            if mine.size:
                position = offset_a[run[mine]] + indices[mine] - starts_a[run[mine]]
                out[mine] = self._file(entry)[position]  # the runs cover the layer once: checked with the manifest


def load(engine: ComposedRank, root: str | Path, data: dict | None = None) -> int:
    """Every rank: restore its part of the newest checkpoint under `root`; returns the step it was saved at."""
    folder = latest(root)
    manifest = read_manifest(folder, engine.net, data)
    restore(engine, Reader(folder, manifest), manifest["step"])
    barrier(engine.world)
    return manifest["step"]
