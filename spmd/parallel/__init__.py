"""Every parallelism composed on one mesh: pp x dp x fsdp x ep x cp x tp (+ SP), around models written once."""
