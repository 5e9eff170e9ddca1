"""Serving: the HTTP API over any `Backend`. The protocol a backend implements and the server serves from
(`backend`), the OpenAI and TGI request bodies parsed (`api_requests`) into prompts (`tokenizer`: text to
ids, chat templates) and each request's generation settings (`sampling_params`), the errors a request can
meet, each with its HTTP status (`errors`), the HTTP apps' shared base for health, readiness, metrics and
errors (`http_app`), the serving server (`server`), and the metric names every server exports
(`engine_metrics`). The engine, the routers and the KV roles are backends or servers built on it; of the
other parts it imports only the model's config."""
