"""What rank 0 reports after a run: speed, and bytes and memory per rank against the model."""

import numpy as np

from spmd.model import Problem, bytes_sent, peak_bytes_held


def accounting(strategy: str, shape: tuple, dtypes: list, measured: list) -> dict:
    """Per-rank bytes sent and peak memory, measured and from the model.

    `measured` holds each rank's (bytes sent, peak bytes or -1 where not measured).
    The model needs A, B and C to share an element size; otherwise it is left out.
    """
    (m, k, n), ranks = shape, len(measured)
    out = {
        "bytes_sent": [int(x[0]) for x in measured],
        "peak_bytes": [int(x[1]) for x in measured] if all(x[1] >= 0 for x in measured) else None,
    }
    sizes = {np.dtype(d).itemsize for d in dtypes}
    if len(sizes) == 1:
        p = Problem(m, k, n, ranks, sizes.pop())
        out["model_bytes_sent"] = [bytes_sent(strategy, p, r) for r in range(ranks)]
        out["model_peak_bytes"] = [peak_bytes_held(strategy, p, r) for r in range(ranks)]
    return out


def _mib(values) -> str:
    return " ".join(f"{v / 2**20:.1f}" for v in values)


def format_report(r: dict) -> str:
    """The short human-readable report rank 0 prints."""
    lines = [
        f"spmd {r['strategy']}: {r['ranks']} ranks on {r['backend']}, "
        f"A {r['m']}x{r['k']} @ B {r['k']}x{r['n']}, {r['dtype']}",
        f"  multiply: {r['seconds']:.4f} s, {r['gflops']:.1f} GFLOP/s",
        f"  sent per rank, MiB: {_mib(r['bytes_sent'])}"
        + (f" (model: {_mib(r['model_bytes_sent'])})" if "model_bytes_sent" in r else ""),
    ]
    if "model_peak_bytes" in r:
        measured = f"{_mib(r['peak_bytes'])}, model: " if r["peak_bytes"] else "model (measured under MPI only): "
        lines.append(f"  peak memory per rank, MiB: {measured}{_mib(r['model_peak_bytes'])}")
    if r.get("trace"):
        hidden = r["hidden_fraction"]
        lines.append(f"  trace: {r['trace']}" + (f", {hidden:.0%} of receive time hidden behind compute"
                                                  if hidden is not None else ""))
    if "ok" in r:
        verdict = "OK" if r["ok"] else "MISMATCH"
        lines.append(
            f"  check: max abs error {r['max_abs_error']:.3g} "
            f"(tolerance {r['tolerance']:.3g}) {verdict}"
        )
    return "\n".join(lines)
