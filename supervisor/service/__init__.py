"""The supervisor: set-up (startup.py), control handlers (commands.py), the watch loop
(loop.py)."""
