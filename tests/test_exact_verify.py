"""The exact speculative path on the tiny synthetic pack.

Greedy speculative tokens equal plain decoding; verify logits and captured hidden
states equal single-token decode bit for bit; rollback at every accepted count
leaves the cache a never-speculated run would have; a changed mlx-vlm function
refuses the install and is named. The same checks run on a GPU through
tools/parity.py.

Every test here runs on the GPU-like CPU backend (conftest's gpu_like_rounding): on
plain CPU, batched ops equal their one-row calls, so stock verify would pass these
checks too. Under it stock verify fails them (the negative control below), so they
can fail.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

import dflash2_audit
import dflash2_runtime
from oracle_drafter import OracleDrafter
from parity import (
    PROMPTS,
    chat_ids,
    fixture_cases,
    greedy,
    image_inputs,
    oracle_token_case,
    rollback_cases,
    verify_cases,
)

REPO = Path(__file__).resolve().parents[1]
GENERATED = 12
# The pack's random drafter accepts nothing, so each token after the first costs a full
# round: five rounds a fixture.
FIXTURE_TOKENS = 6

pytestmark = pytest.mark.usefixtures("gpu_like_rounding")


def raw_ids(processor, text):
    """A short prompt without the chat template: the bitwise checks prefill it often."""
    return mx.array([processor.tokenizer.encode(text, add_special_tokens=False)])


def test_speculative_tokens_equal_plain_with_oracle_drafter(target):
    model, processor, _ = target
    # Every block size at partial acceptance, full and zero acceptance at the ends; the
    # prompts rotate, raw (the chat templates run in the fixture test below; the full
    # matrix runs on the GPU: tools/parity.py).
    prompts = [raw_ids(processor, text) for text in PROMPTS]
    plain = [greedy(model, ids, GENERATED) for ids in prompts]
    cases = [
        oracle_token_case(model, prompts[block % len(PROMPTS)], plain[block % len(PROMPTS)], block, error_rate,
                          GENERATED)
        for block in range(2, 9)
        for error_rate in ((0.0, 0.35, 1.0) if block in (2, 8) else (0.35,))
    ]
    assert [c for c in cases if not c["identical"]] == []
    # The oracle really exercised full, partial and zero acceptance.
    assert all(c["accepted"] == 0 for c in cases if c["error_rate"] == 1.0)
    assert all(c["accepted"] > 0 for c in cases if c["error_rate"] == 0.0)
    partial = [c for c in cases if c["error_rate"] == 0.35]
    assert any(0 < c["accepted"] < c["rounds"] * (c["block"] - 1) for c in partial)


def test_fixtures_with_the_packs_drafter_equal_plain(target):
    """Text, thinking, tool-call and image prompts with the synthetic DFlash2 drafter."""
    model, processor, drafter = target
    cases = fixture_cases(model, processor, drafter, FIXTURE_TOKENS)
    assert [c["fixture"] for c in cases] == ["text", "thinking", "tool-call", "image"]
    assert [c for c in cases if not c["identical"]] == []
    assert all(c["rounds"] > 0 for c in cases), "the drafter ran no round"


def test_image_prompt_with_partial_acceptance_equals_plain(target):
    model, processor, _ = target
    ids, image = image_inputs(processor)
    plain = greedy(model, ids, GENERATED, **image)
    vocab = model.language_model.lm_head.weight.shape[0]
    drafter = OracleDrafter(plain, vocab_size=vocab, error_rate=0.35, block_size=5)
    assert greedy(model, ids, GENERATED, drafter=drafter, block_size=5, **image) == plain
    assert sum(drafter.accept_lens) > 0


def test_verify_logits_and_hidden_equal_sequential_decode(target):
    model, processor, drafter = target
    lm = model.language_model
    ids = raw_ids(processor, PROMPTS[0])
    cases = verify_cases(lm, ids, drafter.config.target_layer_ids, greedy(model, ids, 8))
    assert [c["length"] for c in cases] == list(range(2, 9))
    assert [c for c in cases if c["logits"] or c["hidden"]] == []


def test_rollback_at_every_accepted_count_equals_never_speculated_cache(target):
    model, processor, drafter = target
    lm = model.language_model
    ids = raw_ids(processor, PROMPTS[1])
    taps = drafter.config.target_layer_ids
    cases = rollback_cases(lm, ids, taps, greedy(model, ids, 8), lengths=(2, 8))
    assert len(cases) == 2 + 8
    assert [c for c in cases if c["logits"]] == []


@pytest.fixture
def stock_verify(monkeypatch):
    """The runtime's replacements put back for one test: stock mlx-vlm, as if not installed."""
    for target in dflash2_runtime.REPLACEMENTS:
        monkeypatch.setattr(*dflash2_audit.resolve(target), dflash2_audit.stock(target))


def test_stock_verify_fails_the_same_checks(target, stock_verify):
    """The negative control: the checks above see stock verify's batched rounding."""
    model, processor, drafter = target
    lm, taps = model.language_model, drafter.config.target_layer_ids
    ids = raw_ids(processor, PROMPTS[0])
    plain = greedy(model, ids, GENERATED)
    verify = verify_cases(lm, ids, taps, plain[:8], lengths=(2, 8))
    assert all(c["logits"] and c["hidden"] for c in verify), verify
    rollback = rollback_cases(lm, ids, taps, plain[:8], lengths=(2,))
    assert all(c["logits"] for c in rollback), rollback
    tokens = oracle_token_case(model, ids, plain, 8, 0.0, GENERATED)
    assert not tokens["identical"], tokens


def test_changed_mlx_vlm_function_refuses_and_is_named():
    script = textwrap.dedent(
        """
        import mlx_vlm.speculative.dflash as rounds
        def _dflash_verify_greedy(*args):  # as if mlx-vlm had changed it
            return None
        rounds._dflash_verify_greedy = _dflash_verify_greedy
        import dflash2_audit, dflash2_runtime
        try:
            dflash2_runtime.apply_patches()
        except dflash2_audit.SourceMismatch as error:
            print(error)
            raise SystemExit(3)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 3, result.stderr
    assert "refusing to start" in result.stdout
    assert "mlx_vlm.speculative.dflash:_dflash_verify_greedy" in result.stdout


def test_patch_table_matches_installed_mlx_vlm():
    assert dflash2_audit.mismatches() == []


def test_fp32_dense_layout_verify_and_rollback_are_exact(float32_pack):
    """Packs whose unpacked tensors are fp32 run fp32 activations through verify."""
    from dflash2_pack import load_pack

    model, processor, drafter = load_pack(float32_pack["target"], float32_pack["drafter"])
    assert dflash2_runtime.install().speculative  # the checks below are the model's self-check
    lm, taps = model.language_model, drafter.config.target_layer_ids
    ids = raw_ids(processor, PROMPTS[2])
    continuation = greedy(model, ids, 8)
    assert lm.model.embed_tokens(ids).dtype != lm.model.norm.weight.dtype  # fp16 in, fp32 stream
    cases = verify_cases(lm, ids, taps, continuation, lengths=(2, 8))
    cases += rollback_cases(lm, ids, taps, continuation, lengths=(8,))
    assert [c for c in cases if c["logits"] or c.get("hidden")] == []


def test_sliding_window_drafter_has_bounded_caches_and_plain_tokens(target, tiny_pack):
    from mlx_vlm.models.cache import RotatingKVCache
    from mlx_vlm.speculative.drafters import load_drafter

    model, processor, _ = target
    drafter, _ = load_drafter(tiny_pack["drafter"])  # its own copy: the option changes it
    drafter.config.sliding_window = 8  # shorter than the prompt, so the window trims
    dflash2_runtime.configure_drafter(
        drafter, dflash2_runtime.RuntimeOptions(sliding_window=True)
    )
    caches = drafter.make_cache()
    assert all(isinstance(c, RotatingKVCache) and c.max_size == 7 for c in caches)
    ids = chat_ids(processor.tokenizer, PROMPTS[0], thinking=False)
    assert ids.shape[1] > 8
    assert greedy(model, ids, GENERATED, drafter=drafter) == greedy(model, ids, GENERATED)
    assert drafter.accept_lens
