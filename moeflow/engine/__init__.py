"""Running a loaded model: the continuous-batching scheduler and its row-slotted KV cache."""
