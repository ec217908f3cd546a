"""The benchmark's outputs: a markdown table and a PNG chart, from the measured rows."""

import numpy as np

from spmd.harness.report import mib
from spmd.matmul import get
from spmd.matmul.problem import Problem, flops


def _spread(values) -> str:
    """'median [min-max]' of a list of seconds or ratios."""
    v = np.asarray(values)
    return f"{np.median(v):.3g} [{v.min():.3g}-{v.max():.3g}]"


def _gflops(row: dict, seconds) -> float:
    """GFLOP/s of the row's n x n x n multiply at the median of `seconds`."""
    n = row["n"]
    return flops(n, n, n, np.dtype(row["dtype"])) / np.median(seconds) / 1e9


def _label(row: dict) -> str:
    """'fsdp' or 'fsdp no-overlap'."""
    return row["strategy"] + ("" if row["overlap"] else " no-overlap")


def _cost(row: dict):
    """The strategy's closed form for this row's run."""
    strategy = get(row["strategy"])
    return strategy.cost(
        Problem(row["n"], row["n"], row["n"], np.dtype(row["dtype"]).itemsize), strategy.mesh(row["ranks"])
    )


def summarize(row: dict, cores: int) -> dict:
    """The derived figures of one measured row."""
    ranks = row["ranks"]
    seconds, numpy_seconds = np.array(row["seconds"]), np.array(row["numpy_seconds"])
    gflops = _gflops(row, seconds)
    one_core_gflops = _gflops(row, row["one_core_seconds"])
    cores_used = min(cores, ranks * max(1, cores // ranks))
    cost = _cost(row)
    model_sent, model_peak = cost.bytes_sent, cost.peak_bytes
    return {
        "ratios": seconds / numpy_seconds,
        "gflops": gflops,
        "efficiency": gflops / (one_core_gflops * cores_used),
        "sent_ok": row["bytes_sent"] == model_sent,
        "model_sent": model_sent,
        "model_peak": model_peak,
    }


def write_table(path, meta: dict, rows: list, ring: list, small: dict, split: dict) -> None:
    cores = meta["cores"]
    lines = [
        f"# Benchmark: {meta['command']}",
        "",
        f"{meta['date']}, {meta['machine']}, {cores} cores. Times: median [min-max] over repetitions.",
        "Ratio: median of per-repetition (our time / numpy `a @ b` on all cores, timed just before);",
        "below 1 is faster than numpy. Efficiency: GFLOP/s / (one core's BLAS GFLOP/s x cores used).",
        "Bytes sent and peak memory: per rank, max over ranks, measured (model). Peak memory",
        "is measured per process, so on MPI only.",
        "",
        "| backend | strategy | ranks | n | dtype | seconds | GFLOP/s | ratio to numpy | efficiency "
        "| MB sent / rank (model) | peak MB / rank (model) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        s = summarize(row, cores)
        sent = f"{mib(max(row['bytes_sent']))} ({mib(max(s['model_sent']))}){'' if s['sent_ok'] else ' MISMATCH'}"
        peak = f"{mib(max(row['peak_bytes']))} ({mib(max(s['model_peak']))})" if row["peak_bytes"] else "-"
        lines.append(
            f"| {row['backend']} | {_label(row)} | {row['ranks']} | {row['n']} | {row['dtype']} "
            f"| {_spread(row['seconds'])} | {s['gflops']:.1f} | {_spread(s['ratios'])} "
            f"| {s['efficiency']:.2f} | {sent} | {peak} |"
        )
    lines += [
        "",
        "numpy `a @ b` alone, same run (all cores, and one core):",
        "",
        "| n | dtype | all cores: seconds | GFLOP/s | one core: seconds | GFLOP/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for n, dtype in dict.fromkeys((r["n"], r["dtype"]) for r in rows):
        same = [r for r in rows if (r["n"], r["dtype"]) == (n, dtype)]
        numpy_all = [t for r in same for t in r["numpy_seconds"]]
        one = same[0]["one_core_seconds"]
        lines.append(
            f"| {n} | {dtype} | {_spread(numpy_all)} | {_gflops(same[0], numpy_all):.1f} "
            f"| {_spread(one)} | {_gflops(same[0], one):.1f} |"
        )
    lines += [""] + collective_lines(ring)
    lines += [
        "",
        "The problem statement's case, 8x6 @ 6x4 on 2 devices (threads), one call:",
        "",
        "| function | milliseconds |",
        "| --- | --- |",
    ]
    lines += [f"| {name} | {_spread(np.array(times) * 1e3)} |" for name, times in small.items()]
    lines += [
        "",
        f"FSDP's multiplies without communication, n = {split['n']}, one BLAS thread: two "
        f"(n/2 x n) @ (n x n/2) into C's column halves, over one (n/2 x n) @ (n x n): "
        f"{_spread(split['ratios'])}",
    ]
    path.write_text("\n".join(lines) + "\n")


def collective_lines(ring: list) -> list[str]:
    """The table of our collectives against MPI's own, one row per collective and rank count."""
    lines = [
        "Collectives (ours, over the MPI backend) against MPI's own on the same data "
        "(ring: the FSDP matmul's streaming all-gather, against MPI_Allgather):",
        "",
        "| collective | ranks | MiB | ours: seconds | MPI: seconds | bandwidth ratio (ours / MPI) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in ring:
        ratio = np.array(r["mpi_seconds"]) / np.array(r["seconds"])
        lines.append(
            f"| {r['strategy']} | {r['ranks']} | {mib(r['bytes'])} | {_spread(r['seconds'])} "
            f"| {_spread(r['mpi_seconds'])} | {_spread(ratio)} |"
        )
    return lines


def write_chart(path, rows: list) -> None:
    """Left: ratio to numpy per configuration and size. Right: bytes sent and peak memory per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5))
    sizes = sorted({(r["n"], r["dtype"]) for r in rows})
    configs = list(dict.fromkeys((r["backend"], _label(r), r["ranks"]) for r in rows))
    width = 0.8 / len(sizes)
    for i, (n, dtype) in enumerate(sizes):
        medians, lows, highs = [], [], []
        for backend, strategy, ranks in configs:
            key = (backend, strategy, ranks, n, dtype)
            match = [r for r in rows if (r["backend"], _label(r), r["ranks"], r["n"], r["dtype"]) == key]
            ratios = np.array([np.nan])
            if match:
                ratios = np.array(match[0]["seconds"]) / np.array(match[0]["numpy_seconds"])
            medians.append(np.median(ratios))
            lows.append(np.median(ratios) - ratios.min())
            highs.append(ratios.max() - np.median(ratios))
        x = np.arange(len(configs)) + i * width
        left.bar(x, medians, width, yerr=[lows, highs], label=f"n={n} {dtype}", capsize=2)
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_xticks(np.arange(len(configs)) + 0.4 - width / 2)
    left.set_xticklabels([f"{b}\n{s} x{r}" for b, s, r in configs], rotation=90, fontsize=7)
    left.set_ylabel("time / numpy a @ b (median, min-max)")
    left.set_title("Speed: below 1 beats numpy on the same cores")
    left.legend(fontsize=8)

    n, dtype = max(sizes)
    memory = [r for r in rows if r["backend"] == "mpi" and (r["n"], r["dtype"]) == (n, dtype) and r["overlap"]]
    at = np.arange(len(memory))
    last = [r["ranks"] - 1 for r in memory]  # not rank 0, which also holds the gathered C
    bars = {
        "peak memory of the last rank (measured)": [r["peak_bytes"][i] for r, i in zip(memory, last, strict=True)],
        "peak memory of the last rank (model)": [_cost(r).peak_bytes[i] for r, i in zip(memory, last, strict=True)],
        "bytes sent by the last rank (measured)": [r["bytes_sent"][i] for r, i in zip(memory, last, strict=True)],
    }
    for j, (label, values) in enumerate(bars.items()):
        right.bar(at + (j - 1) * 0.27, np.array(values) / 2**20, 0.27, label=label)
    right.set_xticks(at)
    right.set_xticklabels([f"{r['strategy']} x{r['ranks']}" for r in memory])
    right.set_ylabel("MiB")
    right.set_title(f"Memory vs communication per rank, MPI, n={n} {dtype}")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
