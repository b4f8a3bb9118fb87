"""The pack's CUDA kernels compiled once per machine instead of once per start.

MLX compiles a custom CUDA kernel with NVRTC at its first launch in every process and keeps no
binary of it, yet before compiling any module its JIT looks for one in its PTX cache
(mlx/backend/cuda/jit_module.cpp: JitModule reads `<cache>/<module>.ptx` and `.txt` first and
only skips writing them for custom kernels). Each of the pack's kernels is compiled here as
MLX would compile it and left in that cache under the module name MLX looks for, so a restart
loads the binary (a cached start's verify self-check spent 44 s compiling on the H100 at
7d92955; 3 s with the binaries kept, evidence/starts-cuda.md at 23e968f). The binary is the one MLX would make: the source MLX's build_kernel
writes (custom_kernel.cpp), MLX's own device headers (its jit_source_* arrays, read from
libmlx's symbol table), the NVRTC library MLX loaded and MLX's options. Any step that fails
leaves the cache alone and MLX compiles as before; mlx-cuda is pinned (requirements.txt) and
docs/runtime-design.md names what this reads of it.
"""

import ctypes
import os
import struct
import threading
from functools import cache
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from dflash2_kernel_folder import whole_binary

_LOCK = threading.Lock()
_COUNTS = {"compiled": 0, "found": 0, "failed": 0}
_FIRST_FAILURE = []

# MLX's custom-kernel preamble (custom_kernel.cpp: default_header) and dtype names
# (utils.cpp: dtype_to_cuda_type)
_DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
_CUDA_TYPES = {
    mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
    mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
    mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float", mx.float64: "double",
}
_MASK = (1 << 64) - 1


def mlx_kernel_source(kernel_name, header, source, input_names, inputs, output_names, output_dtypes) -> str:
    """The source MLX's build_kernel writes for a custom kernel launched with no template
    arguments (BakedCudaKernel writes its template into `source`): MLX's preamble, the header,
    the signature (an input's shape, strides and ndim only where `source` names them, and never
    for a 0-d input), then the body."""
    lines = [_DEFAULT_HEADER, header, "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n",
             f"__global__ void {kernel_name}(\n"]
    for name, array in zip(input_names, inputs):
        lines.append(f"    const {_CUDA_TYPES[array.dtype]}* {name},\n")
        if array.ndim > 0:
            for suffix, kind in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
                if name + suffix in source:
                    lines.append(f"    const __grid_constant__ {kind} {name}{suffix},\n")
    lines.append(",\n".join(f"    {_CUDA_TYPES[dtype]}* {name}" for name, dtype in zip(output_names, output_dtypes)))
    lines.append(") {\n" + source + "\n}\n\n} // namespace mlx::core::cu\n")
    return "".join(lines)


def std_hash(data: bytes) -> int:
    """libstdc++'s std::hash<std::string> on 64-bit Linux (_Hash_bytes, seed 0xc70f6907): MLX
    names a custom kernel's module `<name>_<hash of its source, hex>`."""
    mul = (0xC6A4A793 << 32) + 0x5BD1E995

    def shift_mix(v):
        return v ^ (v >> 47)

    length = len(data)
    aligned = length & ~7
    value = 0xC70F6907 ^ ((length * mul) & _MASK)
    for (word,) in struct.iter_unpack("<Q", data[:aligned]):
        value = ((value ^ ((shift_mix((word * mul) & _MASK) * mul) & _MASK)) * mul) & _MASK
    if length & 7:
        value = ((value ^ int.from_bytes(data[aligned:], "little")) * mul) & _MASK
    value = (shift_mix(value) * mul) & _MASK
    return shift_mix(value)


def module_path(folder: Path, module_name: str) -> Path:
    """Where MLX's get_ptx_path looks for a module: names over 245 characters split into folders."""
    limit, parts = 245, []
    while len(module_name) > limit:
        parts.append(module_name[:limit])
        module_name = module_name[limit:]
    return folder.joinpath(*parts, module_name + ".ptx")


def mlx_cache_folder() -> Optional[Path]:
    """MLX's ptx_cache_dir: MLX_PTX_CACHE_DIR, else the temporary folder (as libstdc++'s
    temp_directory_path finds it: the first of these variables set) / mlx / <version> / ptx.
    None where MLX keeps none: MLX_PTX_CACHE_DIR set empty (no folder), TMPDIR set empty (it
    throws)."""
    if "MLX_PTX_CACHE_DIR" in os.environ:
        chosen = os.environ["MLX_PTX_CACHE_DIR"]
        return Path(chosen).absolute() if chosen else None
    temporary = next((os.environ[name] for name in ("TMPDIR", "TMP", "TEMP", "TEMPDIR") if name in os.environ), "/tmp")
    return Path(temporary) / "mlx" / mx.__version__ / "ptx" if temporary else None


# ===========================================================================
# MLX's device headers, read from libmlx's symbol table


def elf_arrays(path: str, prefix: bytes) -> dict:
    """{symbol name: its bytes} for every sized symbol whose name starts with `prefix` in an
    ELF64 little-endian file's .symtab (the linker's full table, which MLX's wheel keeps)."""
    with open(path, "rb") as elf:
        head = elf.read(64)
        if head[:6] != b"\x7fELF\x02\x01":
            raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
        shoff, = struct.unpack_from("<Q", head, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
        elf.seek(shoff)
        # (name, type, flags, addr, offset, size, link, info, addralign, entsize)
        sections = [struct.unpack("<IIQQQQIIQQ", elf.read(shentsize)[:64]) for _ in range(shnum)]
        symtab = next((s for s in sections if s[1] == 2), None)  # SHT_SYMTAB
        if symtab is None:
            raise ValueError(f"{path} keeps no symbol table")

        def read(offset, size):
            elf.seek(offset)
            return elf.read(size)

        names = read(sections[symtab[6]][4], sections[symtab[6]][5])
        symbol = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                           ("value", "<u8"), ("size", "<u8")])
        table = np.frombuffer(read(symtab[4], symtab[5]), dtype=symbol)
        starts, at = [], names.find(prefix)
        while at >= 0:
            starts.append(at)
            at = names.find(prefix, at + 1)
        found = {}
        for entry in table[np.isin(table["name"], np.array(starts, dtype=np.uint32))]:
            index = int(entry["shndx"])
            if entry["size"] == 0 or not 0 < index < len(sections) or sections[index][1] == 8:  # 8: SHT_NOBITS
                continue
            name = names[entry["name"]:names.index(b"\0", entry["name"])].decode()
            section = sections[index]
            data = read(section[4] + int(entry["value"]) - section[3], int(entry["size"]))
            if found.setdefault(name, data) != data:
                raise ValueError(f"{name} has two different definitions in {path}")
        return found


# jit_module.cpp's g_include_names (mlx/backend/cuda/device/...): what MLX hands NVRTC
MLX_JIT_HEADERS = ("atomic_ops.cuh", "binary_ops.cuh", "cast_op.cuh", "config.h", "complex.cuh", "cute_dequant.cuh",
                   "fp16_math.cuh", "gemm_sm70.cuh", "hadamard.cuh", "indexing.cuh", "qmm_naive.cuh", "qmm_sm80.cuh",
                   "qmm_sm90.cuh", "scatter_ops.cuh", "unary_ops.cuh", "ternary_ops.cuh", "utils.cuh")


def mlx_device_headers(library: str) -> dict:
    """{include name: text} of the headers MLX's JIT hands NVRTC: g_include_names, each the
    array `mlx::core::jit_source_<stem>` in libmlx's symbol table."""
    arrays = {symbol.partition("jit_source_")[2].removesuffix("E"): data
              for symbol, data in elf_arrays(library, b"_ZN3mlx4coreL").items()}
    missing = [name for name in MLX_JIT_HEADERS if name.rpartition(".")[0] not in arrays]
    if missing:
        raise ValueError(f"MLX's device headers {', '.join(missing)} are not in {library}'s symbol table")
    return {f"mlx/backend/cuda/device/{name}": arrays[name.rpartition(".")[0]].rstrip(b"\0") for name in MLX_JIT_HEADERS}


# ===========================================================================
# NVRTC, as MLX calls it


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def loaded_mlx() -> tuple:
    """(libmlx as this process loaded it, its path as MLX's current_binary_dir gives it: dladdr
    on one of its functions, the path it was loaded by, links not resolved). Symbols looked up
    in the handle resolve through libmlx's own dependencies: NVRTC's are the library MLX calls."""
    library = ctypes.CDLL("libmlx.so", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # only the loaded one
    info = _DlInfo()
    function = ctypes.cast(library._ZN3mlx4core7versionEv, ctypes.c_void_p)  # mlx::core::version()
    if not ctypes.CDLL(None).dladdr(function, ctypes.byref(info)) or not info.dli_fname:
        raise OSError("dladdr found no file for libmlx")
    return library, os.fsdecode(info.dli_fname)


def compiles_sass(nvrtc: tuple, capability: tuple) -> bool:
    """MLX's compiler_supports_device_sass: whether NVRTC (major, minor) builds the device's
    SASS (a cubin) rather than PTX."""
    if nvrtc[0] < 9:
        return False
    newest = {9: (7, 2), 10: (7, 5)}.get(nvrtc[0])
    if newest is None and nvrtc[0] == 11 and nvrtc[1] < 8:
        newest = (8, 0) if nvrtc[1] == 0 else (8, 6)
    return newest is None or capability <= newest


class Compiler:
    """NVRTC with MLX's options for a device (jit_module.cpp: compile, include_path_args).
    nvrtc: a library handle NVRTC's functions resolve in; headers: mlx_device_headers();
    mlx_root: the mlx package folder (libmlx's lib/ above); capability: the device's (major,
    minor). Where MLX would take a folder this cannot see (CCCL's from its build) it refuses."""

    def __init__(self, nvrtc, headers: dict, mlx_root: Path, capability: tuple):
        self.headers = headers
        self.nvrtc = nvrtc
        self.nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.sass = compiles_sass((major.value, minor.value), tuple(capability))
        arch = f"{'sm' if self.sass else 'compute'}_{capability[0]}{capability[1]}{'a' if capability[0] >= 9 else ''}"
        include, cccl = mlx_root / "include", mlx_root / "include" / "cccl"
        if not cccl.exists():
            raise FileNotFoundError(f"{cccl} is missing: MLX would read the CCCL of its own build")
        cuda = mlx_root.parent / "nvidia" / ("cu13" if major.value >= 13 else "cuda_runtime") / "include"
        if not cuda.exists():
            cuda = Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda") / "include"
        if not cuda.exists():
            raise FileNotFoundError("no CUDA headers (MLX would stop too)")
        self.options = ["--device-as-default-execution-space", f"--gpu-architecture={arch}", f"--include-path={include}",
                        f"--include-path={cccl}", f"--include-path={cuda}"]
        self.version = f"NVRTC {major.value}.{minor.value}, {arch}"

    def _check(self, result, call):
        if result != 0:
            raise RuntimeError(f"{call} failed: {self.nvrtc.nvrtcGetErrorString(result).decode()}")

    def compile(self, module_name: str, source: str, kernel_name: str) -> tuple:
        """(binary, lowered kernel name) of `source` compiled as MLX compiles a module."""
        names = list(self.headers)
        array = ctypes.c_char_p * len(names)
        program = ctypes.c_void_p()
        self._check(self.nvrtc.nvrtcCreateProgram(
            ctypes.byref(program), source.encode(), f"{module_name}.cu".encode(), len(names),
            array(*(self.headers[name] for name in names)), array(*(name.encode() for name in names))),
            "nvrtcCreateProgram")
        try:
            self._check(self.nvrtc.nvrtcAddNameExpression(program, kernel_name.encode()), "nvrtcAddNameExpression")
            options = (ctypes.c_char_p * len(self.options))(*(option.encode() for option in self.options))
            result = self.nvrtc.nvrtcCompileProgram(program, len(self.options), options)
            if result != 0:
                size = ctypes.c_size_t()
                self.nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value + 1)
                self.nvrtc.nvrtcGetProgramLog(program, log)
                raise RuntimeError(f"NVRTC could not compile {module_name}: {log.value.decode()[-2000:]}")
            lowered = ctypes.c_char_p()
            self._check(self.nvrtc.nvrtcGetLoweredName(program, kernel_name.encode(), ctypes.byref(lowered)),
                        "nvrtcGetLoweredName")
            size_call, get_call = ("nvrtcGetCUBINSize", "nvrtcGetCUBIN") if self.sass else ("nvrtcGetPTXSize", "nvrtcGetPTX")
            size = ctypes.c_size_t()
            self._check(getattr(self.nvrtc, size_call)(program, ctypes.byref(size)), size_call)
            binary = ctypes.create_string_buffer(size.value)
            self._check(getattr(self.nvrtc, get_call)(program, binary), get_call)
            return binary.raw, lowered.value.decode()
        finally:
            self.nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


@cache
def compiler():
    """The compiler, or None where the cache cannot serve (not CUDA, DFLASH2_KERNEL_CACHE=0,
    or a part of MLX not where this module reads it: the first failure is kept for the log)."""
    if os.environ.get("DFLASH2_KERNEL_CACHE", "1") == "0" or not mx.cuda.is_available():
        return None
    try:
        library, path = loaded_mlx()
        info = mx.device_info()
        return Compiler(library, mlx_device_headers(path), Path(path).parent.parent,
                        (info["compute_capability_major"], info["compute_capability_minor"]))
    except Exception as error:  # noqa: BLE001 - any failure: MLX compiles as before
        _FIRST_FAILURE.append(f"{type(error).__name__}: {error}")
        return None


# ===========================================================================
# The step BakedCudaKernel takes before a kernel's first launch


def _write(path: Path, data: bytes):
    """Whole or not at all, on disk before its name: a cache entry outlives the process."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        with open(partial, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _entry_is_whole(path: Path, kernel: str) -> bool:
    """Whether MLX can load the entry: its names file the one line `kernel<TAB>lowered name`,
    its binary whole."""
    try:
        names = path.with_suffix(".txt").read_bytes()
        lowered = names[len(kernel) + 1:-1]
        return (names.startswith(f"{kernel}\t".encode()) and names.endswith(b"\n") and bool(lowered)
                and b"\n" not in lowered and whole_binary(path))
    except OSError:
        return False


def prepare(kernel_name, header, source, input_names, inputs, output_names, output_dtypes) -> None:
    """Leave this launch's module in MLX's PTX cache unless it is there: MLX then loads it instead
    of compiling. The kernel names file goes first, as MLX reads the binary's presence as the
    whole entry's."""
    built, folder = compiler(), mlx_cache_folder()
    if built is None or folder is None or not all(isinstance(x, mx.array) for x in inputs):
        return
    try:
        full_name = "custom_kernel_" + kernel_name
        text = mlx_kernel_source(full_name, header, source, input_names, inputs, output_names, output_dtypes)
        module = f"{full_name}_{std_hash(text.encode()):x}"
        path, kernel = module_path(folder, module), "mlx::core::cu::" + full_name
        if _entry_is_whole(path, kernel):
            outcome = "found"
        else:
            binary, lowered = built.compile(module, text, kernel)
            path.parent.mkdir(parents=True, exist_ok=True)
            _write(path.with_suffix(".txt"), f"{kernel}\t{lowered}\n".encode())
            _write(path, binary)
            _sync_folder(path.parent)
            outcome = "compiled"
    except Exception as error:  # noqa: BLE001 - MLX compiles this one itself
        outcome = "failed"
        _FIRST_FAILURE.append(f"{kernel_name}: {type(error).__name__}: {error}")
    with _LOCK:
        _COUNTS[outcome] += 1


def _sync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def binaries() -> str:
    """Who compiles the pack's kernels here (a verdict cache key's part)."""
    built = compiler()
    return "MLX at each start" if built is None else f"this cache ({built.version})"


def summary() -> str:
    """One log line: what the kernel cache did in this process."""
    built = compiler()
    if built is None:
        reason = _FIRST_FAILURE[0] if _FIRST_FAILURE else "off here (not CUDA, or DFLASH2_KERNEL_CACHE=0)"
        return f"kernel binaries: MLX compiles each at its first launch ({reason})"
    text = (f"kernel binaries in {mlx_cache_folder()}: {_COUNTS['found']} found there, "
            f"{_COUNTS['compiled']} compiled and kept ({built.version})")
    if _COUNTS["failed"]:
        text += f"; {_COUNTS['failed']} left to MLX (the first: {_FIRST_FAILURE[0]})"
    return text
