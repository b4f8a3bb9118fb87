"""mlx-vlm's response generator for the pack: one sequence at a time, each request admitted
on its route with its record, its tokens counted and ended at its stop sequences.

Imported by dflash2_engine.start_engine once the environment is checked (it imports mlx-vlm).
"""

import dataclasses
import logging
import threading
from typing import Optional

import mlx.core as mx
from mlx_vlm.server.generation import GenerationArguments, GenerationContext, ResponseGenerator

import dflash2_rounds
from dflash2_record import RequestRecord, current_request
from dflash2_speculation import DrafterSetup, Speculation, load_speculation

logger = logging.getLogger("dflash2.server")


class RecordingTokens:
    """mlx-vlm's token iterator for one request: notes counts and draft statistics on the
    request record, ends the text at the request's stop sequences, and ends early when
    the record is cancelled.

    Stop sequences are matched on the detokenized text, which is the same on every route
    because the tokens are; text that could be the start of a stop sequence is held back
    until the next token decides it.
    """

    def __init__(self, tokens, record):
        self._tokens = tokens
        self._record = record
        self._held = ""
        self._ended = False

    def __iter__(self):
        return self

    def __next__(self):
        record = self._record
        if self._ended or (record is not None and record.cancelled):
            self.close()
            raise StopIteration
        token = next(self._tokens)
        if record is None:
            return token
        record.note_token(token)
        return self.apply_stop(token, record.stop, record) if record.stop else token

    def apply_stop(self, token, stops, record=None):
        text = self._held + token.text
        found = [(index, stop) for index, stop in ((text.find(stop), stop) for stop in stops) if index >= 0]
        if found:
            self._ended = True
            self.close()  # the rest is never generated
            index, stop = min(found, key=lambda item: item[0])
            if record is not None:  # Messages answers name it (dflash2_gateway.with_stop_reason)
                record.stop_sequence = stop
            return dataclasses.replace(token, text=text[:index], finish_reason="stop")
        held = 0 if token.finish_reason else max(
            (n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
        self._held = text[len(text) - held:] if held else ""
        return dataclasses.replace(token, text=text[:len(text) - held])

    def close(self):
        self._tokens.close()


@dataclasses.dataclass
class RoutedArguments(GenerationArguments):
    """mlx-vlm's arguments of one request, with the record its gateway made for it: it
    travels with them through mlx-vlm's queue to the worker's admission."""

    record: RequestRecord = None

    @classmethod
    def carrying(cls, args, record):
        """A copy of `args` (their own values, as dataclasses.replace copies) with `record`."""
        fields = dataclasses.fields(GenerationArguments)
        return cls(**{field.name: getattr(args, field.name) for field in fields}, record=record)

class PackGenerator(ResponseGenerator):
    """mlx-vlm's ResponseGenerator for the pack: target and drafter loaded on its worker, one
    sequence at a time, each request admitted on the route its record carries."""

    speculation = Speculation()  # no drafter: every request plain

    def __init__(self, drafter: Optional[DrafterSetup], *args, **kwargs):
        self.drafter = drafter  # before mlx-vlm's __init__ starts the worker that loads it
        self.admitted = None  # the record of the request the worker serves now
        self.speculative_route = dflash2_rounds.SpeculativeRoute()
        super().__init__(*args, **kwargs)
        # Reentrant: _cpu_preprocess takes it too, for count_tokens, which calls it directly.
        self._tokenizer_lock = threading.RLock()

    def _initialize_model(self):
        super()._initialize_model()  # the target, through mlx-vlm's own loader
        if self.drafter is not None:
            self.speculation = load_speculation(self.model, self.drafter, counts_to=self.note_round_counts)
            self.draft_kind = self.speculation.kind  # the worker picks the round loop by it

    def rounds_can_pay(self, kind: str = "greedy") -> bool:
        """Whether a request of this acceptance kind (greedy or sampled) goes speculative
        (dflash2_rounds.SpeculativeRoute)."""
        return self.speculative_route(self.speculation.state, kind)

    def note_round_counts(self, counts):
        """The round loop's counts of the request it serves (DrafterState.counts_to)."""
        if self.admitted is not None:
            self.admitted.note_round_counts(counts)

    def _make_sampler(self, args):
        # Every temperature the pack accepts draws by position, min_p included.
        from dflash2_sampling import PositionSampler

        if args.temperature == 0 or args.top_n_sigma > 0 or args.p_less or args.typical_p < 1.0:
            return super()._make_sampler(args)
        return PositionSampler(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                               min_p=args.min_p, seed=args.seed)

    def serve_plain(self, reason: str):
        """Every later request is served plain, with this reason."""
        self.speculation = Speculation(reason=reason, round_costs=self.speculation.round_costs,
                                       runtime=self.speculation.runtime)

    def generate(self, prompt, images=None, audio=None, args=None, **kwargs):
        record = current_request.get()  # the gateway's, on this thread's context
        if record is not None and args is not None:  # its route travels with its arguments
            args = RoutedArguments.carrying(args, record)
        ctx, tokens = super().generate(prompt, images, audio, args, **kwargs)
        tokens = RecordingTokens(tokens, record)
        if record is not None:
            record.prompt_tokens = ctx.prompt_tokens
            record.log_arrival()  # after mlx-vlm's own checks (the context budget among them)
            record.token_stream = tokens
            if record.cancelled:  # while it waited for its turn
                tokens.close()
        return ctx, tokens

    def _cpu_preprocess(self, *args, **kwargs):
        # Messages' count_tokens tokenizes here without the lock generate() holds.
        with self._tokenizer_lock:
            return super()._cpu_preprocess(*args, **kwargs)

    def validate_context_budget(self, *args, **kwargs):
        # mlx-vlm's check before a stream opens tokenizes without the lock generate()
        # holds around the shared tokenizer.
        with self._tokenizer_lock:
            return super().validate_context_budget(*args, **kwargs)

    def _collect_pending_requests(self, *, active, capacity=None, **kwargs):
        # Single sequence: admit the next request only when the running one has
        # finished. The worker then builds a fresh BatchGenerator for it with
        # self.draft_model, which is how each request gets its own route.
        pending, should_stop = super()._collect_pending_requests(
            active=active, capacity=0 if active else 1, **kwargs)
        if pending:
            args = pending[0].args
            record = args.record if isinstance(args, RoutedArguments) else None
            if record is not None and record.cancelled:
                # Its client left, or its time ran out, while it waited for its turn: its
                # generate() gets an empty token stream instead of a prefill nobody reads.
                logger.info("request %d not started: cancelled (%s) while it waited", record.id,
                            record.cancelled)
                pending[0].rqueue.put(GenerationContext(uid=-1, prompt_tokens=pending[0].prompt_tokens))
                pending[0].rqueue.put(None)
                return [], should_stop
            speculative = record is not None and record.speculative and self.speculation.state is not None
            self.draft_model = self.speculation.state.drafter if speculative else None
            self.admitted = record  # the round loop hands it its token counts (note_round_counts)
            mx.reset_peak_memory()  # so each finish line reports its own request's peak
        return pending, should_stop
