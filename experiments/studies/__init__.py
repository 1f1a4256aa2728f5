"""Studies: named suites of runs, the fair protocol and its report, focused studies (sharpness,
recomputation, the planner)."""
