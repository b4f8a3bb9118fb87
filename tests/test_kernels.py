"""dflash2_kernels on CPU: the self-test registry runs each kernel's test at the pack's shapes,
and off the kernels' backends there is nothing to test."""

import pytest

import dflash2_kernel_base
import dflash2_kernel_qmv
import dflash2_kernels as dk
from kernel_cases import patch_kernels


def test_own_self_tests_have_nothing_to_test_without_kernels(monkeypatch):
    patch_kernels(monkeypatch, "backend_name", lambda: "cpu")
    serving = dict(dflash2_kernel_qmv._verified)
    for name, (_, test) in dk.SELF_TESTS.items():
        result = test(shapes=None)
        assert result.ok and result.reason == dflash2_kernel_base.NO_KERNEL and not result.cases, name
    assert dflash2_kernel_qmv._verified == serving


def test_verify_kernel_self_tests_runs_each_kernel_at_the_pack_shapes(monkeypatch):
    given = {}

    def recorded(name, test):
        def run(shapes):
            given[name] = shapes
            return test(shapes=shapes)
        return run

    monkeypatch.setattr(dk, "SELF_TESTS", {name: (key, recorded(name, test))
                                           for name, (key, test) in dk.SELF_TESTS.items()})
    results = dk.verify_kernel_self_tests(
        {"packed": [[16, 512]], "rotations": [(512, 512)], "gdn": [(1, 1, 2, 64, 64)],
         "dense": [], "attention": [(1, 24, 4, 256)]}
    )
    assert set(results) == {"qmv", "rotate", "gdn", "attention"}  # empty: left to first use
    assert all(result.ok for result in results.values())
    assert given == {"qmv": [(16, 512)], "rotate": [(512, 512)], "gdn": [(1, 1, 2, 64, 64)],
                     "attention": [(1, 24, 4, 256)]}


@pytest.mark.parametrize("pack", ["tiny_pack", "float32_pack"])
def test_verify_tests_the_kernels_the_server_s_start_up_tests(pack, request):
    """pack verify builds the model without its weights; given the dtypes its headers store,
    its kernel shapes are the loaded pack's (a skeleton's arrays default to fp32, which sent
    fp16 packs' checks down the fp32 rows' kernels and always to the fp32 convolution's)."""
    from dflash2_pack import build_skeleton, kernel_shapes, load_pack, read_config, read_headers, typed_as_headers

    paths = request.getfixturevalue(pack)
    skeleton = build_skeleton(read_config(paths["target"]), "config.json")
    untyped = kernel_shapes(skeleton)
    typed_as_headers(skeleton, read_headers(paths["target"])[0])
    loaded = kernel_shapes(load_pack(paths["target"])[0])
    assert kernel_shapes(skeleton) == loaded
    if pack == "tiny_pack":
        assert untyped != loaded and loaded["packed_fp32"] == loaded["conv_fp32"] == []
