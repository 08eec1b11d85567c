"""Test-only fault injection of one worker (`faults = {...}` in a `[[workers]]` section).

Not a supported interface: `npx-supervisor config` does not show it (TEST_ONLY_FIELDS) and
docs/settings.md only says that it exists."""

from __future__ import annotations

import msgspec

# NOTE: the fields of the configuration that are test hooks, not settings: left out of what
# `npx-supervisor config` prints and of docs/settings.md, yet read from the file as ever.
TEST_ONLY_FIELDS = frozenset({"faults"})


class FaultHooks(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Test-only fault injection; inert unless set explicitly for one worker."""

    hang_in_load: bool = False
    # Hold a GGUF conversion's child process for good once it saved the IR, before the
    # folder is marked complete (workers/generation/conversion.py).
    hang_in_conversion: bool = False
    crash_in_load: bool = False
    exit_after_tokens: int | None = None
    # Exit once a request whose X-Request-ID starts with this generates a token: a poison
    # request, whatever else runs beside it, on every worker that runs it.
    exit_on_request: str = ""
    abort_after_tokens: int | None = None
    stall_after_tokens: int | None = None
    # Stay loading until this file exists (a test can then observe the loading state).
    hold_load_until: str = ""
    # Skip one sequence number in each request's frames once it has this many tokens (what
    # a frame dropped by PUB looks like to the gateway).
    gap_after_tokens: int | None = None
    # Take no request (Generate) until this file exists: a client can give up before its
    # request is accepted.
    hold_accept_until: str = ""
    # Hold each request after the engine dequeued it (tracked as active) and before it starts
    # generating, until this file exists: an abort can then arrive in exactly that window.
    hold_start_until: str = ""
    # Like hold_start_until, one request at a time: each waits for a file in this folder
    # named after its X-Request-ID (other characters than [A-Za-z0-9._-] as "_"), so a test
    # can hold several requests, one after the other, in a long "prefill" of its making.
    hold_start_dir: str = ""
    # With hold_start_dir, hold only the requests whose X-Request-ID starts with this; the
    # others run as ever (a server that other tests share can hold one request of a test's).
    hold_start_prefix: str = ""
    # Constrain every generation that has no other constraint (JSON schema, regex) to this
    # regular expression: a test hook that makes a tiny model answer in a given shape (e.g.
    # `<think>…</think>answer`) through any API.
    force_regex: str = ""
    # Once this many tokens were generated, hold the GIL on the engine thread for
    # spin_seconds while spinning the CPU, once per process: what a long prefill inside one
    # pipeline step looks like from outside (silent heartbeats, but computing).
    spin_after_tokens: int | None = None
    spin_seconds: float = 0.0
    # How many of the following steps spin so (once each): consecutive long steps, as an
    # agent's prefill read in steps is on a loaded machine.
    spin_times: int = 1
    # Once this many tokens were generated, hold the GIL for good without using the CPU: a
    # deadlock inside a native call.
    freeze_after_tokens: int | None = None
    # Sleep this long after each generated token (the GIL released, heartbeats going on): a
    # generation slower than any deadline a test sets, whatever the machine's speed.
    token_delay_seconds: float = 0.0
    # Send heartbeats to the supervisor only, to no gateway, until this file exists: the
    # supervisor says the worker serves while a gateway has not heard it yet.
    hold_gateway_heartbeats_until: str = ""
