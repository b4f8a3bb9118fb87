"""One request's record: what the gateway decided for it, and what its generation reported.

The gateway makes one per request and hands it to the engine's generate() through
`current_request` (tasks copy the context), which queues it with the request's arguments for
mlx-vlm's worker thread (dflash2_generator's RoutedArguments); the engine notes tokens, draft
counts and the round loop's token sources on it; the gateway logs its arrival and finish
lines from it.
"""

import contextvars
import logging
from dataclasses import dataclass, field

logger = logging.getLogger("dflash2.server")


def one_line(text: str) -> str:
    """text with control characters escaped (\\n, \\x1b, ...): a request path is percent-decoded,
    so %0A would otherwise start a forged line in the log."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


@dataclass
class RequestRecord:
    id: int
    method: str
    path: str
    mode: str = "plain"  # speculative | fallback | refused | plain
    reason: str = None
    speculative: bool = False
    stop: list = field(default_factory=list)  # the request's stop sequences
    stop_sequence: str = None  # the one its answer ended at (dflash2_generator.RecordingTokens)
    seed: int = None  # a sampled request's, sent or picked (dflash2_routing.with_seed)
    announced: bool = False  # arrival line logged
    cancelled: str = None  # disconnected | timeout | shutdown
    token_stream: object = None  # the engine's RecordingTokens, once generation starts
    status: int = None
    tokens: int = 0
    prompt_tokens: int = None
    cached_tokens: int = None  # prompt tokens restored from the prefix cache
    draft_rounds: int = None
    draft_n: int = None
    draft_n_accepted: int = None
    round_counts: object = None  # dflash2_policy.RoundCounts, filled by the round loop as it runs
    peak_memory_gb: float = None

    def header_value(self) -> str:
        if self.mode in ("fallback", "refused"):
            return f"{self.mode}; reason={self.reason}"
        return self.mode

    def log_arrival(self):
        """Once per request: when it is refused, or when its generation starts (so a request
        mlx-vlm rejects is not first logged as speculative)."""
        if not self.announced:
            self.announced = True
            logger.info("request %d %s %s: %s", self.id, self.method, one_line(self.path), self.header_value())

    def cancel(self, reason: str):
        """Stops the request's generation within a token or two (safe from any thread)."""
        self.cancelled = self.cancelled or reason
        if self.token_stream is not None:
            self.token_stream.close()

    def note_token(self, token):
        self.tokens += getattr(token, "token_count", 1)
        if token.finish_reason:
            self.peak_memory_gb = token.peak_memory
            self.cached_tokens = token.cached_tokens
            self.draft_rounds = token.draft_rounds
            self.draft_n = token.draft_n
            self.draft_n_accepted = token.draft_n_accepted

    def note_round_counts(self, counts):
        self.round_counts = counts

    def draft_counts(self) -> dict:
        """The speculative route's draft counts, as mlx-vlm's final timings have them."""
        if self.draft_n is None:
            return {}
        return {"draft_rounds": self.draft_rounds, "draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted}

    def token_sources(self) -> dict:
        counts = self.round_counts
        return {"tokens_from_rounds": counts and counts.tokens_from_rounds,
                "tokens_from_plain_steps": counts and counts.tokens_from_plain_steps}

    def finish_summary(self) -> str:
        parts = [f"status={'disconnected' if self.cancelled == 'disconnected' else self.status}"]
        if self.reason:  # a fallback's or refusal's, as the arrival line gave it
            parts.append(f"reason={self.reason}")
        if self.cancelled not in (None, "disconnected"):
            parts.append(f"cancelled={self.cancelled}")
        if self.tokens:
            parts.append(f"tokens={self.tokens}")
            if self.prompt_tokens is not None:
                parts.append(f"prompt_tokens={self.prompt_tokens} cached_tokens={self.cached_tokens or 0}")
            if self.draft_rounds is not None:
                acceptance = self.draft_n_accepted / self.draft_n if self.draft_n else 0.0
                parts.append(f"rounds={self.draft_rounds} "
                             f"accepted={self.draft_n_accepted}/{self.draft_n} ({acceptance:.0%})")
            if self.round_counts is not None:
                parts.append(" ".join(f"{name}={value}" for name, value in self.token_sources().items()))
            if self.peak_memory_gb is not None:
                parts.append(f"peak_memory={self.peak_memory_gb:.3f}GB")
        return " ".join(parts)


current_request: contextvars.ContextVar = contextvars.ContextVar("current_request", default=None)
