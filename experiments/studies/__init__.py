"""Studies: suites of runs, the fair protocol and its report, and focused studies."""
