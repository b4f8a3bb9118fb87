"""The exact prefix cache (dflash2_prefix_cache.py), in process on the tiny pack.

Requests run through mlx-vlm's BatchGenerator as the server's worker runs them, on the
plain and the speculative route, with a prefill step of STEP tokens so that every prompt
prefills in several chunks. A conversation's turns run cached (one store for the whole
conversation) and cold (mlx-vlm's own prompt batch, once per module, on the plain route); the
first token's logits must be the same bits and the greedy answers the same tokens.
Everything runs on the GPU-like CPU backend (conftest's gpu_like_rounding), where a chunk's
rounding depends on its rows and on the keys it attends over: a restore at a boundary a
cold prefill does not pass rounds differently, which the negative control shows.
test_prefix_cache_server.py checks the same over HTTP.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.utils import prepare_inputs
from PIL import Image

import dflash2_prefix_cache
from bench_prefix import first_token_logits, request
from dflash2_prefix_cache import PrefixStore, kept_boundaries
from gpu_rounding import swap_row_variant_ops
from parity import differing

STEP = 8
MAX_TOKENS = 3

pytestmark = pytest.mark.usefixtures("gpu_like_rounding")


def image(seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (64, 64, 3), dtype=np.uint8))


TOOL_CALL = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
# name -> turns; each turn is the whole message list a client sends (the history grows).
CONVERSATIONS = {
    "text": [
        [{"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
         {"role": "user", "content": "Ok"}],
    ],
    "thinking": [
        [{"role": "user", "content": "Why?"}],
        [{"role": "user", "content": "Why?"},
         {"role": "assistant", "content": "So.", "reasoning_content": "Hm."},
         {"role": "user", "content": "Ok"}],
    ],
    "tool-call": [
        [{"role": "user", "content": "Weather?"}],
        [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
         {"role": "tool", "content": "sunny"}],
    ],
    "image": [
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}],
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
         {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Ok"}],
    ],
}


def chat_inputs(processor, messages, *, thinking=False, images=None):
    prompt = processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
    return prepare_inputs(processor, images=images, prompts=prompt)


def turn_inputs(processor, name, messages):
    return chat_inputs(processor, messages, thinking=name == "thinking",
                       images=[image()] if name == "image" else None)


@pytest.fixture
def first_logits(target):
    with first_token_logits(target[0]) as seen:
        yield seen


def run(model, processor, inputs, *, store=None, drafter=None, ids=None):
    """One greedy request as the server's worker runs it: (tokens, cached tokens). store
    None: cold. ids: raw prompt ids instead of the processor's inputs."""
    inputs = {"input_ids": mx.array([ids])} if ids is not None else inputs
    return request(model, processor, inputs, step=STEP, store=store, drafter=drafter, max_tokens=MAX_TOKENS)[:2]


@pytest.fixture(scope="module")
def cold_turns(target):
    """Every conversation's turns cold (mlx-vlm's own prompt batch, plain route), once for
    the module: name -> [(answer, first token's logits) per turn]. Both routes' cached turns
    compare against them: exact DFlash answers what plain decoding answers."""
    model, processor, _ = target
    with pytest.MonkeyPatch.context() as patch, first_token_logits(model) as seen:
        swap_row_variant_ops(patch)
        return {name: [(run(model, processor, turn_inputs(processor, name, messages))[0], seen.pop())
                       for messages in turns] for name, turns in CONVERSATIONS.items()}


@pytest.mark.parametrize("route", ["plain", "speculative"])
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_cached_turns_equal_cold_turns(target, cold_turns, first_logits, name, route):
    """One store for the conversation: the first turn misses, its repeat restores the
    stored prompt's last boundary, the next turn an earlier aligned one; each equals cold.
    The first turn's stored arrays keep their bits though later requests restore them and
    update the restored cache in place."""
    model, processor, drafter = target
    drafter = drafter if route == "speculative" else None
    store = PrefixStore(1.0)
    turns = CONVERSATIONS[name]
    for number, turn in enumerate([0, 0, *range(1, len(turns))]):
        inputs = turn_inputs(processor, name, turns[turn])
        answer, cached = run(model, processor, inputs, store=store, drafter=drafter)
        cold_answer, cold_logits = cold_turns[name][turn]
        assert differing(first_logits.pop(), cold_logits) == 0, f"turn {turn}, {cached} cached"
        assert answer == cold_answer, f"turn {turn}, {cached} cached"
        if number == 0:  # nothing stored before
            (entry,) = store.entries.values()
            stored = [np.array(array) for array in entry.arrays()]
        elif number == 1:  # the same prompt again: all but its last token
            assert cached == inputs["input_ids"].shape[1] - 1, cached
        else:  # the history is reused, from a chunk boundary
            assert cached > 0 and cached % STEP == 0, cached
    after = [np.array(array) for array in entry.arrays()]
    assert len(stored) == len(after)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(stored, after))


def test_other_image_same_tokens_is_not_reused(target):
    model, processor, _ = target
    store = PrefixStore(1.0)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look at this picture:"}, {"type": "image"}]}]
    run(model, processor, chat_inputs(processor, messages, images=[image(0)]), store=store)
    _, same = run(model, processor, chat_inputs(processor, messages, images=[image(0)]), store=store)
    _, other = run(model, processor, chat_inputs(processor, messages, images=[image(1)]), store=store)
    prompt = chat_inputs(processor, messages, images=[image(1)])["input_ids"][0].tolist()
    start = prompt.index(target[0].config.image_token_index)
    assert same == len(prompt) - 1  # the same prompt again: all but its last token
    assert 0 < other <= start  # the text before the image only


def test_misaligned_restore_differs_from_cold(target, first_logits, monkeypatch):
    """The negative control: the prompt extends a stored one, whose final boundary (its
    length - 1) is no boundary of the longer prompt's cold prefill. Restoring there (a rule
    that takes any stored boundary within the common prefix) prefills the rest in other
    chunks, here with a one-row chunk where the cold prefill has several rows, and the bits
    change; the cache's own rule restores the last multiple of STEP and matches."""
    model, processor, _ = target
    first = chat_inputs(processor, CONVERSATIONS["text"][0])["input_ids"][0].tolist()
    longer = first + first[:1]  # one token more: cold, its last chunk starts at the last multiple of STEP
    assert (len(first) - 1) % STEP
    run(model, processor, None, ids=longer)
    cold = first_logits.pop()

    def cached_logits(store):
        run(model, processor, None, ids=first, store=store)
        _, cached = run(model, processor, None, ids=longer, store=store)
        return cached, first_logits.pop()

    cached, logits = cached_logits(PrefixStore(1.0))
    assert cached == (len(first) - 1) // STEP * STEP and differing(logits, cold) == 0
    monkeypatch.setattr(dflash2_prefix_cache, "usable", lambda position, common, length, step:
                        0 < position <= min(common, length - 1))
    cached, logits = cached_logits(PrefixStore(1.0))
    assert cached == len(first) - 1 and differing(logits, cold) > 0


def test_kept_boundaries():
    positions = range(8, 8 * 40, 8)
    assert kept_boundaries([*positions, 317], 8) == {8, 16, 32, 64, 128, 256, 304, 312, 317}
    assert kept_boundaries([8, 13], 8) == {8, 13}


def entry(boundaries, step=STEP):
    """An entry without arrays, for the store's bookkeeping."""
    return dflash2_prefix_cache.Entry((("KVCache",), (), step), None, {p: () for p in boundaries}, [None])


def test_an_entry_replaces_its_source_when_it_holds_all_its_aligned_boundaries():
    store = PrefixStore(1.0)
    first, second, third = entry([8, 16, 21]), entry([8, 16, 24, 29]), entry([8, 13])
    store.add(first)
    store.add(second, source=first, restored=16)  # only first's final boundary, 21, is lost
    assert list(store.entries.values()) == [second]
    store.add(third, source=second, restored=8)  # second's 16 and 24 are not in third
    assert list(store.entries.values()) == [second, third]


def test_budget_evicts_least_recently_used(target):
    model, processor, _ = target
    store = PrefixStore(1.0)
    prompts = [[1 + i, 2, 3, 4, 5, 6, 7, 8, 9, 10] for i in range(3)]
    for ids in prompts:
        run(model, processor, None, ids=ids, store=store)
    assert len(store.entries) == 3
    one = store.nbytes() // 3
    store.budget = 2 * one + one // 2  # room for two
    _, cached = run(model, processor, None, ids=prompts[0], store=store)  # used again: most recent
    assert cached == len(prompts[0]) - 1
    run(model, processor, None, ids=[4, 2, 3, 4, 5, 6, 7, 8, 9, 10], store=store)
    assert store.nbytes() <= store.budget and len(store.entries) == 2
    assert [run(model, processor, None, ids=ids, store=store)[1] for ids in prompts[:2]] == [9, 0]


def test_drafter_memory_counts_its_own_weights_not_the_targets(target, tiny_pack):
    """bench_prefix's spec_extra_memory: a bound drafter's parameters() include the target's
    embedding and head; its own weights are what its files hold."""
    from mlx.utils import tree_flatten

    from bench_prefix import drafter_own_bytes

    model, _, drafter = target
    drafter.reset(model)
    files = sum(value.nbytes for path in sorted(tiny_pack["drafter"].glob("*.safetensors"))
                for value in mx.load(str(path)).values())
    bound = sum(value.nbytes for _, value in tree_flatten(drafter.parameters()))
    assert drafter_own_bytes(drafter, model) == files < bound


def test_memory_runs_leave_the_drafters_attention_as_loaded(target):
    """bench_prefix measures memory with the drafter's sliding window, then times requests:
    the window option must not outlive the memory runs."""
    import dflash2_drafter
    from bench_prefix import attention_layout_kept

    _, _, drafter = target

    def state():
        return (list(drafter.config.layer_types), [layer.self_attn.is_sliding for layer in drafter.layers],
                getattr(drafter.config, "runtime_block_size", None))

    before = state()
    windowed = dflash2_drafter.RuntimeOptions(dflash2_drafter.block_limits(drafter.config.block_size, block_cap=2),
                                              sliding_window=True)
    assert drafter.config.sliding_window  # the synthetic drafters have one
    with attention_layout_kept(drafter) as restore:
        dflash2_drafter.configure_drafter(drafter, windowed)
        assert all(layer.self_attn.is_sliding for layer in drafter.layers)
        assert drafter.config.runtime_block_size == 2
        restore()  # the whole-context requests between windowed ones
        assert state() == before
        dflash2_drafter.configure_drafter(drafter, windowed)
    assert state() == before


def test_drafter_cache_grows_with_context_and_the_window_bounds_it(float32_target, monkeypatch):
    """bench_prefix's deterministic memory figure: the drafter's cache after a request holds
    its whole context, unless the sliding window caps it. The tiny drafter's window (256) cut
    to 64, so that the contexts past it are short: the whole cache grows 256 positions at a
    time, so the longer context passes 256."""
    from bench_prefix import spec_extra_memory

    model, processor, drafter = float32_target
    window = 64
    monkeypatch.setattr(drafter.config, "sliding_window", window)
    contexts = [window + 44, 300]
    *_, cache_gb = spec_extra_memory(model, processor, drafter, contexts, STEP * 8, repeats=1)
    short, long = (cache_gb[str(context)] for context in contexts)
    assert long["full"] > short["full"] > 0
    assert long["sliding_window"] == short["sliding_window"] < short["full"]


@pytest.fixture
def sliding_drafter(target, monkeypatch):
    """The tiny drafter with its sliding window and a cost table under which rounds pay (so
    RequestDecoder runs them, as in the servers); restored as loaded afterwards. Yields
    (drafter, per request: the hidden states its round loop started from, the positions the
    target had processed, and the drafter's cache offsets right after its first draft)."""
    import dflash2_drafter
    import dflash2_kernels
    import dflash2_policy
    import dflash2_rounds
    from bench_prefix import attention_layout_kept
    from parity import served_rounds

    _, _, drafter = target
    blocks = range(2, dflash2_kernels.MAX_ROWS + 1)
    costs = dflash2_policy.RoundCosts(60.0, {b: 0.5 for b in blocks}, {b: 0.1 for b in blocks})
    seen, start, draft = [], dflash2_rounds.RequestDecoder.__init__, dflash2_rounds.RequestDecoder.draft

    def recording_start(self, model, draft_model, prompt_cache, hidden, *args):
        seen.append({"hidden": hidden, "processed": dflash2_rounds.processed_tokens(prompt_cache)})
        start(self, model, draft_model, prompt_cache, hidden, *args)

    def recording_draft(self, block, hidden):
        tokens = draft(self, block, hidden)
        seen[-1].setdefault("offsets", [layer.offset for layer in self.draft_cache])
        return tokens

    monkeypatch.setattr(dflash2_rounds.RequestDecoder, "__init__", recording_start)
    monkeypatch.setattr(dflash2_rounds.RequestDecoder, "draft", recording_draft)
    with attention_layout_kept(drafter), served_rounds(drafter, costs):
        dflash2_drafter.configure_drafter(drafter, dflash2_drafter.RuntimeOptions(sliding_window=True))
        yield drafter, seen


def test_a_sliding_drafter_s_prompt_keeps_only_the_taps_it_reads(target, sliding_drafter):
    """Past the window, the servers' prefill keeps the last chunks of taps that hold the
    drafter's window, not the whole prompt's (mlx-vlm's own prompt batch keeps them all);
    either way the drafter's first draft leaves its cache at the prompt's length (its
    positions), and the tokens are plain decoding's."""
    from bench_prefix import turns

    model, processor, _ = target
    drafter, seen = sliding_drafter
    window, step = drafter.config.sliding_window - 1, STEP * 8
    prompt = turns(2 * window + 88, 1, 150, seed=1)[0]
    inputs = {"input_ids": mx.array([prompt])}
    plain = request(model, processor, inputs, step=step, max_tokens=12)[0]
    for served in (True, False):
        tokens = request(model, processor, inputs, step=step, drafter=drafter, max_tokens=12,
                         served_prefill=served)[0]
        assert tokens == plain
    servers, stock = seen
    assert window <= servers["hidden"].shape[1] <= window + step and stock["hidden"].shape[1] == len(prompt)
    for request_seen in seen:
        assert request_seen["processed"] == len(prompt)
        assert request_seen["offsets"] == [len(prompt)] * len(drafter.layers)
    assert differing(servers["hidden"][:, -window:], stock["hidden"][:, -window:]) == 0


# Past 2 windows: at 70 a window's taps before the restored boundary reach back past the
# last aligned boundary only (keeping the window's alone, the restore misses); at 90 the
# stored taps hold a row more than a restore keeps (it must drop the first, not the last).
@pytest.mark.parametrize("past", [70, 90])
def test_a_sliding_drafter_s_turns_restore_exactly_from_the_taps_kept(target, first_logits, sliding_drafter, past):
    """A conversation past the window on the speculative route with the drafter's window:
    the stored entry holds only the taps from where the kept chunks start, the next turn
    restores from it at the boundary it would without the window (the taps before the last
    aligned boundaries stay), with the window's taps, the first token's logits and the
    drafter's positions those of a cold prefill and plain decoding's answer; a whole-context
    drafter cannot restore from it (its taps are gone)."""
    from bench_prefix import GENERATION_PROMPT, turns

    model, processor, _ = target
    drafter, seen = sliding_drafter
    window, step = drafter.config.sliding_window - 1, STEP * 8
    first, second = turns(2 * window + past, 40, 150, seed=2)
    cold = request(model, processor, {"input_ids": mx.array([second])}, step=step, max_tokens=6)[0]
    cold_logits = first_logits.pop()
    request(model, processor, {"input_ids": mx.array([second])}, step=step, drafter=drafter, served_prefill=True)
    cold_spec = seen[-1]
    store = PrefixStore(1.0)
    request(model, processor, {"input_ids": mx.array([first])}, step=step, store=store, drafter=drafter)
    (entry,) = store.entries.values()
    assert entry.taps_start > 0 and entry.taps[0].shape[1] == len(first) - 1 - entry.taps_start
    assert entry.boundaries and all(entry.covers(position, window) for position in entry.boundaries)
    first_logits.clear()
    tokens, cached = request(model, processor, {"input_ids": mx.array([second])}, step=step, store=store,
                             drafter=drafter, max_tokens=6)[:2]
    assert cached == (len(first) - GENERATION_PROMPT) // step * step and tokens == cold
    assert differing(first_logits.pop(), cold_logits) == 0
    restored = seen[-1]
    assert window <= restored["hidden"].shape[1] <= window + (dflash2_prefix_cache.RECENT_BOUNDARIES + 1) * step
    assert differing(restored["hidden"][:, -window:], cold_spec["hidden"][:, -window:]) == 0
    assert restored["offsets"] == cold_spec["offsets"] == [len(second)] * len(drafter.layers)
    assert store.lookup(entry.layout, entry.key, len(first), window=None) == (None, 0)
