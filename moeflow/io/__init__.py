"""Reading what a checkpoint ships besides its weights: chat templates (and, after the restructure, the rest)."""
