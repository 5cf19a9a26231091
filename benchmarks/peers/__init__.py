"""moeflow against other engines (llama.cpp, transformers) on the same weights in the same run (README.md)."""
