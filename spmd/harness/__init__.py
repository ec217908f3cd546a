"""How a run starts and reports: command line, per-rank job, report."""
