"""What rank 0 reports after a run: speed, and bytes and memory per rank against the model."""

import numpy as np

from spmd.matmul.problem import Problem
from spmd.matmul.strategy import Strategy
from spmd.transport.mesh import Mesh


def accounting(strategy: Strategy, mesh: Mesh, shape: tuple, dtypes: list, measured: list, per_process: bool) -> dict:
    """Per-rank bytes sent and peak memory, measured and from the model.

    `measured` holds each rank's (bytes sent, peak bytes allocated during the
    multiply or -1, bytes of its input blocks). With one process per rank
    (`per_process`) each rank's peak memory is known; with threads only the
    total of all ranks (rank 0 traced the whole process).
    The model needs A, B and C to share an element size; otherwise it is left out.
    """
    m, k, n = shape
    inputs = [int(x[2]) for x in measured]
    out = {
        "bytes_sent": [int(x[0]) for x in measured],
        "peak_bytes": [int(x[1]) + i for x, i in zip(measured, inputs, strict=True)] if per_process else None,
        "peak_bytes_all_ranks": None if per_process else int(measured[0][1]) + sum(inputs),
    }
    sizes = {np.dtype(d).itemsize for d in dtypes}
    if len(sizes) == 1:
        cost = strategy.cost(Problem(m, k, n, sizes.pop()), mesh)
        out["model_bytes_sent"] = cost.bytes_sent
        out["model_peak_bytes"] = cost.peak_bytes
    return out


def mib(nbytes: float) -> str:
    """Bytes as MiB with one decimal."""
    return f"{nbytes / 2**20:.1f}"


UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def byte_unit(values) -> tuple[str, int]:
    """The one binary unit every report uses for `values`: the largest that keeps their largest >= 1."""
    largest = max((abs(v) for v in values), default=0)
    return next(((name, size) for name, size in UNITS if largest >= size), UNITS[-1])


def in_unit(values, unit: tuple[str, int]) -> str:
    return " ".join(f"{v / unit[1]:.1f}" for v in values)


def format_report(r: dict) -> str:
    """The short human-readable report rank 0 prints."""
    lines = [
        f"spmd {r['strategy']}: {r['ranks']} ranks (mesh {r['mesh']}) on {r['backend']}, "
        f"A {r['m']}x{r['k']} @ B {r['k']}x{r['n']}, {r['dtype']}",
        f"  multiply: {r['seconds']:.4f} s, {r['gflops']:.1f} GFLOP/s",
    ]
    sent = byte_unit(r["bytes_sent"] + r.get("model_bytes_sent", []))
    lines.append(
        f"  sent per rank, {sent[0]}: {in_unit(r['bytes_sent'], sent)}"
        + (f" (model: {in_unit(r['model_bytes_sent'], sent)})" if "model_bytes_sent" in r else "")
    )
    if "model_peak_bytes" in r:
        model = r["model_peak_bytes"]
        if r["peak_bytes"]:
            unit = byte_unit(r["peak_bytes"] + model)
            lines.append(
                f"  peak memory per rank, {unit[0]}: {in_unit(r['peak_bytes'], unit)}, model: {in_unit(model, unit)}"
            )
        else:  # threads: one process, so the total of all ranks
            unit = byte_unit([r["peak_bytes_all_ranks"], sum(model)])
            lines.append(
                f"  peak memory per rank, {unit[0]}, model: {in_unit(model, unit)}; all ranks together "
                f"(one process): {in_unit([r['peak_bytes_all_ranks']], unit)}, model: "
                f"{in_unit([sum(model)], unit)}"
            )
    if r.get("trace"):
        hidden = r["hidden_fraction"]
        lines.append(
            f"  trace: {r['trace']}"
            + (f", {hidden:.0%} of receive time hidden behind compute" if hidden is not None else "")
        )
    if "check_problem" in r:
        lines.append(f"  check: FAILED: {r['check_problem']}")
    elif "ok" in r:
        verdict = "OK" if r["ok"] else "MISMATCH"
        lines.append(f"  check: max abs error {r['max_abs_error']:.3g} (tolerance {r['tolerance']:.3g}) {verdict}")
    return "\n".join(lines)
