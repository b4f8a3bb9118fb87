"""The exact verify round on the tiny synthetic pack.

Verify logits and captured hidden states equal single-token decode bit for bit;
rollback at every accepted count leaves the cache a never-speculated run would have;
a changed mlx-vlm function refuses the install and is named. Greedy tokens:
test_exact_tokens.py. The same checks run on a GPU through tools/parity.py.

Every test here runs on the GPU-like CPU backend (conftest's gpu_like_rounding): on
plain CPU, batched ops equal their one-row calls, so stock verify would pass these
checks too. Under it stock verify fails them and gives other greedy tokens (the
negative control below), so they can fail.
"""

import copy
import dataclasses
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_vlm.models.qwen3_5 import language as qwen3_5_language
from mlx_vlm.speculative import dflash as dflash_rounds
from mlx_vlm.speculative.cache_state import abort_speculative_round

import dflash2_audit
import dflash2_decode_arms
import dflash2_kernel_base
import dflash2_kernel_fused
import dflash2_kernel_gdn
import dflash2_kernel_rope
import dflash2_kernels
import dflash2_runtime
import dflash2_verify
from conftest import GENERATED, raw_ids
from parity import (PROMPTS, differing, greedy, oracle_token_case, prefill_route_cases, rollback_cases,
                    served_prefill_logits, stock_mlx_vlm, verify_cases)

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("gpu_like_rounding")


# The pack's drafter taps both of the tiny target's layers; the 27B's taps 5 of 64, so the
# check also runs with a layer left untapped.
@pytest.mark.parametrize("taps", [None, [0], [1]], ids=["the drafter's", "layer 0", "layer 1"])
def test_verify_logits_and_hidden_equal_sequential_decode(target, raw_plain, taps):
    model, processor, drafter = target
    lm = model.language_model
    ids = raw_ids(processor, PROMPTS[0])
    cases = verify_cases(lm, ids, taps or drafter.config.target_layer_ids, raw_plain[0][:8])
    assert [c["length"] for c in cases] == list(range(2, 9))
    assert [c for c in cases if c["logits"] or c["hidden"]] == []


def test_both_routes_prefill_to_the_same_first_token_logits(target):
    """tools/parity.py's prefill-routes check: the speculative route's prefill
    (capture_layer_ids: mlx-vlm's batch path) gives the plain route's first-token logits bit
    for bit, at contexts of one to eight chunks; and the check sees other chunks (which round
    differently) as differing."""
    from make_synthetic_pack import synthetic_prompt

    model, _, drafter = target
    cases = prefill_route_cases(model, list(drafter.config.target_layer_ids), (5, 12, 30), step=4)
    assert [(c["context"], c["logits"]) for c in cases] == [(5, 0), (12, 0), (30, 0)]
    ids = mx.array([synthetic_prompt(30)])
    assert differing(served_prefill_logits(model, ids, 4), served_prefill_logits(model, ids, 6)) > 0


def test_every_decode_arm_gives_plain_decoding_s_tokens(target, raw_plain):
    """Plain greedy decoding under each of DECODE_ARMS (on CPU each replacement makes its
    stock calls, so this holds the plumbing: which window, which rows, which weights)."""
    model, processor, _ = target
    ids = raw_ids(processor, PROMPTS[0])
    try:
        for arm in dflash2_decode_arms.DECODE_ARMS:
            dflash2_decode_arms.use_decode_arm(arm)
            assert greedy(model, ids, GENERATED) == raw_plain[0], arm
    finally:
        dflash2_decode_arms.use_decode_arm("mlx")


def test_every_decode_arm_answers_the_servers_batches_as_stock(target, monkeypatch):
    """Through mlx-vlm's BatchGenerator, as the servers' worker runs requests (batch caches,
    their padding and length metadata): one request, and three sharing a batch whose rows
    join and leave, answer under every arm as under stock's, and the lone request's steps
    take the arm's one-row GatedDeltaNet layer, its rotary kernel call and its residual add
    and norm kernel call, and under the matmul arms the exact matmul kernels; compiled, each
    layer's step is traced once and replayed after."""
    from test_first_token import PROMPTS as BATCH_PROMPTS, run

    one_row_layers, rotary_calls, norm_calls = [], [], []
    core, rope_rows = dflash2_verify.gated_delta_core, dflash2_kernels.rope_rows
    add_rms_norm = dflash2_kernels.add_rms_norm

    def counted(layer, inputs, *args):  # a compiled step's is built at its trace alone
        one_row_layers.append(inputs.shape[:2])
        return core(layer, inputs, *args)

    def counted_rope(q, k, cos, sin, variant=None):
        rotary_calls.append(dflash2_kernel_rope.rope_kernel_supports(q, k, cos, sin))
        return rope_rows(q, k, cos, sin, variant)

    monkeypatch.setattr(dflash2_verify, "gated_delta_core", counted)
    def counted_norm(x, residual, weight, eps, variant=None):
        norm_calls.append(dflash2_kernel_fused.norm_kernel_supports(x, weight, residual))
        return add_rms_norm(x, residual, weight, eps, variant)

    monkeypatch.setattr(dflash2_kernels, "rope_rows", counted_rope)
    monkeypatch.setattr(dflash2_kernels, "add_rms_norm", counted_norm)
    exact_calls = []
    for name in ("exact_linear_rows", "exact_linear_group"):
        kernel = getattr(dflash2_kernels, name)
        monkeypatch.setattr(dflash2_kernels, name,
                            lambda *args, kernel=kernel, **kwargs: exact_calls.append(1) or kernel(*args, **kwargs))
    alone = dict(greedy_sampling=True, top_logprobs_k=2)
    shared = dict(greedy_sampling=True, max_tokens=[4, 2, 6], completion_batch_size=3, prefill_batch_size=1)
    stock = run(target, BATCH_PROMPTS[:1], **alone)[0], run(target, BATCH_PROMPTS, **shared)[0]
    assert one_row_layers == []
    try:
        for arm in dflash2_decode_arms.DECODE_ARMS:
            dflash2_decode_arms.use_decode_arm(arm)
            one_row_layers.clear()
            rotary_calls.clear()
            norm_calls.clear()
            exact_calls.clear()
            assert run(target, BATCH_PROMPTS[:1], **alone)[0] == stock[0], arm
            assert bool(exact_calls) == ("matmul" in dflash2_decode_arms.DECODE_ARMS[arm]), arm
            took_layer = "convolution" in dflash2_decode_arms.DECODE_ARMS[arm]
            assert bool(one_row_layers) == took_layer and set(one_row_layers) <= {(1, 1)}, arm
            if took_layer:  # built once per layer where compiled, at every step where not
                linear_layers = sum(layer.is_linear for layer in target[0].language_model.model.layers)
                compiled = "compiled" in dflash2_decode_arms.DECODE_ARMS[arm]
                assert (len(one_row_layers) == linear_layers) == compiled, arm
            assert rotary_calls == [True] * len(rotary_calls) and bool(rotary_calls) == (
                "rope" in dflash2_decode_arms.DECODE_ARMS[arm]), arm
            assert norm_calls == [True] * len(norm_calls) and bool(norm_calls) == (
                "residual" in dflash2_decode_arms.DECODE_ARMS[arm]), arm
            assert run(target, BATCH_PROMPTS, **shared)[0] == stock[1], arm
    finally:
        dflash2_decode_arms.use_decode_arm("mlx")


def test_the_convolution_arms_take_fp32_rows_one_row_layer_too(float32_target, monkeypatch):
    """fp32 rows (the real file's layout): under every arm with the convolution, plain greedy
    decoding's GatedDeltaNet steps run the one-row layer (gated_delta_positions: the gates,
    norms and gate projections in fewer launches; the convolution decode's own nn.Conv1d),
    fp32 at (1, 1), and give stock's tokens; the others keep the stock layer."""
    model, processor, _ = float32_target
    ids = raw_ids(processor, PROMPTS[0])
    stock = greedy(model, ids, GENERATED)
    rows, core = [], dflash2_verify.gated_delta_core

    def counted(layer, inputs, *args):
        rows.append((inputs.shape[:2], inputs.dtype))
        return core(layer, inputs, *args)

    monkeypatch.setattr(dflash2_verify, "gated_delta_core", counted)
    try:
        for arm, parts in dflash2_decode_arms.DECODE_ARMS.items():
            dflash2_decode_arms.use_decode_arm(arm)
            rows.clear()
            assert greedy(model, ids, GENERATED) == stock, arm
            assert set(rows) == ({((1, 1), mx.float32)} if "convolution" in parts else set()), arm
    finally:
        dflash2_decode_arms.use_decode_arm("mlx")


def test_norms_with_the_scales_as_weights_equal_mlx_vlm_s_normalize_qk(target):
    """gated_delta_positions' q and k norms (each scale the norm's weight: two launches, not
    four) against the layer's own _normalize_qk, as bits, fp16 and fp32 activations of every
    kind, at one position and eight (a copy of the rows, as the convolution's split makes)."""
    layer = next(layer.linear_attn for layer in target[0].language_model.model.layers if layer.is_linear)
    for dtype in (mx.float16, mx.float32):
        for kind in dflash2_kernel_base.INPUT_KINDS:
            for rows in (1, 8):
                x = dflash2_kernel_base.make_inputs(kind, rows, 2 * layer.key_dim, mx.random.key(rows))
                x = x.astype(dtype).reshape(1, rows, 2, layer.num_k_heads, layer.head_k_dim)
                q, k = x[:, :, 0], x[:, :, 1]
                for got, want in zip(dflash2_verify._normalize_qk(q, k), layer._normalize_qk(q, k)):
                    assert got.dtype == want.dtype and mx.array_equal(
                        dflash2_kernels.raw_bits(got), dflash2_kernels.raw_bits(want)).item(), (dtype, kind, rows)


def last_output_a_bit_off(function):
    """function with the last bit of each element of its (last) output flipped."""
    def flipped(out):
        bits = dflash2_kernels.raw_bits(out)
        return (bits ^ mx.array(1, bits.dtype)).view(out.dtype)

    def wrapped(*args):
        out = function(*args)
        return (*out[:-1], flipped(out[-1])) if isinstance(out, tuple) else flipped(out)
    return wrapped


def test_a_decode_arm_whose_step_differs_from_stock_is_found(target, monkeypatch):
    """decode_arm_differences, which choose_decode_path runs before timing the arms (an arm
    that differs is never chosen): every arm's step is stock's bits here, and the arms whose
    kernel rounds differently (the convolution's, the gated norm's, the gates' or the
    residual norm's, one bit off) are named."""
    lm = target[0].language_model
    arms = [arm for arm in dflash2_decode_arms.DECODE_ARMS if arm != "mlx"]
    assert dflash2_decode_arms.decode_arm_differences(lm, arms) == {arm: 0 for arm in arms}
    for name, feature in (("conv_rows", "convolution"), ("gated_rms_norm", "convolution"),
                          ("gdn_gates", "convolution"), ("add_rms_norm", "residual")):
        with monkeypatch.context() as patch:
            patch.setattr(dflash2_kernels, name, last_output_a_bit_off(getattr(dflash2_kernels, name)))
            differing = dflash2_decode_arms.decode_arm_differences(lm, arms)
        taking = [arm for arm in arms if feature in dflash2_decode_arms.DECODE_ARMS[arm]]
        assert taking and all(differing.pop(arm) > 0 for arm in taking), name
        assert differing == {arm: 0 for arm in arms if arm not in taking}, name
    assert dflash2_decode_arms._decode_path == dflash2_decode_arms.DECODE_ARMS["mlx"]  # the served arm kept

    def rope_rows_unbuilt(*args, **kwargs):
        raise RuntimeError("the kernel did not build")

    monkeypatch.setattr(dflash2_kernels, "rope_rows", rope_rows_unbuilt)
    differing = dflash2_decode_arms.decode_arm_differences(lm, ["rotation+recurrence+convolution+rope"])
    assert differing == {"rotation+recurrence+convolution+rope": "raised RuntimeError: the kernel did not build"}


def test_a_decode_step_whose_shared_input_rotation_differs_is_found(target, monkeypatch):
    """Decode's linears that share their input (an MLP's gate and up; under the convolution
    arm a GatedDeltaNet's in_proj_qkv and in_proj_z) take one rotation for all
    (dflash2_kernels.rotate_group; the matmul arm's one row, exact_linear_group): one bit off
    in its last output is found in every arm that takes it, and in no other."""
    lm = target[0].language_model
    arms = [arm for arm in dflash2_decode_arms.DECODE_ARMS if arm != "mlx"]
    with monkeypatch.context() as patch:
        patch.setattr(dflash2_kernels, "rotate_group", last_output_a_bit_off(dflash2_kernels.rotate_group))
        differing = dflash2_decode_arms.decode_arm_differences(lm, arms)
    assert {arm for arm, n in differing.items() if n} == {arm for arm in arms
                                                          if "matmul" not in dflash2_decode_arms.DECODE_ARMS[arm]}
    monkeypatch.setattr(dflash2_kernels, "exact_linear_group", last_output_a_bit_off(dflash2_kernels.exact_linear_group))
    matmul_arms = [arm for arm in arms if "matmul" in dflash2_decode_arms.DECODE_ARMS[arm]]
    differing = dflash2_decode_arms.decode_arm_differences(lm, matmul_arms)
    assert len(matmul_arms) > 1 and all(differing[arm] > 0 for arm in matmul_arms), differing


def test_a_subclass_of_the_gated_delta_net_keeps_its_own_step(target, monkeypatch):
    """mlx-vlm subclasses Qwen3_5GatedDeltaNet with other norms and gates (qwen4_exp): the
    convolution arm's one-row layer is Qwen3.5's own, so a subclass's step stays stock."""
    lm = target[0].language_model
    layer = next(layer.linear_attn for layer in lm.model.layers if layer.is_linear)
    taken = []
    positions = dflash2_decode_arms.gated_delta_positions
    monkeypatch.setattr(dflash2_decode_arms, "gated_delta_positions",
                        lambda *args: taken.append(type(args[0])) or positions(*args))

    def steps():
        taken.clear()
        dflash2_decode_arms.use_decode_arm("rotation+recurrence+convolution")
        try:
            cache = lm.make_cache()
            mx.eval(lm(mx.array([[1, 2, 3]]), cache=cache).logits, lm(mx.array([[5]]), cache=cache).logits)
        finally:
            dflash2_decode_arms.use_decode_arm("mlx")
        return list(taken)

    linear_layers = sum(layer.is_linear for layer in lm.model.layers)
    assert len(steps()) == linear_layers  # Qwen3.5's own layers take the arm's step
    monkeypatch.setattr(layer, "__class__", type("Subclass", (type(layer),), {}))
    taken_by = steps()
    assert len(taken_by) == linear_layers - 1 and type(layer) not in taken_by


@pytest.mark.parametrize("name, arm, call_shape, serving, in_decode_and_verify", [
    ("rope_rows", "rotation+recurrence+convolution+rope",
     lambda q, k, cos, sin: (q.shape[2], dflash2_kernel_rope.rope_kernel_supports(q, k, cos, sin)),
     lambda layer: not layer.is_linear, lambda n: n),
    ("add_rms_norm", "rotation+recurrence+convolution+rope+residual",
     lambda x, residual, weight, eps: (x.shape[1], dflash2_kernel_fused.norm_kernel_supports(x, weight, residual)),
     lambda layer: True, lambda n: 2 * n - 1),
    ("gated_rms_norm", "rotation+recurrence+convolution",
     lambda x, weight, eps, gate: (x.shape[1], dflash2_kernel_fused.norm_kernel_supports(x, weight, gate)),
     lambda layer: layer.is_linear, lambda n: n),
    ("gdn_gates", "rotation+recurrence+convolution",
     lambda A_log, a, b, dt_bias: (a.shape[1], dflash2_kernel_fused.gates_kernel_supports(A_log, a, b, dt_bias)),
     lambda layer: layer.is_linear, lambda n: n),
])
def test_decode_and_verify_hand_each_kernel_shapes_it_takes(target, monkeypatch, name, arm, call_shape, serving,
                                                          in_decode_and_verify):
    """Under its arm a decode step, and any verify round, call the kernel (the rotary: each
    attention layer; the residual add and norm: every layer, and also each layer's second
    add with the next layer's input norm; the gated norm and the gates: each GatedDeltaNet
    layer) with arguments it takes: on a
    GPU none falls back to the stock launches unseen, and graph_count's one launch for it is
    what CUDA runs. The prefill keeps mlx-vlm's own calls."""
    model, processor, drafter = target
    lm, taps = model.language_model, drafter.config.target_layer_ids
    kernel, taken = getattr(dflash2_kernels, name), []

    def recorded(*args, variant=None):
        taken.append(call_shape(*args))
        return kernel(*args, variant=variant)

    monkeypatch.setattr(dflash2_kernels, name, recorded)
    dflash2_decode_arms.use_decode_arm(arm)
    try:
        cache = lm.make_cache()
        mx.eval(lm(raw_ids(processor, PROMPTS[0]), cache=cache).logits)
        assert taken == []
        mx.eval(lm(mx.array([[5]]), cache=cache).logits)
    finally:
        dflash2_decode_arms.use_decode_arm("mlx")
    hidden, transaction, tokens = dflash_rounds._dflash_verify_greedy(
        lm, mx.array([[7, 8, 9]]), cache, taps, lambda logits: mx.argmax(logits, axis=-1))
    mx.eval(tokens)
    abort_speculative_round(transaction)
    calls = in_decode_and_verify(sum(map(serving, lm.model.layers)))
    assert taken == [(1, True)] * calls + [(3, True)] * calls


def test_rollback_at_every_accepted_count_equals_never_speculated_cache(target, raw_plain):
    model, processor, drafter = target
    lm = model.language_model
    ids = raw_ids(processor, PROMPTS[1])
    taps = drafter.config.target_layer_ids
    cases = rollback_cases(lm, ids, taps, raw_plain[1][:8], lengths=(2, 8))
    assert len(cases) == 2 + 8
    assert [c for c in cases if c["logits"]] == []


def test_verify_handing_each_layer_to_the_device_keeps_every_bit(target, raw_plain, monkeypatch):
    """The verify forward hands its hidden state to mx.async_eval every VERIFY_EVAL_EVERY
    layers, counted afresh in each forward (the tiny pack's 2 layers are under the default's
    8: here every layer, then 3), and its logits, hidden states and rollback stay those of
    sequential decode. On CPU the order of evaluation cannot change bits; the start-up
    self-check is what proves it on a GPU, with the served interval and the real layers."""
    model, processor, drafter = target
    lm, taps = model.language_model, drafter.config.target_layer_ids
    ids = raw_ids(processor, PROMPTS[0])
    real_async_eval, handed = mx.async_eval, []

    def async_eval(*arrays):
        handed.append(arrays)
        return real_async_eval(*arrays)

    cache = lm.make_cache()
    mx.eval(lm(ids, cache=cache, capture_layer_ids=taps).logits)
    monkeypatch.setattr(mx, "async_eval", async_eval)
    # Every layer: after both layers of each of three forwards. Every 3: none (a count
    # carried over from one forward to the next would hand off after the 3rd and 6th layers).
    for every, hand_offs in ((1, 6), (3, 0)):
        monkeypatch.setattr(dflash2_verify, "VERIFY_EVAL_EVERY", every)
        handed.clear()
        for _ in range(3):
            hidden, states, tokens = dflash_rounds._dflash_verify_greedy(lm, mx.array([raw_plain[0][:4]]), cache, taps,
                                                                         None)
            mx.eval(hidden, tokens)
            abort_speculative_round(states)
        assert len(lm.model.layers) == 2 and len(handed) == hand_offs and all(len(arrays) == 1 for arrays in handed)
    monkeypatch.setattr(mx, "async_eval", real_async_eval)
    monkeypatch.setattr(dflash2_verify, "VERIFY_EVAL_EVERY", 1)
    cases = verify_cases(lm, ids, taps, raw_plain[0][:8], lengths=(2, 8))
    assert [c for c in cases if c["logits"] or c["hidden"]] == []
    rollback = rollback_cases(lm, ids, taps, raw_plain[0][:8], lengths=(8,))
    assert [c for c in rollback if c["logits"]] == []


@pytest.fixture
def stock_verify():
    """The runtime's replacements put back for one test: stock mlx-vlm, as if not installed."""
    with stock_mlx_vlm():
        yield


def test_stock_mlx_vlm_is_mlx_vlm_as_shipped_and_then_the_runtime_again(target):
    """parity.stock_mlx_vlm (these negative controls, bench's peer arm): inside, every replaced
    target is the stock object; afterwards, the replacement again."""
    def current():
        return {row.target: getattr(*dflash2_audit.resolve(row.target)) for row in dflash2_audit.REPLACED}

    installed = current()
    assert any(value is not dflash2_audit.stock(name) for name, value in installed.items())
    with stock_mlx_vlm():
        assert all(value is dflash2_audit.stock(name) for name, value in current().items())
    assert current() == installed


def test_stock_verify_fails_the_same_checks(target, raw_plain, stock_verify):
    """The negative control: the checks above and test_exact_tokens.py's see stock
    verify's batched rounding (plain decoding is stock's with the runtime installed too)."""
    model, processor, drafter = target
    lm, taps = model.language_model, drafter.config.target_layer_ids
    ids = raw_ids(processor, PROMPTS[0])
    plain = raw_plain[0]
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


def test_sources_digest_is_the_audited_installs():
    """The fast path's constant is this (the audited) install's; after a pin change, the
    failure prints the new one to put in dflash2_audit.SOURCES_DIGEST."""
    assert dflash2_audit.sources_digest() == dflash2_audit.SOURCES_DIGEST, dflash2_audit.sources_digest()


def test_audited_install_starts_without_reading_a_source(monkeypatch):
    """check_sources on the audited install re-reads no source (about 0.8 s of every start:
    inspect.getsource parses whole files to find a class)."""
    def unread(obj):
        raise AssertionError(f"read the source of {obj}")

    monkeypatch.setattr(dflash2_audit.inspect, "getsource", unread)
    dflash2_audit.check_sources()


@pytest.mark.parametrize("target, other", [
    ("mlx_vlm.speculative.dflash:_dflash_verify_greedy", "_dflash_verify"),
    ("mlx_vlm.server.schemas:AnthropicRequest", "OpenAIRequest"),
], ids=["function", "class"])
def test_a_replacement_from_the_same_file_still_refuses(monkeypatch, target, other):
    """An audited name rebound to another function or class of its own file (the same bytes
    on disk) is still refused and named: the fast path keys each object's place in its file."""
    owner, name = dflash2_audit.resolve(target)
    monkeypatch.setattr(owner, name, getattr(owner, other))
    with pytest.raises(dflash2_audit.SourceMismatch) as refused:
        dflash2_audit.check_sources()
    assert target in str(refused.value)


def test_what_getsource_reads_is_what_the_fast_path_keys(monkeypatch):
    """The fast path follows inspect.getsource where it departs from the object and the
    disk: a class given a __wrapped__ (getsource reads what it wraps), and a file whose text
    in linecache differs from its bytes on disk (getsource reads linecache's)."""
    import linecache
    from mlx_vlm.server import schemas

    monkeypatch.setattr(schemas.AnthropicRequest, "__wrapped__", dflash2_audit.stock(
        "mlx_vlm.speculative.dflash:_dflash_verify"), raising=False)
    with pytest.raises(dflash2_audit.SourceMismatch) as refused:
        dflash2_audit.check_sources()
    assert "mlx_vlm.server.schemas:AnthropicRequest" in str(refused.value)
    monkeypatch.undo()

    audited = dflash2_audit.stock("mlx_vlm.speculative.dflash:_dflash_verify_greedy")  # installed or not
    file = inspect.getsourcefile(audited)
    lines = list(linecache.getlines(file))
    first = audited.__code__.co_firstlineno
    lines[first] = lines[first].rstrip("\n") + "  # edited\n"
    # An entry without an mtime, as linecache keeps for sources it did not read from disk.
    monkeypatch.setitem(linecache.cache, file, (sum(map(len, lines)), None, lines, file))
    with pytest.raises(dflash2_audit.SourceMismatch) as refused:
        dflash2_audit.check_sources()
    assert "mlx_vlm.speculative.dflash:_dflash_verify_greedy" in str(refused.value)


def test_fp32_dense_layout_verify_and_rollback_are_exact(float32_target):
    """Packs whose unpacked tensors are fp32 run fp32 activations through verify (the checks
    below are the model's self-check)."""
    model, processor, drafter = float32_target
    lm, taps = model.language_model, drafter.config.target_layer_ids
    ids = raw_ids(processor, PROMPTS[2])
    continuation = greedy(model, ids, 8)
    assert lm.model.embed_tokens(ids).dtype != lm.model.norm.weight.dtype  # fp16 in, fp32 stream
    cases = verify_cases(lm, ids, taps, continuation, lengths=(2, 8))
    cases += rollback_cases(lm, ids, taps, continuation, lengths=(8,))
    assert [c for c in cases if c["logits"] or c.get("hidden")] == []
    # The control: in fp32 too, stock verify's batched rounding changes the bits compared.
    with stock_mlx_vlm():
        stock = verify_cases(lm, ids, taps, continuation, lengths=(2, 8))
    assert all(c["logits"] and c["hidden"] for c in stock), stock


def test_start_up_self_check_passes_the_exact_verifier_and_catches_stock(target, monkeypatch):
    """install(model)'s verify self-check: 0 differing with the exact verify, the stock
    control above 0; with stock verify serving, the check reports it and where."""
    from mlx_vlm.models.qwen3_5 import language as qwen3_5_language

    lm = target[0].language_model
    check = dflash2_runtime.self_check_verify(lm)
    assert check.blocks == 7 and check.differing == 0 and check.stock_differing > 0
    assert check.stock_block == 8 and list(check.seconds_by_part) == ["decode steps", "exact rounds", "stock round"]
    assert "(stock verify, block 8: " in check.summary()
    stock = qwen3_5_language._EXACT_SPECULATIVE_VERIFIER.__dflash2_stock__
    serving_stock = copy.copy(stock)  # installed as if it were the exact one
    serving_stock.__dflash2_stock__ = stock
    monkeypatch.setattr(qwen3_5_language, "_EXACT_SPECULATIVE_VERIFIER", serving_stock)
    broken = dflash2_runtime.self_check_verify(lm)
    assert broken.differing > 0 and broken.first_difference.startswith("block ")


def test_start_up_self_check_passes_where_decode_runs_a_fused_recurrence_kernel(target, monkeypatch):
    """On a Metal-like backend (decode's GatedDeltaNet step is mlx-vlm's fused kernel, which
    rounds unlike the ops step) the verify self-check finds 0 differing: verify reproduces
    that kernel. A verify taking the ops step there, as every Mac's did, differs."""
    from gpu_rounding import metal_like_recurrence

    metal_like_recurrence(monkeypatch)
    monkeypatch.setattr(dflash2_kernel_gdn, "_gdn_serving", {})
    lm = target[0].language_model
    check = dflash2_runtime.self_check_verify(lm)
    assert check.differing == 0 and dflash2_kernel_gdn._gdn_serving == {"metal": "with_states"}
    monkeypatch.setattr(dflash2_kernel_gdn, "decode_recurrence_on_metal", lambda: False)
    monkeypatch.setattr(dflash2_kernel_gdn, "_gdn_serving", {})
    assert dflash2_runtime.self_check_verify(lm).differing > 0


def test_install_turns_speculation_off_for_packed_weights_the_verify_matmul_does_not_take(tiny_pack):
    """The verify forward's packed matmuls skip argument checks: install checks every packed
    module once, and a pack with, say, bf16 scales serves plain with the reason."""
    from dflash2_pack import load_pack
    from mlx_vlm.models.prism_hadamard_qwen35.prism_hadamard_qwen35 import HadamardQuantizedLinear

    model = load_pack(tiny_pack["target"], tiny_pack["drafter"])[0]
    packed = [m for m in model.language_model.modules() if isinstance(m, HadamardQuantizedLinear)]
    packed[-1].scales = packed[-1].scales.astype(mx.bfloat16)
    status = dflash2_runtime.install(model)
    assert not status.speculative
    assert status.reason.startswith("packed-weights-unsupported: scales must be float16")


def test_an_fp32_pack_tests_its_fp32_kernels_only_and_its_matmul_gates_speculation(
        float32_target, target, monkeypatch):
    """The real file's layout: every row is fp32 from the first norm on, so an fp32 pack's
    start-up tests the fp32 kernels at its shapes and none of the fp16-only ones (on the H100
    about 170 s of the real file's first start); an fp16 pack the reverse. The fp32 pack's
    matmul kernel (qmv32) then decides speculation as fp16's qmv does an fp16 pack's."""
    from dflash2_kernel_base import SelfTestResult
    from dflash2_pack import FP32_TWINS, kernel_shapes

    fp32, fp16 = kernel_shapes(float32_target[0]), kernel_shapes(target[0])
    for key in FP32_TWINS:
        assert fp32[key] == [] and fp32[f"{key}_fp32"] == fp16[key] != [] and fp16[f"{key}_fp32"] == [], key
    assert fp32["conv"] == fp32["attention"] == [] and fp16["conv"] and fp16["attention"]
    assert fp32["dense"] == fp16["dense"] != []  # one self-test for fp16 and fp32 rows
    tested = dflash2_kernels.verify_kernel_self_tests(fp32)
    assert "qmv32" in tested and not {"qmv", "rotate", "attention", "conv", "rope"} & set(tested)

    def failed(shapes=None):
        return SelfTestResult(False, "cuda", "qmv32 differs (forced by the test)", 1, 0)

    monkeypatch.setitem(dflash2_kernels.SELF_TESTS, "qmv32", ("packed_fp32", failed))
    status = dflash2_runtime.install(float32_target[0])
    assert not status.speculative and status.reason == "kernel-self-test-failed: qmv32 differs (forced by the test)"


def test_the_rotation_arm_rotates_fp32_rows_through_the_kernels_rotate(float32_target, monkeypatch):
    """The real file's fp32 rows: under the rotation arm, decode's packed linears rotate their
    row with dflash2_kernels.rotate (on CUDA the fp32 rotation kernel, where its self-test
    passed), and the tokens are plain decoding's."""
    model, processor, _ = float32_target
    ids = raw_ids(processor, PROMPTS[0])
    plain = greedy(model, ids, 4)
    rotated, rotate = [], dflash2_kernels.rotate

    def counted(x, block, signs):
        rotated.append(x.dtype)
        return rotate(x, block, signs)

    monkeypatch.setattr(dflash2_kernels, "rotate", counted)
    try:
        dflash2_decode_arms.use_decode_arm("rotation")
        assert greedy(model, ids, 4) == plain
    finally:
        dflash2_decode_arms.use_decode_arm("mlx")
    assert rotated and set(rotated) == {mx.float32}


def test_compiled_verify_layers_give_decode_s_bits_traced_once_per_block(target, monkeypatch):
    """The exact verify forward with its GatedDeltaNet layers compiled (the verify path a
    CUDA machine may choose at start-up): the self-check's rounds at every block 2..8 are
    stock decode's bits, each layer is built once per block length and replayed after, and a
    kernel one bit off is found."""
    from mlx_vlm.models.qwen3_5 import language as qwen3_5_language

    lm = target[0].language_model
    verifier = qwen3_5_language._EXACT_SPECULATIVE_VERIFIER
    built, core = [], dflash2_verify.gated_delta_core

    def counted(layer, inputs, *args):
        built.append(inputs.shape[1])
        return core(layer, inputs, *args)

    monkeypatch.setattr(dflash2_verify, "gated_delta_core", counted)
    linear_layers = sum(layer.is_linear for layer in lm.model.layers)
    try:
        verifier.use_compiled_layers(True)
        assert dflash2_runtime.self_check_verify(lm).differing == 0
        assert sorted(built) == sorted(length for length in range(2, 9) for _ in range(linear_layers))
        built.clear()
        assert dflash2_runtime.self_check_verify(lm).differing == 0 and built == []  # replayed
        monkeypatch.setattr(dflash2_kernels, "gdn_gates", last_output_a_bit_off(dflash2_kernels.gdn_gates))
        verifier.use_compiled_layers(True)  # traced again, with the kernel in use
        assert dflash2_runtime.self_check_verify(lm).differing > 0
    finally:
        verifier.use_compiled_layers(False)


def test_compiled_verify_layers_serve_rounds_and_rollbacks_as_plain_decoding(target, raw_plain, monkeypatch):
    """Through the round loop with the verify forward's GatedDeltaNet layers compiled: greedy
    tokens at blocks 2 and 8, every draft right and a third wrong, are plain decoding's, each
    layer built once per block length the rounds took, and the cache after a rollback at
    every accepted count is the never-speculated one (the commit outside the trace records
    and rolls back what the uncompiled forward does)."""
    from mlx_vlm.models.qwen3_5 import language as qwen3_5_language

    model, processor, drafter = target
    lm, taps = model.language_model, drafter.config.target_layer_ids
    ids = raw_ids(processor, PROMPTS[1])
    plain = raw_plain[1]
    verifier = qwen3_5_language._EXACT_SPECULATIVE_VERIFIER
    built, core = [], dflash2_verify.gated_delta_core

    def counted(layer, inputs, *args):
        built.append(inputs.shape[1])
        return core(layer, inputs, *args)

    linear_layers = sum(layer.is_linear for layer in lm.model.layers)
    try:
        verifier.use_compiled_layers(True)
        with monkeypatch.context() as patch:
            patch.setattr(dflash2_verify, "gated_delta_core", counted)
            rounds = 0
            for block in (2, 8):
                for error_rate in (0.0, 0.33):
                    tokens = oracle_token_case(model, ids, plain, block, error_rate, GENERATED)
                    assert tokens["identical"] and tokens["rounds"], tokens
                    rounds += tokens["rounds"]
        assert len(built) == linear_layers * len(set(built)) < linear_layers * rounds
        cases = rollback_cases(lm, ids, taps, plain[:8], lengths=(2, 8))
        assert len(cases) == 2 + 8 and [c for c in cases if c["logits"]] == []
    finally:
        verifier.use_compiled_layers(False)


def test_the_verify_path_is_compiled_only_on_cuda_where_checked_and_faster(target, monkeypatch):
    """choose_verify_path: off CUDA verify is built at every round; on CUDA the compiled
    forward is timed beside the built one only after its self-check found no difference, the
    faster kept; one whose check differs or raises is never timed; either way the verifier is
    left built (install then sets what was chosen)."""
    import types

    from mlx_vlm.models.qwen3_5 import language as qwen3_5_language

    lm = target[0].language_model
    verifier = qwen3_5_language._EXACT_SPECULATIVE_VERIFIER
    assert dflash2_runtime.choose_verify_path(lm) == dflash2_runtime.VerifyPathChoice(False, "compiled only on CUDA")
    monkeypatch.setattr(dflash2_runtime, "dflash2_kernels", types.SimpleNamespace(backend_name=lambda: "cuda"))
    choice = dflash2_runtime.choose_verify_path(lm)
    assert set(choice.forward_ms) == {"built", "compiled"} and verifier.compiled_layers is None
    assert choice.compiled == (choice.forward_ms["compiled"]["min"] < choice.forward_ms["built"]["min"])
    assert dflash2_runtime.VerifyPathChoice.from_json(dataclasses.asdict(choice)) == choice
    with pytest.raises(ValueError):
        dflash2_runtime.VerifyPathChoice.from_json({**dataclasses.asdict(choice), "compiled": "yes"})
    differing = dflash2_runtime.VerifySelfCheck(7, 3, 0, 0.1)
    monkeypatch.setattr(dflash2_runtime, "self_check_verify", lambda language_model: differing)
    choice = dflash2_runtime.choose_verify_path(lm)
    assert (choice.compiled, choice.why, choice.forward_ms) == (
        False, "the compiled forward's self-check: 3 differing", {})

    assert dflash2_runtime.choose_verify_path(lm, kernels_serve=False).why == (
        "a kernel self-test failed: some layer op is stock's element-wise calls")

    def raises(language_model):
        raise RuntimeError("the trace failed")

    monkeypatch.setattr(dflash2_runtime, "self_check_verify", raises)
    choice = dflash2_runtime.choose_verify_path(lm)
    assert not choice.compiled and choice.why == "the compiled forward raised RuntimeError: the trace failed"
    assert verifier.compiled_layers is None


def test_a_cached_compiled_verify_path_this_start_disproves_is_not_served(target, monkeypatch):
    """A verify path cached as compiled whose every-start self-check differs: the forward is
    built at every round for this start, and speculation stays on if the built forward's
    check passes (the status says why)."""
    from mlx_vlm.models.qwen3_5 import language as qwen3_5_language

    model = target[0]
    verifier = qwen3_5_language._EXACT_SPECULATIVE_VERIFIER
    check = dflash2_runtime.self_check_verify

    def differing_when_compiled(language_model):
        found = check(language_model)
        if verifier.compiled_layers is not None:
            found.differing = 5
        return found

    class CachedCompiled(dflash2_runtime.VerdictCache):
        def check(self, name, measure, restore=None, encode=dataclasses.asdict):
            if name == "verify path":
                return dflash2_runtime.VerifyPathChoice(True, "cached")
            return super().check(name, measure, restore, encode)

    monkeypatch.setattr(dflash2_runtime, "self_check_verify", differing_when_compiled)
    try:
        status = dflash2_runtime.install(model, CachedCompiled())
        assert status.speculative and verifier.compiled_layers is None
        assert not status.verify_path.compiled and status.verify_path.why.startswith(
            "the compiled forward's self-check at this start: exact verify self-check: 7 blocks, 5 differing")
        assert any(line.startswith("verify path: built at every round") for line in status.log_lines())
    finally:
        verifier.use_compiled_layers(False)


def test_a_verify_round_leaves_no_reference_to_the_model_s_layers(target):
    """The verifier is one object for the process: after a round it holds neither the model's
    layers (which would keep a dropped model's weights alive) nor the last layer's output."""
    model, _, drafter = target
    lm = model.language_model
    cache = lm.make_cache()
    mx.eval(lm(mx.array([[1, 2, 3]]), cache=cache).logits)
    hidden, transaction, tokens = dflash_rounds._dflash_verify_greedy(
        lm, mx.array([[7, 8, 9]]), cache, drafter.config.target_layer_ids, lambda logits: mx.argmax(logits, axis=-1))
    mx.eval(tokens)
    abort_speculative_round(transaction)
    verifier = qwen3_5_language._EXACT_SPECULATIVE_VERIFIER
    assert verifier._layers == () and verifier._ahead is None
