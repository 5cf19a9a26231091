"""The ``moeflow`` command (entry point ``moeflow.cli:main``): :mod:`.commands` (demo, generate, quantize) and
the subcommands other modules register (:mod:`.predictors`: trace, train-predictor, eval-predictor;
``moeflow.sim.cli``: simulate, bench)."""

from moeflow.cli.commands import build_parser, embedded_model_path, main

__all__ = ["main", "build_parser", "embedded_model_path"]
