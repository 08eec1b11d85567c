"""Wire types, configuration and socket helpers shared by every npu-proxy process."""
