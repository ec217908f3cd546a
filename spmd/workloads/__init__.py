"""Workloads: what is computed (shapes, inputs, reference, flops)."""
