"""Engine features end to end on small models: MTP, prompt lookup, the dual-batch pipeline, ``moeflow serve``."""
