"""The mlp-* commands as presets of `python -m spmd train` (presets.PRESETS), and distributed checkpoints."""
