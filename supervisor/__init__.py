"""The supervisor: spawns, watches, restarts and stops the gateway and the device workers."""
