"""Tools built on the whole library: ``moeflow quantize`` (:mod:`.quantize`) and routing-trace recording
(:mod:`.record`)."""
