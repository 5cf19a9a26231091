"""Tools that build the shipped data (the embedded model, its predictors) and the docs' tables; run each from the
repository root as ``python -m scripts.<name>``."""
