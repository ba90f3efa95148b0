"""The validator: GSM8K protocols, completions from the engine or an endpoint, fidelity (from the models' logits,
or from servers' log-probabilities), throughput, gates, reports, and serve (openai_api.py: the API's objects;
batching.py: requests in flight; service.py: a request to its answer; serve.py: HTTP). Imports the engine
(runtime), convert and the shared helpers; the engine never imports it."""
