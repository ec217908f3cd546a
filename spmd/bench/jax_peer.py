"""The JAX peer of the training benchmark: the MLP step as a JAX user writes it (jit; data parallel over the
simulated CPU devices with NamedSharding), on the same cores. One JSON line: the step times."""

from __future__ import annotations

import json
import sys
import time


def main(config: dict) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    layers, h, f, tokens = config["layers"], config["hidden"], config["ffn"], config["tokens"]
    dtype = jnp.float32 if config["dtype"] == "float32" else jnp.float64
    if dtype == jnp.float64:
        jax.config.update("jax_enable_x64", True)
    key = jax.random.PRNGKey(0)
    params = []
    for _ in range(layers):
        k1, k2, key = jax.random.split(key, 3)
        params.append(
            (
                jax.random.normal(k1, (h, f), dtype) / h**0.5,
                jax.random.normal(k2, (f, h), dtype) / (2 * f * layers) ** 0.5,
                jnp.ones(h, dtype),
            )
        )
    x = jax.random.normal(key, (tokens, h), dtype)
    target = jax.random.normal(jax.random.split(key)[0], (tokens, h), dtype)
    devices = jax.devices()[: config["devices"]]
    mesh = Mesh(devices, ("dp",))
    rows, whole = NamedSharding(mesh, PartitionSpec("dp")), NamedSharding(mesh, PartitionSpec())
    x, target = jax.device_put(x, rows), jax.device_put(target, rows)
    params = jax.device_put(params, whole)

    def loss(params, x, target):
        for w1, w2, g in params:
            x = x + jax.nn.relu((x * g) @ w1) @ w2
        return 0.5 * jnp.sum((x - target) ** 2)

    @jax.jit
    def step(params, velocity, x, target):
        value, grads = jax.value_and_grad(loss)(params, x, target)
        velocity = jax.tree_util.tree_map(lambda v, g: 0.5 * v + 1e-6 * g, velocity, grads)
        return jax.tree_util.tree_map(lambda p, v: p - v, params, velocity), velocity, value

    velocity = jax.tree_util.tree_map(jnp.zeros_like, params)
    seconds = []
    for _ in range(config["steps"] + 1):  # the first call compiles
        start = time.perf_counter()
        params, velocity, value = step(params, velocity, x, target)
        value.block_until_ready()
        seconds.append(time.perf_counter() - start)
    return {"step_seconds": seconds[1:], "devices": len(devices)}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
