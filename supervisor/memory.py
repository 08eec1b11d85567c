"""How much memory a worker may hold, and what it holds: the supervisor kills one past its
limit, so a runaway worker (a request no budget foresaw, a leak) dies alone, before the
machine swaps or the kernel's OOM killer picks a process, perhaps the gateway (issue 43).

The limit is a worker's `memory_limit_mb`, by default its role's share of the machine's
memory. NOTE: resident memory, read from /proc by the supervisor, not an address-space limit
(RLIMIT_AS) in the worker: OpenVINO and its thread pools reserve far more address space than
they touch, so such a limit fails ordinary loads; a cgroup would need privileges a user's
service does not have. Elsewhere than Linux there is no reading and no limit.
"""

from __future__ import annotations

from pathlib import Path

from npu_proxy.protocol.config import WorkerSpec

# The share of the machine's memory a role may hold by default: the LLM roles hold a model
# of gigabytes and its KV cache; the others a model of megabytes.
BIG_ROLES = ("llm", "npu", "vlm")
BIG_SHARE = 0.6
SMALL_SHARE = 0.25


def machine_mib() -> float | None:
    """The machine's memory (MemTotal), MiB; None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def resident_mib(pid: int) -> float | None:
    """The process's resident memory (VmRSS), MiB; None where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def limit_mib(spec: WorkerSpec, machine: float | None) -> float | None:
    """The worker's limit, MiB: its memory_limit_mb, else its role's share; None for none."""
    if spec.memory_limit_mb < 0:
        return None
    if spec.memory_limit_mb > 0:
        return float(spec.memory_limit_mb)
    if machine is None:
        return None
    return machine * (BIG_SHARE if spec.role in BIG_ROLES else SMALL_SHARE)


def over_limit(spec: WorkerSpec, pid: int | None, machine: float | None) -> str | None:
    """Why the worker must be killed for its memory now, or None."""
    limit = limit_mib(spec, machine)
    held = resident_mib(pid) if pid is not None and limit is not None else None
    if limit is None or held is None or held <= limit:
        return None
    return (f"resident memory {held:.0f} MiB is over its limit of {limit:.0f} MiB "
            f"(memory_limit_mb)")
