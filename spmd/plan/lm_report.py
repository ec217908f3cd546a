"""python -m spmd.plan for a language model: its parameters by kind, its flops per token and its training state
under pure FSDP (ZeRO-3), all counted through the model's spec (its units' parameter tables), the count the
engine allocates and the checkpoint covers.

A mixture of experts' token passes through top_k of the E experts a block: its active parameters count those.
"""

from __future__ import annotations

from spmd.harness.mfu import flops_per_token as run_flops_per_token
from spmd.model.config import Net
from spmd.model.precision import Precision
from spmd.model.registry import full_sizes, parameters
from spmd.plan.layouts import state_per_device

GB = 1e9
FLOPS_CONVENTION = (
    "PaLM's / nanoGPT's 6N + 12 L H Q T (PaLM, Chowdhery et al. 2022, Appendix B): forward + "
    "backward, 2 + 4 flops a parameter a token, attention scores not halved for the causal mask"
)
FLOPS_N = (
    "embedding excluded: N = every parameter a token passes through (of a mixture of experts, its top-k "
    "experts and the router) but the input embedding table (a lookup, no matmul); the LM head's h x V included, "
    "tied or not; the norms included, as torchtitan counts"
)
PARAMETER_UNITS = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3))
FLOP_UNITS = (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3))


def human(n: float, units: tuple[tuple[str, float], ...] = PARAMETER_UNITS) -> str:
    """3 significant figures with a unit: 8.03 B, 70.6 B, 6.16 M; 57.9 GFLOP."""
    for unit, scale in units:
        if abs(n) >= scale:
            return f"{n / scale:#.3g}".rstrip(".") + f" {unit}"
    return f"{n:#.3g}".rstrip(".")


def by_label(net: Net) -> dict[str, tuple[int, int, int]]:
    """(per block, blocks holding it, total) of each row of the parameter table, in the spec's order; a tied
    weight's second copy counts 0; per block is the first block's (0 and 0 blocks: a row of no block)."""
    spec = net.spec
    seconds, blocks = {b for _, b in spec.tied(net)}, spec.block_units(net)
    totals: dict[str, int] = dict.fromkeys(spec.labels(net), 0)
    each: dict[str, int] = {}
    holders: dict[str, set[int]] = {}
    present: set[str] = set()  # the rows some piece has (a dense model has no router)
    for unit, kind in enumerate(spec.kinds(net)):
        for piece in spec.table(net, kind):
            label, size = spec.label(net, piece.name), 0 if unit in seconds else piece.size
            totals[label] += size
            if unit in blocks:
                holders.setdefault(label, set()).add(unit)
                each[label] = each.get(label, 0) + (size if min(holders[label]) == unit else 0)
            present.add(label)
    return {
        label: (each.get(label, 0), len(holders.get(label, ())), n) for label, n in totals.items() if label in present
    }


def idle_parameters(net: Net) -> int:
    """Parameters a token does not pass through: of each block's stacked experts, the E - top_k it is not
    routed to."""
    spec, idle = net.spec, 0
    for kind in spec.kinds(net):
        for piece in spec.table(net, kind):
            if piece.over_ep:  # the experts' weights, stacked
                idle += piece.size // net.experts * (net.experts - net.top_k)
    return idle


def flops_per_token(net: Net) -> int:
    """Training flops (forward + backward) per token at its context: 6N + 12 L H Q T, N counting a token's
    top_k experts only (the run's MFU counts every expert a block holds)."""
    return run_flops_per_token(net) - 6 * idle_parameters(net)


def format_parameters(net: Net, title: str) -> list[str]:
    rows, total = by_label(net), parameters(net)
    kv = f", {net.kv} kv heads" if net.kv != net.heads else ""
    experts = f", {net.experts} experts, top-{net.top_k}" if net.experts else ""
    lines = [
        f"{title}: {net.layers} layers, hidden {net.hidden}, {net.heads} heads of {net.head_size}{kv}, ffn "
        f"{net.ffn}{experts}, vocab {net.vocab}, {'tied' if net.tie_embeddings else 'untied'} embeddings, seq "
        f"{net.seq}",
        f"parameters: {human(total)} ({total:,})",
        "",
        f"{'':<28} {'per block':>15} {'blocks':>6} {'total':>16} {'share':>6}",
    ]
    for label, (each, count, n) in rows.items():
        lines.append(
            f"{label:<28} {f'{each:,}' if count else '':>15} {str(count) if count else '':>6} {n:>16,} "
            f"{100 * n / total:5.1f}%"
        )
    block = full_sizes(net)[net.spec.block_units(net)[0]]
    parts: dict[str, int] = {}  # the block's rows by their first word: attention, SwiGLU or experts, norms
    for label, (each, count, _) in rows.items():
        if count:
            parts[label.split()[0]] = parts.get(label.split()[0], 0) + each
    summed = ", ".join(f"{part} {n:,}" for part, n in parts.items())
    lines.append(f"{'one block':<28} {block:>15,} {'':>6} {'':>16} ({summed})")
    lines.append(f"{'total':<28} {'':>15} {'':>6} {total:>16,} {100.0:5.1f}%")
    return lines


def format_flops(net: Net) -> list[str]:
    flops, seq = flops_per_token(net), net.seq
    attention = 12 * net.layers * net.heads * net.head_size * seq
    n = (flops - attention) // 6
    active = parameters(net) - idle_parameters(net)
    why = f"its top-{net.top_k} of {net.experts} experts a block" if net.experts else "dense: equal to the total"
    return [
        f"active parameters per token: {human(active)} ({active:,}; {why})",
        f"flops per token of a training step: {human(flops, FLOP_UNITS)} ({flops:,})",
        f"  convention: {FLOPS_CONVENTION}",
        f"  {FLOPS_N}: N = {human(n)} ({n:,})",
        f"  6N = {6 * n:,}; 12 L H Q T = 12 x {net.layers} x {net.heads} x {net.head_size} x {seq} = {attention:,}",
    ]


def format_fsdp_state(net: Net, devices: int, memory_gb: float) -> list[str]:
    """The training state per device under pure FSDP (ZeRO-3) over `devices`, from layouts.state_per_device:
    its equal layers are the blocks, each carrying 1/L of the embedding, final norm and head (the total rounded up
    to a multiple of L: fewer than L parameters more)."""
    total, units = parameters(net), net.layers
    padded = units * -(-total // units)  # state_per_device takes equal units
    memory = state_per_device(padded, units, devices, Precision(net.precision, net.reduce_dtype), net.optimizer)[
        "ZeRO-3 (P_os+g+p)"
    ]
    used = sum(memory.values())
    sizes = full_sizes(net)
    block = max(sizes[u] for u in net.spec.block_units(net))
    biggest = max(sizes)
    return [
        f"training state per device, pure FSDP (ZeRO-3) over {devices} device{'s' if devices > 1 else ''}, "
        f"{net.optimizer}, {net.precision}"
        f"{' (reduce ' + net.reduce_dtype + ')' if net.reduce_dtype else ''}: GB (activations not counted)",
        "  "
        + ", ".join(f"{kind} {memory[kind] / GB:.2f}" for kind in ("params", "master", "grads", "optimizer"))
        + f"; total {used / GB:.2f} GB: {'fits' if used <= memory_gb * GB else 'does NOT fit'} in "
        f"{memory_gb:g} GB",
        f"  (the gather and gradient buffers hold one of {units} equal units of {human(padded // units)} "
        f"parameters, a block and 1/{units} of the embedding and head; wrapped as its own unit, the largest, "
        f"{'the embedding or head' if biggest > block else 'a block'}, has {human(biggest)})",
    ]


def lm_report(net: Net, title: str, devices: int | None, memory_gb: float) -> str:
    """The report for a language model: its parameters, flops per token, and (given --devices) its FSDP state."""
    lines = format_parameters(net, title) + [""] + format_flops(net)
    if devices is not None:
        lines += [""] + format_fsdp_state(net, devices, memory_gb)
    return "\n".join(lines)
