"""How a run is seen: traces, plots, schedule tables."""
