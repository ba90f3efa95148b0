"""`npuport serve`: the built-in runtime behind an OpenAI-compatible HTTP server (serve.py: the server; limits.py:
what a client may ask; http_handler.py: one connection; api_requests.py / api_answers.py: the API's objects in and
out; service.py: a request to its answer; continuous.py, batching.py: requests in flight). Imports the engine
(runtime) and the shared helpers; never the validator (runtime.validation), which drives servers through HTTP
alone."""
