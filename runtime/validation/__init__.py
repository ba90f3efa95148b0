"""The validator: GSM8K protocols, completions from the engine or a server (runners.py: the one protocol a run
drives both through; endpoint.py: the OpenAI-compatible client), fidelity (from the models' logits, or from servers'
log-probabilities), throughput, gates and reports. Imports the engine (runtime), convert and the shared helpers;
never the server (runtime.serving), which it reaches over HTTP like any other; the engine never imports it."""
