"""Chat: templates (jinja2, transformers' conventions), reply formats (reasoning and tool-call markup, harmony),
guided decoding and the tool-call grammar. Below the engine: imports only :mod:`moeflow.errors`."""
