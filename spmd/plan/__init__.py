"""The planner: python -m spmd.plan."""
