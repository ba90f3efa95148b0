"""The validator: GSM8K protocols, completions from the engine or an endpoint, fidelity, throughput, gates,
reports and serve. Imports the engine (runtime), convert and the shared helpers; the engine never imports it."""
