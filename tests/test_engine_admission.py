"""The engine's worker admits each queued request with the record its gateway made for it
(dflash2_generator.PackGenerator): the record travels with the request's arguments."""

import threading
import time

import pytest

from acceptance import PAIR


@pytest.fixture(scope="module")
def engine():
    """The trained tiny pair's target in the engine, without its drafter (every request plain)."""
    from dflash2_engine import start_engine

    generator, _ = start_engine(PAIR / "target", "tiny-pair", 4096)
    yield generator
    generator.stop_and_join()


def wait_for(condition, seconds=60.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_two_requests_queued_at_once_reach_admission_each_with_its_own_record(engine, monkeypatch):
    """Two requests queued while the worker is held, with one GenerationArguments object
    between them (a caller may reuse one): the first runs to its max_tokens; the second,
    cancelled while it waited for its turn, is admitted as its own record says: not started."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.server.generation import GenerationArguments, ResponseGenerator

    from dflash2_record import RequestRecord, current_request

    held, collect = threading.Event(), ResponseGenerator._collect_pending_requests

    def held_collect(self, **kwargs):
        held.wait()
        return collect(self, **kwargs)

    monkeypatch.setattr(ResponseGenerator, "_collect_pending_requests", held_collect)
    time.sleep(0.5)  # a collect already under way (it waits 0.1 s for a request) ends first
    prompt = apply_chat_template(engine.processor, engine.config, [{"role": "user", "content": "Hello"}])
    shared = GenerationArguments(max_tokens=3, temperature=0.0)
    records = [RequestRecord(number, "POST", "/v1/chat/completions", announced=True) for number in (1, 2)]
    answers = {}

    def ask(record):
        current_request.set(record)  # as the gateway does for its request (this thread's context)
        _, tokens = engine.generate(prompt, args=shared)
        answers[record.id] = [token.token for token in tokens]

    threads = [threading.Thread(target=ask, args=(record,)) for record in records]
    try:
        for count, thread in enumerate(threads, 1):
            thread.start()
            wait_for(lambda: engine.requests.qsize() == count)
        records[1].cancel("timeout")  # while it waits for its turn
    finally:
        held.set()
        for thread in threads:
            thread.join(timeout=120)
    assert len(answers[1]) == 3 and records[0].tokens == 3 and not records[0].cancelled
    assert answers[2] == [] and records[1].tokens == 0
