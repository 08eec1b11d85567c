"""The gateway core: broker (ZeroMQ), router, model switching, served models, metrics, health."""
