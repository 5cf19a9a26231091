"""Reading what a checkpoint directory holds: safetensors tensors, config.json, quantization settings, the tokenizer
and its chat template."""
