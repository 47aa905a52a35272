"""ggfit's search: real-decode probes, the search space and the Optuna study. May import fitter."""
