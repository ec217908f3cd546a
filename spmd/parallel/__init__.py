"""Every parallelism composed on one mesh: pp x dp x fsdp x tp (+ SP), around models written once."""
