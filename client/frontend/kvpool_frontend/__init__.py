"""kvpool-frontend: an OpenAI-compatible HTTP server over kvpoold's model (server.py), with its
tokenizers (tokenizer.py), chat templates (chat.py), request mapping (protocol.py), API keys and
sharing domains (auth.py, and the keys tool keys.py), admission (admission.py), the stall bound
on responses (writer.py), and an HTTP load generator (loadgen.py). Run it with
`python3 -m kvpool_frontend` or the launcher the build writes
(<build>/client/frontend/kvpool-frontend); docs/frontend.md is the operator's guide."""
