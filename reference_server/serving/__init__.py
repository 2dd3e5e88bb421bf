"""The serving side of the reference server: backends (in-process or worker processes),
the worker process and its wire protocol, KV transfer, routing, the cluster with recovery,
and the OpenAI-compatible gateway. Import the submodules directly."""
