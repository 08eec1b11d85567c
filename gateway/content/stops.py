"""Stop strings: their bounds (every API's, checked once) and the gateway's matcher.

OpenAI `stop`, Anthropic `stop_sequences` and Ollama `options.stop` all reach OpenVINO's
`stop_strings` and, for Anthropic, the gateway's `StopMatcher` (the worker keeps a matched stop
in its text so the reply can name it). Both match every stop on every token, so their number
and length are bounded here (OpenAI allows 4 and its compatible servers a few more), and the
matcher is an Aho-Corasick automaton: its work per character does not grow with the number of
stops.
"""

from __future__ import annotations

from npu_proxy.gateway.core.errors import invalid

MAX_STOPS = 16
MAX_STOP_CHARS = 512


def stop_list(value: str | list[str] | None, param: str = "stop") -> list[str]:
    """The non-empty stop strings of a request, or a 400 naming the limit."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if len(items) > MAX_STOPS:
        raise invalid(f"{param}: {len(items)} stop sequences; the limit is {MAX_STOPS}",
                      param=param)
    longest = max((len(s) for s in items), default=0)
    if longest > MAX_STOP_CHARS:
        raise invalid(f"{param}: a stop sequence of {longest} characters; the limit is "
                      f"{MAX_STOP_CHARS}", param=param)
    return [s for s in items if s]


class StopMatcher:
    """Holds back text that may be the start of a stop sequence and cuts the text at the one
    that ended the generation (the worker keeps it, see SamplingParams.include_stop; the last
    token may even run past it: a stop "a" ends "Paris" after the whole token).

    NOTE: the first stop to end in the text wins (the longest of those ending at the same
    place), which is where the worker stopped generating.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.matched: str | None = None
        self.steps = 0  # automaton transitions taken: the matcher's work, for the tests
        self._buf = ""
        self._state = 0
        # The trie: edges, failure links, depth (characters matched) and the longest stop
        # that ends at each state (-1: none).
        self._next: list[dict[str, int]] = [{}]
        self._fail = [0]
        self._depth = [0]
        self._out = [-1]
        for index, stop in enumerate(self.stops):
            state = 0
            for c in stop:
                nxt = self._next[state].get(c)
                if nxt is None:
                    nxt = len(self._next)
                    self._next[state][c] = nxt
                    self._next.append({})
                    self._fail.append(0)
                    self._depth.append(self._depth[state] + 1)
                    self._out.append(-1)
                state = nxt
            self._out[state] = index
        order = list(self._next[0].values())
        for state in order:  # breadth first: a state's failure link is shallower
            for c, child in self._next[state].items():
                order.append(child)
                fail = self._fail[state]
                while fail and c not in self._next[fail]:
                    fail = self._fail[fail]
                link = self._next[fail].get(c, 0)
                self._fail[child] = link if link != child else 0
                if self._out[child] < 0:
                    self._out[child] = self._out[self._fail[child]]

    def _step(self, state: int, c: str) -> int:
        while True:
            self.steps += 1
            nxt = self._next[state].get(c)
            if nxt is not None:
                return nxt
            if not state:
                return 0
            state = self._fail[state]

    def feed(self, text: str) -> str:
        if not self.stops or self.matched is not None:
            return text if not self.stops else ""
        start = len(self._buf)
        self._buf += text
        state = self._state
        for i, c in enumerate(text):
            state = self._step(state, c)
            if (hit := self._out[state]) >= 0:
                self.matched = self.stops[hit]
                out = self._buf[:start + i + 1 - len(self.matched)]
                self._buf = ""
                return out
        self._state = state
        # NOTE: the state's depth is the longest end of the text that begins some stop.
        hold = self._depth[state]
        out = self._buf[:len(self._buf) - hold]
        self._buf = self._buf[len(out):]
        return out

    def finish(self) -> str:
        text, self._buf = self._buf, ""
        return text
