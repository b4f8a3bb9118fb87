"""dflash2_kernel_base on CPU: test inputs are what they say, and CUDA kernels are built as
MLX builds them (baked templates, headers included from content-named files)."""

import os
import shutil

import mlx.core as mx
import numpy as np
import pytest

import dflash2_kernel_base
import dflash2_kernel_qmv
import dflash2_kernels as dk


def test_input_kinds_are_what_they_say():
    key = mx.random.key(3)
    subnormal = dflash2_kernel_base.make_inputs("subnormal", 8, 512, key)
    assert (mx.abs(subnormal) < 2.0**-14).all().item()
    zeros = dflash2_kernel_base.make_inputs("signed_zero", 8, 512, key).view(mx.uint16)
    assert (zeros[0] == 0x8000).all().item()  # row 0: all -0
    assert ((zeros[1] == 0) | (zeros[1] == 0x8000)).all().item()
    cancel = dflash2_kernel_base.make_inputs("cancellation", 8, 512, key)
    assert mx.array_equal(cancel[:, ::2], -cancel[:, 1::2]).item()
    for kind in dflash2_kernel_base.INPUT_KINDS:  # odd widths too (the norms' self-test runs one, 1003)
        assert dflash2_kernel_base.make_inputs(kind, 3, 1003, key).shape == (3, 1003), kind
    large = dflash2_kernel_base.make_inputs("large", 8, 512, key)
    assert mx.isfinite(large).all().item() and mx.abs(large).max().item() > 2048


@pytest.mark.parametrize(
    ("k", "npt"), [(5120, 4), (256, 4), (128, 4), (320, 2), (192, 2), (64, 2), (136, 1), (102, 1), (96, 1)]
)
def test_gemv_elements_per_lane(k, npt):
    # gemv.cu:242-249: 4 when K % 128 == 0, 2 when K % 64 == 0, else 1 (aligned pointers).
    assert dflash2_kernel_base.gemv_elements_per_lane(k) == npt


def test_a_baked_kernel_is_made_once_per_template_under_mlx_s_name_and_source(monkeypatch):
    """BakedCudaKernel: per template one mx.fast.cuda_kernel, named with MLX's template suffix
    (the 8-row qmv's name in the H200 profiles) and with the lines MLX writes for a template
    ahead of the source; calls pass the launch on without the template."""
    made, calls = [], []

    def cuda_kernel(**kwargs):
        made.append(kwargs)
        return lambda **launch: calls.append((kwargs["name"], launch)) or ["y"]

    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel)
    kernel = dflash2_kernel_base.BakedCudaKernel(name="dflash2_qmv_2bit_g128", input_names=["x"], output_names=["y"],
                                source="body();", header="#include <h>\n")
    template = [("M", 8), ("S", 1), ("R", 2), ("C", 2), ("PREFETCH", 1), ("TILES", True)]
    io = dict(inputs=[mx.zeros((2,), mx.float16)], output_dtypes=[mx.float16])
    assert kernel(template=template, grid=(1, 1, 1), **io) == ["y"]
    assert kernel(template=list(template), grid=(2, 1, 1), **io) == ["y"]
    assert kernel(grid=(3, 1, 1), **io) == ["y"]  # no template: MLX's name and source as given
    assert [m["name"] for m in made] == ["dflash2_qmv_2bit_g128_8_1_2_2_1_t", "dflash2_qmv_2bit_g128"]
    assert made[0]["source"] == ("  constexpr int M = 8;\n  constexpr int S = 1;\n  constexpr int R = 2;\n"
                                 "  constexpr int C = 2;\n  constexpr int PREFETCH = 1;\n  constexpr bool TILES = true;\n"
                                 "\nbody();")
    assert made[1]["source"] == "body();" and made[0]["header"] == "#include <h>\n"
    assert [launch for _, launch in calls] == [{"grid": (grid, 1, 1), **io} for grid in (1, 2, 3)]
    assert dflash2_kernel_base._template_suffix([("FMA", False), ("D", np.int64(256))]) == "_f_256"
    with pytest.raises(TypeError, match="T must be an int or a bool"):
        kernel(template=[("T", mx.float16)])


@pytest.mark.skipif(dk.backend_name() != "cuda", reason="MLX's CUDA backend runs the kernel")
def test_a_baked_kernel_compiles_the_source_mlx_writes_for_its_template(capfd):
    """On CUDA, MLX's own print of the source it generates (verbose=True): the served qmv's
    (baked) equals the same kernel's called with the template, name included."""
    weight, scales, biases = dflash2_kernel_qmv.make_weights(16, 512, mx.random.key(0))
    x = dflash2_kernel_base.make_inputs("normal", dk.MAX_ROWS, 512, mx.random.key(1))
    templated = mx.fast.cuda_kernel(name="dflash2_qmv_2bit_g128", input_names=["x", "w", "scales", "biases"],
                                    output_names=["y"], source=dflash2_kernel_qmv._CUDA_SOURCE, header=dflash2_kernel_base.cuda_header(dflash2_kernel_qmv._CUDA_HEADER))
    for rows in (1, dk.MAX_ROWS):
        call = dflash2_kernel_qmv._cuda_launch((rows,), 16)
        capfd.readouterr()
        mx.eval(templated(inputs=[x[:rows], weight, scales, biases], verbose=True, **call))
        want = capfd.readouterr().out
        mx.eval(dflash2_kernel_qmv._cuda_kernel()(inputs=[x[:rows], weight, scales, biases], verbose=True, **call))
        got = capfd.readouterr().out
        assert "Generated source code for `custom_kernel_dflash2_qmv_2bit_g128_" in want and got == want


def test_cuda_header_includes_a_file_named_by_its_content(tmp_path, monkeypatch):
    monkeypatch.setattr(dflash2_kernel_base.tempfile, "gettempdir", lambda: str(tmp_path))
    line = dflash2_kernel_base.cuda_header("namespace a { int x; }\n")
    path = line.split('"')[1]
    assert line == f'#include "{path}"\n' and open(path).read() == "namespace a { int x; }\n"
    assert dflash2_kernel_base.cuda_header("namespace a { int x; }\n") == line  # same text, same file
    assert dflash2_kernel_base.cuda_header("namespace b {}\n") != line  # other text, other name: no stale PTX
    with open(path, "w") as tampered:
        tampered.write("changed")
    dflash2_kernel_base.cuda_header("namespace a { int x; }\n")
    assert open(path).read() == "namespace a { int x; }\n"
    assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"


def test_cuda_header_leaves_a_folder_others_can_write(tmp_path, monkeypatch):
    monkeypatch.setattr(dflash2_kernel_base.tempfile, "gettempdir", lambda: str(tmp_path))
    shared = tmp_path / f"dflash2-cuda-{os.getuid()}"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    path = dflash2_kernel_base.cuda_header("namespace c {}\n").split('"')[1]
    assert os.path.dirname(path) != str(shared) and open(path).read() == "namespace c {}\n"
    assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
    # A link in the folder's place (to a folder of ours, or to a file) is left alone too.
    for target in (tmp_path / "ours", tmp_path / "a-file"):
        shutil.rmtree(shared, ignore_errors=True)
        shared.unlink(missing_ok=True)
        if target.name == "ours":
            target.mkdir(mode=0o700)
        else:
            target.write_text("")
        shared.symlink_to(target)
        path = dflash2_kernel_base.cuda_header("namespace d {}\n").split('"')[1]
        assert os.path.dirname(path) not in (str(shared), str(target)) and open(path).read() == "namespace d {}\n"
