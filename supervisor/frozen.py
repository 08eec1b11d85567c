"""The entry point of the one-folder executable (deploy/pyinstaller/npu-proxy.spec).

In a frozen program `sys.executable` is the executable itself, so every child the supervisor
starts as `sys.executable -m MODULE ...` (the gateway, the workers, doctor's probe) or
`sys.executable -c CODE` (device discovery) comes back here. `main` runs those as Python
would; any other command line is the `npx-supervisor` command line. Outside a frozen
program nothing calls it: `python` itself takes `-m` and `-c`.
"""

from __future__ import annotations

import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) >= 2 and args[0] == "-m":
        # NOTE: as `python -m`: the module runs as __main__ and sees its own arguments.
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return
    if len(args) >= 2 and args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
        return
    from npu_proxy.supervisor.cli import main as cli_main

    sys.argv = [sys.argv[0], *args]
    cli_main()
