"""tools/train_tiny_pair.py's pieces on small inputs (a training run takes minutes: the
trained pair it wrote is tested in tests/test_tiny_pair.py).

Its claim: the target trains aware of its 2-bit packing, so the packed file computes what
training saw; and its chat data comes from the documented functions of the sources."""

import mlx.core as mx

import train_tiny_pair as tiny
from dflash2_pack import load_pack
from make_synthetic_pack import target_config, write_target


def test_fake_quant_is_the_packed_value_with_a_straight_through_gradient():
    x = mx.random.normal((4, 256), key=mx.random.key(0)) / 10
    codes = mx.quantize(x.astype(mx.float16), group_size=tiny.GROUP, bits=tiny.BITS)
    packed = mx.dequantize(*codes, group_size=tiny.GROUP, bits=tiny.BITS).astype(mx.float32)
    assert mx.allclose(tiny.fake_quant(x), packed, rtol=0, atol=1e-7).item()
    assert not mx.array_equal(packed, x).item()
    grad = mx.grad(lambda w: (tiny.fake_quant(w) * mx.arange(256)).sum())(x)
    assert mx.array_equal(grad, mx.broadcast_to(mx.arange(256).astype(mx.float32), x.shape)).item()


def test_the_packed_target_computes_what_training_saw(tmp_path):
    """Each packed module's tensors (2-bit codes, scales, biases, signs), rotated back, are
    bitwise the dense weight the training forward used; the pack written from them passes the
    pack's checks, and mlx-vlm's loaded model gives the training model's logits up to fp16's
    rounding. Its unpacked tensors are fp32, as the 27B file's (so are its activations)."""
    config = target_config(tiny.SIZE)
    lm = tiny.training_target(config, seed=0)
    lm.eval()
    tensors = tiny.target_tensors(lm, config)
    modules = dict(lm.named_modules())
    for record in config["modules"]:
        name = f"language_model.{record['path']}"
        weight = mx.dequantize(tensors[f"{name}.weight"], tensors[f"{name}.scales"], tensors[f"{name}.biases"],
                               group_size=tiny.GROUP, bits=tiny.BITS).astype(mx.float32)
        if record["block"]:
            weight = tiny.hadamard_rows(weight, record["block"]) * tensors[f"{name}.signs"]
        assert mx.array_equal(weight, modules[record["path"]].dense()).item(), record["path"]
    packed = {f"language_model.{record['path']}" for record in config["modules"]}
    dense = [value.dtype for name, value in tensors.items() if name.rpartition(".")[0] not in packed]
    assert dense and set(dense) == {mx.float32}

    write_target(tmp_path / "target", tiny.SIZE, 0, trained=tensors)
    model, _, _ = load_pack(tmp_path / "target")
    ids = mx.array([[5, 9, 33, 100, 7, 300, 2, 41]])
    trained = lm(ids).logits.astype(mx.float32)
    served = model.language_model(ids).logits.astype(mx.float32)
    assert (mx.abs(served - trained).max() < 0.03 * mx.abs(trained).max()).item()


SOURCE = '''"""Boxes and lists: small helpers for the tests."""


def reverse(items, start):
    """Reverse a list from start."""
    return items[start:][::-1]


def _private(x):
    """Not offered."""


def undocumented(x):
    return x


class Box:
    """A box that holds one value."""

    def get(self):
        """The box's value."""
        return self.value
'''


def test_chat_samples_turn_documented_code_into_code_prose_and_tool_call_turns():
    """Each documented public function is asked for (its source answers), asked about (its
    docstring answers, naming it) and, with parameters, offered as a tool and called; a
    documented module or class is asked about. Each question's phrasing is drawn from the
    seed: the same seed, the same turns."""
    rendered = []

    def renderer(messages, tools=None):
        rendered.append((messages, tools))
        return len(rendered) - 1

    sources = [("boxes.py", SOURCE), ("broken.py", "def (")]
    samples = tiny.chat_samples(sources, renderer, seed=0)
    turns = {kind: [rendered[index] for index in indices] for kind, indices in samples.items()}
    asked = {kind: [messages[0]["content"] for messages, _ in kind_turns] for kind, kind_turns in turns.items()}
    answers = {kind: [messages[1].get("content") for messages, _ in kind_turns] for kind, kind_turns in turns.items()}
    assert [answer.partition("\n")[0] for answer in answers["code"]] == ["def reverse(items, start):", "def get(self):"]
    assert "reverse" in asked["code"][0] and "get" in asked["code"][1]
    assert all(offered is None for _, offered in turns["code"] + turns["prose"])
    assert answers["prose"] == ["The `boxes` module: Boxes and lists: small helpers for the tests.",
                                "`boxes.reverse(items, start)`: Reverse a list from start.",
                                "`boxes.Box`: A box that holds one value.",
                                "`boxes.get()`: The box's value."]
    assert "boxes" in asked["prose"][0] and "reverse" in asked["prose"][1] and "Box" in asked["prose"][2]
    # A tool-call turn for each function with parameters (self does not count).
    [(messages, offered)] = turns["tools"]
    assert messages[0]["content"] == "Reverse a list from start. Use boxes."
    assert messages[1]["tool_calls"] == [{"function": {"name": "reverse", "arguments": {"items": "ITEMS", "start": "START"}}}]
    assert offered[0]["function"]["parameters"]["required"] == ["items", "start"]
    again = []
    tiny.chat_samples(sources, lambda messages, tools=None: again.append(messages[0]["content"]), seed=0)
    assert again == [messages[0]["content"] for messages, _ in rendered]
