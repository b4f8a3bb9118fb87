"""Plain generation hands out a request's first token before building its second step
(dflash2_engine.first_tokens_first_step), and otherwise answers what stock mlx-vlm answers.

In process on the tiny pack, through mlx-vlm's BatchGenerator as the servers' worker runs
requests: every response (token, logprob, top logprobs, finish reason) with the swap must
equal stock's, for greedy and sampled requests (the server's position-keyed sampler, and one
drawing from MLX's global key, which keeps stock's step), logits processors, one-token
requests and requests sharing a batch (whose rows join and leave while a first token is out).
"""

import mlx.core as mx
import pytest
from mlx_vlm.generate.ar import BatchGenerator
from mlx_vlm.sample_utils import make_logits_processors, make_sampler
from mlx_vlm.server.generation import _PositionedTargetSampler

import dflash2_audit
import dflash2_engine
from bench_prefix import request_kwargs

SWAPS = {
    "mlx_vlm.generate.ar:GenerationBatch._step": dflash2_engine.first_tokens_first_step,
    "mlx_vlm.generate.ar:GenerationBatch._eval_pending_state": dflash2_engine.first_tokens_first_pending_state,
}
PROMPTS = ["The cat sat on", "Numbers: one two three", "Hello there"]

# On the GPU-like CPU backend a batch's rows round differently with the batch's size, so a
# step built for other rows than stock builds it for gives other bits.
pytestmark = pytest.mark.usefixtures("gpu_like_rounding")


@pytest.fixture
def step(monkeypatch):
    """step(swapped): runs what follows with the engine's swap or with stock's methods."""
    dflash2_engine.use_first_tokens_first()

    def use(swapped):
        for target, swap in SWAPS.items():
            monkeypatch.setattr(*dflash2_audit.resolve(target), swap if swapped else dflash2_audit.stock(target))

    return use


def run(target, prompts, *, max_tokens=6, processors=None, seed=None, prefill_step_size=8, **options):
    """Every generation response in order as (uid, token, logprob, top logprobs, finish), and
    how many one-token forwards were built before the first came back."""
    model, processor, _ = target
    language_model = type(model.language_model)
    forward = language_model.__call__
    built = []

    def counting(self, inputs, *args, **kwargs):
        built.append(inputs.shape[-1] == 1)
        return forward(self, inputs, *args, **kwargs)

    language_model.__call__ = counting
    try:
        if seed is not None:
            mx.random.seed(seed)
        generator = BatchGenerator(model.language_model, processor, prefill_step_size=prefill_step_size, **options)
        # Input ids and embeddings as the server's worker makes them.
        requests = [request_kwargs(model, {"input_ids": mx.array([processor.tokenizer.encode(text)])})
                    for text in prompts]
        ids = [input_ids[0].tolist() for input_ids, _ in requests]
        max_tokens = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(ids)
        generator.insert(ids, max_tokens=max_tokens, prompt_kwargs=[kwargs for _, kwargs in requests],
                         logits_processors=[processors] * len(ids) if processors else None)
        out, before_first, finished = [], None, 0
        while finished < len(ids):
            _, responses = generator.next()
            for r in responses:
                if before_first is None:
                    before_first = sum(built)
                top = [(int(i), float(p)) for i, p in r.top_logprobs] if r.top_logprobs else None
                out.append((r.uid, int(r.token), float(r.token_logprob), top, r.finish_reason))
                finished += r.finish_reason is not None
        generator.close()
        return out, before_first
    finally:
        language_model.__call__ = forward


def server_sampler():
    """The sampler mlx-vlm's server gives a request with a temperature: keyed by position."""
    return _PositionedTargetSampler(temperature=1.0, top_p=1.0, top_k=0, seed=3)


# name -> BatchGenerator options, made fresh for each run (samplers keep state). Greedy as the
# server runs a temperature-0 request (greedy_sampling).
CASES = {
    "greedy with logprobs": lambda: dict(greedy_sampling=True),
    "top logprobs": lambda: dict(greedy_sampling=True, top_logprobs_k=3),
    "top logprobs without logprobs": lambda: dict(greedy_sampling=True, compute_logprobs=False, top_logprobs_k=2),
    "fused greedy": lambda: dict(greedy_sampling=True, compute_logprobs=False),
    "server sampler": lambda: dict(sampler=server_sampler()),
    "global-key sampler": lambda: dict(sampler=make_sampler(temp=0.9, top_p=0.9), seed=3),
    "repetition penalty": lambda: dict(greedy_sampling=True, processors=make_logits_processors(repetition_penalty=1.5)),
    "one token": lambda: dict(greedy_sampling=True, max_tokens=1),
}


@pytest.mark.parametrize("case", CASES)
def test_same_responses_as_stock(target, step, case):
    step(False)
    stock, _ = run(target, PROMPTS[:1], **CASES[case]())
    step(True)
    swapped, _ = run(target, PROMPTS[:1], **CASES[case]())
    assert swapped == stock
    assert len(stock) == CASES[case]().get("max_tokens", 6)


SHARED = {  # name -> BatchGenerator options for requests sharing a batch
    "greedy": lambda: dict(greedy_sampling=True, top_logprobs_k=2),
    "server sampler": lambda: dict(sampler=server_sampler()),
    # A new prompt's first token is sampled between a hand-out and its held step where a
    # prompt needs no prefill step: a global key would be drawn in another order.
    "global-key sampler, no prefill steps": lambda: dict(sampler=make_sampler(temp=1.0), seed=5,
                                                         prefill_step_size=None),
}


@pytest.mark.parametrize("kind", SHARED)
@pytest.mark.parametrize("prefill_batch", [1, 2])
@pytest.mark.parametrize("max_tokens", [[1, 5, 3], [4, 2, 6]])
def test_shared_batch_same_responses_as_stock(target, step, max_tokens, prefill_batch, kind):
    """Requests sharing one running batch: prompts prefilled together (prefill_batch 2) get
    their first tokens out together, and rows join (extend) and leave (filter) while other
    rows' first tokens are out unstepped."""
    options = dict(max_tokens=max_tokens, completion_batch_size=3, prefill_batch_size=prefill_batch)
    step(False)
    stock, _ = run(target, PROMPTS, **options, **SHARED[kind]())
    step(True)
    swapped, _ = run(target, PROMPTS, **options, **SHARED[kind]())
    assert swapped == stock
    assert sorted(uid for uid, *_ in stock) == sorted(uid for uid, n in enumerate(max_tokens) for _ in range(n))


def test_first_token_comes_before_the_second_step(target, step):
    """Stock builds the second decode forward before it hands out the first token; the swap
    hands it out first (the speculative route does so too). The prompt's last token is a
    one-token forward of its own in both."""
    step(False)
    _, stock_built = run(target, PROMPTS[:1], greedy_sampling=True)
    step(True)
    _, swapped_built = run(target, PROMPTS[:1], greedy_sampling=True)
    assert (stock_built, swapped_built) == (2, 1)
