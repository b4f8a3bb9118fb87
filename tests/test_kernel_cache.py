"""dflash2_kernel_cache: the module name MLX looks for (its source text and libstdc++'s hash),
MLX's device headers read from a library's symbol table, NVRTC as MLX calls it (on the CPU:
NVRTC needs no GPU), and the cache entries prepare() leaves. The CUDA-only test at the end runs
a pack kernel in two processes on one cache (the second finds the first's binary, same bits),
and a planted binary shows MLX runs what it finds under the name."""

import ctypes
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

import dflash2_kernel_base
import dflash2_kernel_cache as kernel_cache
import dflash2_kernel_folder
import dflash2_kernel_qmv as qmv
from dflash2_kernel_folder import whole_binary

REPO = Path(__file__).resolve().parents[1]
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


@pytest.fixture
def fresh_counts(monkeypatch):
    monkeypatch.setattr(kernel_cache, "_COUNTS", {"compiled": 0, "found": 0, "failed": 0})
    monkeypatch.setattr(kernel_cache, "_FIRST_FAILURE", [])


@needs_gxx
def test_std_hash_is_libstdcxx_hash_of_a_string(tmp_path):
    program = tmp_path / "hash.cpp"
    program.write_text(textwrap.dedent("""\
        #include <iostream>
        #include <iterator>
        #include <string>
        int main() {
          std::string s((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
          std::cout << std::hex << std::hash<std::string>{}(s) << "\\n";
        }
        """))
    subprocess.run(["g++", "-O1", "-o", str(tmp_path / "hash"), str(program)], check=True)
    source = kernel_cache.mlx_kernel_source(
        "custom_kernel_k", "", "y[0] = x[0];", ["x"], [mx.zeros((2,), mx.float16)], ["y"], [mx.float16])
    # every tail length (0-7 bytes past the 8-byte words), non-ASCII, a kernel's text
    for data in [b"", b"a", b"abcdefg", b"abcdefgh", b"abcdefghi", bytes(range(256)) * 3,
                 "\u00a9 2025".encode() * 7, source.encode()]:
        want = subprocess.run([str(tmp_path / "hash")], input=data, capture_output=True, check=True).stdout
        assert f"{kernel_cache.std_hash(data):x}" == want.decode().strip()


def test_kernel_source_is_mlx_build_kernel_text():
    """The text custom_kernel.cpp's build_kernel writes (MLX 0.32.2), written out by hand: an
    input's shape, strides and ndim only where the body names them, none for a 0-d input."""
    body = "  constexpr int M = 8;\n\ny[0] = x_shape[0] + w_strides[0] + w_ndim + n_shape[0];"
    inputs = [mx.zeros((2, 3), mx.float16), mx.zeros((4,), mx.uint32), mx.array(1, mx.int32)]
    got = kernel_cache.mlx_kernel_source("custom_kernel_k_8", '#include "h.cuh"\n', body, ["x", "w", "n"], inputs,
                                         ["y", "z"], [mx.float32, mx.bfloat16])
    want = (
        '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
        '#include "h.cuh"\n'
        "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        "__global__ void custom_kernel_k_8(\n"
        "    const __half* x,\n"
        "    const __grid_constant__ Shape x_shape,\n"
        "    const uint32_t* w,\n"
        "    const __grid_constant__ Strides w_strides,\n"
        "    const __grid_constant__ int w_ndim,\n"
        "    const int32_t* n,\n"
        "    float* y,\n"
        "    __nv_bfloat16* z) {\n"
        + body
        + "\n}\n\n} // namespace mlx::core::cu\n"
    )
    assert got == want


def test_module_path_splits_long_names_as_mlx_does(tmp_path):
    assert kernel_cache.module_path(tmp_path, "m_1") == tmp_path / "m_1.ptx"
    name = "a" * 245 + "b" * 245 + "c" * 3
    assert kernel_cache.module_path(tmp_path, name) == tmp_path / ("a" * 245) / ("b" * 245) / "ccc.ptx"
    assert kernel_cache.module_path(tmp_path, "a" * 245) == tmp_path / ("a" * 245 + ".ptx")


@needs_gxx
def test_cache_folder_is_mlx_ptx_cache_dir(monkeypatch, tmp_path):
    """MLX's ptx_cache_dir: MLX_PTX_CACHE_DIR (set empty: none), else libstdc++'s
    temp_directory_path (printed by g++'s build here, under each environment) / mlx / version / ptx."""
    program = tmp_path / "temp.cpp"
    program.write_text('#include <filesystem>\n#include <iostream>\n'
                       'int main() { std::cout << std::filesystem::temp_directory_path().string(); }\n')
    subprocess.run(["g++", "-std=c++17", "-o", str(tmp_path / "temp"), str(program)], check=True)
    names = ("MLX_PTX_CACHE_DIR", "TMPDIR", "TMP", "TEMP", "TEMPDIR")
    for env in ({}, {"TMP": str(tmp_path / "b"), "TMPDIR": str(tmp_path / "a")}, {"TEMP": str(tmp_path / "c")},
                {"TEMPDIR": str(tmp_path / "d"), "TEMP": str(tmp_path / "c")}):
        for name in names:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            Path(value).mkdir(exist_ok=True)
            monkeypatch.setenv(name, value)
        printed = subprocess.run([str(tmp_path / "temp")], env={**env, "PATH": os.environ["PATH"]},
                                 capture_output=True, text=True, check=True).stdout
        assert kernel_cache.mlx_cache_folder() == Path(printed) / "mlx" / mx.__version__ / "ptx", env
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "chosen"))
    assert kernel_cache.mlx_cache_folder() == tmp_path / "chosen"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", "")  # MLX then keeps no cache (no folder named "")
    assert kernel_cache.mlx_cache_folder() is None


def test_libmlx_is_found_where_mlx_finds_itself():
    """dladdr's path for libmlx (MLX's current_binary_dir: the path it was loaded by), in this
    process's MLX; its own handle answers for its functions."""
    library, path = kernel_cache.loaded_mlx()
    assert Path(path) == Path(mx.__file__).parent / "lib" / "libmlx.so"
    assert library._ZN3mlx4core7versionEv is not None


def test_sass_where_mlx_compiles_sass():
    assert kernel_cache.compiles_sass((13, 0), (9, 0)) and kernel_cache.compiles_sass((12, 8), (10, 0))
    assert kernel_cache.compiles_sass((11, 8), (9, 0))
    assert not kernel_cache.compiles_sass((11, 7), (9, 0)) and kernel_cache.compiles_sass((11, 7), (8, 6))
    assert not kernel_cache.compiles_sass((11, 0), (8, 6)) and kernel_cache.compiles_sass((11, 0), (8, 0))
    assert not kernel_cache.compiles_sass((10, 2), (8, 0)) and not kernel_cache.compiles_sass((8, 0), (5, 0))


@needs_gxx
def test_device_headers_come_from_the_symbol_table(tmp_path):
    """MLX's 17 JIT headers as its embed script names the arrays, in a library built here (with
    one more array MLX does not hand NVRTC); one missing, or a stripped library (no .symtab),
    is refused."""
    def library(stems, name):
        source = tmp_path / f"{name}.cpp"
        arrays = "".join(f'static const char jit_source_{stem}[] = "// {stem}\\n";\n' for stem in stems)
        table = ", ".join(f"jit_source_{stem}" for stem in stems)  # kept: the table points at them
        source.write_text(f"namespace mlx::core {{\n{arrays}const char* pick(int i) {{\n"
                          f"  static const char* all[] = {{{table}}};\n  return all[i];\n}}\n}}\n")
        path = tmp_path / f"{name}.so"
        subprocess.run(["g++", "-shared", "-fPIC", "-O1", "-o", str(path), str(source)], check=True)
        return str(path)

    stems = [name.rpartition(".")[0] for name in kernel_cache.MLX_JIT_HEADERS]
    headers = kernel_cache.mlx_device_headers(library([*stems, "gather"], "libmlx"))
    assert headers == {f"mlx/backend/cuda/device/{name}": f"// {name.rpartition('.')[0]}\n".encode()
                       for name in kernel_cache.MLX_JIT_HEADERS}
    assert "mlx/backend/cuda/device/config.h" in headers and len(headers) == 17
    with pytest.raises(ValueError, match="utils.cuh are not in"):
        kernel_cache.mlx_device_headers(library([stem for stem in stems if stem != "utils"], "partial"))
    if shutil.which("strip"):
        stripped = library(stems, "stripped")
        subprocess.run(["strip", stripped], check=True)
        with pytest.raises(ValueError, match="no symbol table"):
            kernel_cache.mlx_device_headers(stripped)


def _nvrtc_library():
    """The NVRTC wheel's library (tests/requirements.txt), its builtins loaded first: NVRTC opens
    them by name, which under libmlx its RPATH finds."""
    try:
        import nvidia.cu13
    except ImportError:
        pytest.skip("needs nvidia-cuda-nvrtc (tests/requirements.txt)")
    lib = Path(next(iter(nvidia.cu13.__path__))) / "lib"
    ctypes.CDLL(str(next(lib.glob("libnvrtc-builtins.so.*"))), mode=ctypes.RTLD_GLOBAL)
    return str(lib / "libnvrtc.so.13")


# What MLX's utils.cuh gives the qmv kernel (Shape) without CCCL, which only mlx-cuda brings.
_UTILS_STAND_IN = (b"#pragma once\n#include <cuda_fp16.h>\n"
                   b"namespace mlx::core::cu { struct Shape { int d[10];"
                   b" __device__ int operator[](int i) const { return d[i]; } }; }\n")


def test_nvrtc_compiles_a_pack_kernel_as_mlx_does(monkeypatch, tmp_path):
    """The 8-row qmv kernel's MLX text through NVRTC for the H100 and H200: a cubin, the same
    bytes every time, the kernel's lowered name; a source NVRTC refuses raises with its log."""
    nvrtc = _nvrtc_library()
    # mlx-cuda's layout: mlx/include/cccl beside site-packages' nvidia/cu13/include (the wheels')
    nvidia = Path(nvrtc).parents[2]
    if not (nvidia / "cu13" / "include" / "cccl").exists():
        pytest.skip("needs nvidia-cuda-cccl (tests/requirements.txt)")
    mlx_root = tmp_path / "site-packages" / "mlx"
    (mlx_root / "include").mkdir(parents=True)
    (mlx_root / "include" / "cccl").symlink_to(nvidia / "cu13" / "include" / "cccl")
    (mlx_root.parent / "nvidia").symlink_to(nvidia)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))  # not /usr/local/cuda
    with pytest.raises(FileNotFoundError, match="cccl is missing"):
        kernel_cache.Compiler(ctypes.CDLL(nvrtc), {}, tmp_path, (9, 0))
    compiler = kernel_cache.Compiler(ctypes.CDLL(nvrtc), {"mlx/backend/cuda/device/utils.cuh": _UTILS_STAND_IN},
                                     mlx_root, (9, 0))
    assert compiler.sass and compiler.options == [
        "--device-as-default-execution-space", "--gpu-architecture=sm_90a", f"--include-path={mlx_root / 'include'}",
        f"--include-path={mlx_root / 'include' / 'cccl'}", f"--include-path={mlx_root.parent / 'nvidia' / 'cu13' / 'include'}"]
    template = tuple(qmv._cuda_launch((8,), 17408)["template"])
    kernel = qmv._cuda_kernel()
    name = "custom_kernel_" + kernel._name + dflash2_kernel_base._template_suffix(template)
    inputs = [mx.zeros((8, 5120), mx.float16), mx.zeros((17408, 320), mx.uint32),
              mx.zeros((17408, 40), mx.float16), mx.zeros((17408, 40), mx.float16)]
    text = kernel_cache.mlx_kernel_source(name, kernel._made["header"],
                                          dflash2_kernel_base._template_lines(template) + kernel._source,
                                          kernel._made["input_names"], inputs, kernel._made["output_names"],
                                          [mx.float16])
    binary, lowered = compiler.compile("module", text, "mlx::core::cu::" + name)
    assert binary[:4] == b"\x7fELF" and name in lowered and lowered.startswith("_ZN3mlx4core2cu")
    for kept, data, whole in (("whole", binary, True), ("cut", binary[:-len(binary) // 3], False),
                              ("head", binary[:40], False)):
        (tmp_path / kept).write_bytes(data)
        assert whole_binary(tmp_path / kept) is whole, kept
    assert compiler.compile("module", text, "mlx::core::cu::" + name)[0] == binary
    with pytest.raises(RuntimeError, match="could not compile broken.*error"):
        compiler.compile("broken", text.replace("qmv_split_rows", "no_such_function"), "mlx::core::cu::" + name)


class _FakeCompiler:
    version = "fake"

    def __init__(self):
        self.calls = []

    def compile(self, module, text, kernel_name):
        self.calls.append((module, text, kernel_name))
        if "fails" in text:
            raise RuntimeError("NVRTC could not compile")
        return b"// PTX of " + module.encode() + b"\0", "_Z6lowered"


def test_prepare_leaves_what_mlx_reads_and_compiles_once(monkeypatch, tmp_path, fresh_counts):
    fake = _FakeCompiler()
    monkeypatch.setattr(kernel_cache, "compiler", lambda: fake)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    inputs = [mx.zeros((2, 4), mx.float16)]
    kernel_cache.prepare("k_1", "", "y[0] = x[0];", ["x"], inputs, ["y"], [mx.float16])
    (module, text, kernel_name), = fake.calls
    assert module == f"custom_kernel_k_1_{kernel_cache.std_hash(text.encode()):x}"
    assert kernel_name == "mlx::core::cu::custom_kernel_k_1"
    assert (tmp_path / f"{module}.ptx").read_bytes() == b"// PTX of " + module.encode() + b"\0"
    # MLX's read_cached_ptx: one "name<TAB>lowered" line per kernel
    assert (tmp_path / f"{module}.txt").read_text() == "mlx::core::cu::custom_kernel_k_1\t_Z6lowered\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == [f"{module}.ptx", f"{module}.txt"]  # no partials

    kernel_cache.prepare("k_1", "", "y[0] = x[0];", ["x"], inputs, ["y"], [mx.float16])  # another process's start
    assert len(fake.calls) == 1
    (tmp_path / f"{module}.txt").unlink()  # a binary without its names MLX cannot load: built again
    kernel_cache.prepare("k_1", "", "y[0] = x[0];", ["x"], inputs, ["y"], [mx.float16])
    assert len(fake.calls) == 2 and (tmp_path / f"{module}.txt").exists()
    (tmp_path / f"{module}.ptx").write_bytes(b"// PTX of")  # cut short (a crash, a full disk): again
    kernel_cache.prepare("k_1", "", "y[0] = x[0];", ["x"], inputs, ["y"], [mx.float16])
    assert len(fake.calls) == 3 and (tmp_path / f"{module}.ptx").read_bytes().endswith(b"\0")
    kernel_cache.prepare("k_1", "", "y[0] = x[0];", ["x"], [mx.zeros((2, 4), mx.float32)], ["y"], [mx.float16])
    assert len(fake.calls) == 4  # other dtypes: another module
    kernel_cache.prepare("k_2", "", "fails", ["x"], inputs, ["y"], [mx.float16])
    kernel_cache.prepare("k_3", "", "y[0] = 1;", ["x"], [1], ["y"], [mx.float16])  # a scalar input: MLX's
    assert kernel_cache._COUNTS == {"compiled": 4, "found": 1, "failed": 1}
    assert len(list(tmp_path.glob("*.ptx"))) == 2
    summary = kernel_cache.summary()
    assert "1 found there, 4 compiled and kept (fake)" in summary
    assert "1 left to MLX (the first: k_2: RuntimeError" in summary


def test_a_write_that_fails_leaves_nothing_behind(monkeypatch, tmp_path, fresh_counts):
    """A failed write (a full disk) leaves neither a partial file nor an entry: MLX compiles it."""
    monkeypatch.setattr(kernel_cache, "compiler", lambda: _FakeCompiler())
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kernel_cache.os, "replace", full)
    kernel_cache.prepare("k_1", "", "y[0] = x[0];", ["x"], [mx.zeros((2,), mx.float16)], ["y"], [mx.float16])
    assert kernel_cache._COUNTS["failed"] == 1 and list(tmp_path.iterdir()) == []


def test_nvidia_setup_names_the_gpus_driver_and_wheels(tmp_path):
    """What a kernel folder is for, read from the driver's /proc files (a copy here); none
    without them."""
    for index, model in enumerate(["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"]):
        (tmp_path / "gpus" / f"0000:0{index}:00.0").mkdir(parents=True)
        (tmp_path / "gpus" / f"0000:0{index}:00.0" / "information").write_text(f"Model: \t {model}\nIRQ: 1\n")
    (tmp_path / "version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15\nGCC version\n")
    setup = json.loads(dflash2_kernel_folder.nvidia_setup(tmp_path))
    assert setup["gpus"] == ["NVIDIA H100 80GB HBM3"] * 2 and setup["driver"].endswith("570.86.15")
    assert f"mlx=={mx.__version__}" in setup["packages"]
    assert dflash2_kernel_folder.nvidia_setup(tmp_path / "none") is None
    (tmp_path / "gpus" / "0000:01:00.0" / "information").write_text("Model: NVIDIA A100-SXM4-80GB\n")
    assert dflash2_kernel_folder.nvidia_setup(tmp_path) is None  # two models: no one folder suits both


def test_cut_entries_are_removed_whole_ones_kept(tmp_path):
    whole = bytearray(b"\x7fELF" + bytes(124))
    struct.pack_into("<QQ", whole, 0x20, 64, 96)  # program headers at 64, section headers at 96:
    struct.pack_into("<HHHH", whole, 0x36, 32, 1, 32, 1)  # both inside its 128 bytes
    entries = {"cubin": bytes(whole), "ptx": b"// PTX\0", "cut cubin": bytes(whole[:100]), "cut ptx": b"// PT",
               "empty": b"", "no names": b"// PTX\0", "zeros": bytes(100), "cut names": b"// PTX\0"}
    (tmp_path / "long").mkdir()
    for name, data in entries.items():
        binary = tmp_path / ("long" if name == "ptx" else ".") / f"{name.replace(' ', '_')}.ptx"
        binary.write_bytes(data)
        if name != "no names":
            binary.with_suffix(".txt").write_text("mlx::core::cu::k\t_Z1kv\n"[:-3 if name == "cut names" else None])
    (tmp_path / "a folder.ptx").mkdir()  # not an entry: left alone
    assert dflash2_kernel_folder.remove_cut_entries(tmp_path) == 6
    assert sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*.*")) == [
        "a folder.ptx", "cubin.ptx", "cubin.txt", "long/ptx.ptx", "long/ptx.txt"]


def test_baked_kernel_prepares_before_its_first_launch(monkeypatch, tmp_path, fresh_counts):
    """BakedCudaKernel hands prepare() the text MLX will build for the launch: its name with the
    template's suffix, the header, the constexpr lines and the launch's dtypes; once a template."""
    fake, launched = _FakeCompiler(), []
    monkeypatch.setattr(kernel_cache, "compiler", lambda: fake)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    # No CUDA here: MLX's kernel object replaced by one that records its launches.
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **made: lambda **launch: launched.append((made, launch)))
    kernel = dflash2_kernel_base.BakedCudaKernel(name="probe", input_names=["x"], output_names=["y"],
                                                 source="y[0] = x[0] * M;", header="// h\n")
    launch = dict(inputs=[mx.zeros((4,), mx.bfloat16)], output_shapes=[(4,)], output_dtypes=[mx.float32],
                  grid=(32, 1, 1), threadgroup=(32, 1, 1))
    kernel(template=[("M", 3), ("FAST", True)], **launch)
    kernel(template=[("M", 3), ("FAST", True)], **launch)
    (module, text, kernel_name), = fake.calls  # the first launch of a template only
    assert [made["name"] for made, _ in launched] == ["probe_3_t"] * 2 and launched[0][1] == launch
    assert kernel_name == "mlx::core::cu::custom_kernel_probe_3_t"
    assert text == kernel_cache.mlx_kernel_source(
        "custom_kernel_probe_3_t", "// h\n", "  constexpr int M = 3;\n  constexpr bool FAST = true;\n\ny[0] = x[0] * M;",
        ["x"], launch["inputs"], ["y"], [mx.float32])


def test_off_where_not_cuda_and_says_so(fresh_counts):
    if mx.cuda.is_available():
        pytest.skip("CUDA here")
    assert kernel_cache.compiler() is None and kernel_cache.binaries() == "MLX at each start"
    assert "MLX compiles each at its first launch" in kernel_cache.summary()


@pytest.mark.skipif(not mx.cuda.is_available(), reason="CUDA only")
def test_kernel_source_is_what_mlx_prints_it_builds(capfd):
    """MLX's own print of the source it builds (verbose=True) for the served 8-row and 1-row qmv:
    the text whose hash names the module."""
    weight, scales, biases = qmv.make_weights(16, 512, mx.random.key(0))
    x = dflash2_kernel_base.make_inputs("normal", 8, 512, mx.random.key(1))
    kernel = qmv._cuda_kernel()
    for rows in (1, 8):
        call = qmv._cuda_launch((rows,), 16)
        capfd.readouterr()
        mx.eval(kernel(inputs=[x[:rows], weight, scales, biases], verbose=True, **call))
        printed = capfd.readouterr().out
        template = tuple(call["template"])
        name = "custom_kernel_" + kernel._name + dflash2_kernel_base._template_suffix(template)
        text = kernel_cache.mlx_kernel_source(
            name, kernel._made["header"], dflash2_kernel_base._template_lines(template) + kernel._source,
            kernel._made["input_names"], [x[:rows], weight, scales, biases], kernel._made["output_names"],
            call["output_dtypes"])
        assert printed == f"Generated source code for `{name}`:\n```\n{text}\n```\n"


_PLANTED = """
import sys
import mlx.core as mx
sys.path.insert(0, {repo!r})
import dflash2_kernel_base, dflash2_kernel_cache as cache
kernel = dflash2_kernel_base.BakedCudaKernel(name="dflash2_probe", input_names=["x"], output_names=["y"],
                                             source="  y[threadIdx.x] = x[threadIdx.x] * 2.0f;")
x = mx.arange(32, dtype=mx.float32)
if sys.argv[1] == "plant":  # under the name MLX gives the doubling kernel: a tripling one's binary
    text = cache.mlx_kernel_source("custom_kernel_dflash2_probe", "", kernel._source, ["x"], [x], ["y"], [mx.float32])
    module = f"custom_kernel_dflash2_probe_{{cache.std_hash(text.encode()):x}}"
    binary, lowered = cache.compiler().compile(module, text.replace("* 2.0f", "* 3.0f"),
                                               "mlx::core::cu::custom_kernel_dflash2_probe")
    path = cache.module_path(cache.mlx_cache_folder(), module)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".txt").write_text(f"mlx::core::cu::custom_kernel_dflash2_probe\\t{{lowered}}\\n")
    path.write_bytes(binary)
else:
    print(kernel(inputs=[x], output_shapes=[(32,)], output_dtypes=[mx.float32], grid=(32, 1, 1),
                 threadgroup=(32, 1, 1))[0][:3].tolist())
"""


@pytest.mark.skipif(not mx.cuda.is_available(), reason="CUDA only")
def test_mlx_runs_the_binary_left_under_the_module_name(tmp_path):
    """The decisive check of the name, the entry's format and the compile: a binary compiled here
    from a tripling body, left under the name of a doubling kernel, is what MLX runs for it in
    a new process (the cache's own step off); with the folder empty MLX compiles the doubling."""
    script = tmp_path / "planted.py"
    script.write_text(_PLANTED.format(repo=str(REPO)))

    def run(mode, folder):
        env = {**os.environ, "MLX_PTX_CACHE_DIR": str(folder), "DFLASH2_KERNEL_CACHE": "1" if mode == "plant" else "0"}
        return subprocess.run([sys.executable, str(script), mode], env=env, capture_output=True, text=True,
                              check=True).stdout.strip()

    run("plant", tmp_path / "ptx")
    assert run("run", tmp_path / "ptx") == "[0.0, 3.0, 6.0]"
    assert run("run", tmp_path / "empty") == "[0.0, 2.0, 4.0]"


_TWO_PROCESSES = """
import sys, time, numpy as np, mlx.core as mx
sys.path.insert(0, {repo!r})
import dflash2_kernel_cache, dflash2_kernel_qmv as qmv
mx.random.seed(0)
x = mx.random.normal((8, 5120)).astype(mx.float16)
w = mx.random.randint(0, 2**31, (4096, 320)).astype(mx.uint32)
scales = (mx.random.uniform(shape=(4096, 40)) * 0.01).astype(mx.float16)
biases = (mx.random.normal((4096, 40)) * 0.01).astype(mx.float16)
mx.eval(x, w, scales, biases)
start = time.perf_counter()
y = qmv.cuda_matmul(x, w, scales, biases)
mx.eval(y)
print(time.perf_counter() - start, dflash2_kernel_cache._COUNTS, flush=True)
np.save(sys.argv[1], np.array(y.view(mx.uint16)))
"""


@pytest.mark.skipif(not mx.cuda.is_available(), reason="CUDA only")
def test_a_second_process_loads_the_first_ones_binary(tmp_path):
    """On a GPU: the first process compiles and keeps the 8-row qmv; the second finds it whole and
    computes the same bits (that MLX runs what it finds: the planted binary's test)."""
    script = tmp_path / "run.py"
    script.write_text(_TWO_PROCESSES.format(repo=str(REPO)))
    env = {**os.environ, "MLX_PTX_CACHE_DIR": str(tmp_path / "ptx"), "PYTHONUNBUFFERED": "1"}
    runs = [subprocess.run([sys.executable, str(script), str(tmp_path / f"y{i}.npy")], env=env,
                           capture_output=True, text=True, check=True).stdout.split(" ", 1) for i in range(2)]
    (_, first_counts), (_, second_counts) = runs
    assert "'compiled': 1" in first_counts and "'found': 1" in second_counts and "'compiled': 0" in second_counts
    import numpy as np
    assert np.array_equal(np.load(tmp_path / "y0.npy"), np.load(tmp_path / "y1.npy"))
