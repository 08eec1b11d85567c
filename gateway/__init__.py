"""The HTTP gateway: the only network surface; holds no model and never blocks its loop."""
