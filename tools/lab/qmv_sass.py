"""The exact CUDA qmv kernel compiled offline (nvcc for sm_90a): registers, spills and its loops'
instructions, per row count's launch, with no GPU.

    python tools/lab/qmv_sass.py                                  # the launch table
    python tools/lab/qmv_sass.py --rows 8 --launch '{"8": [2, 1, 1, 1, 264]}'

A kernel change's first check, before device time: the translation unit MLX builds for a
launch (its CUDA custom-kernel wrapper around dflash2_kernels' header, the template's constexpr
lines and the source; Shape as MLX declares it) through nvcc -cubin, ptxas's register count and
spill bytes, and where nvdisasm is on PATH (pip install nvidia-cuda-nvdisasm) each loop's
instructions and HFMA2s: the weight-step loop's count is what a step costs a warp. The H200's
NVRTC is another CUDA version, so a count can differ there by a register or two (the 8-row
(4, 2, 1, 2) launch: ncu 254 registers, nvcc 13.0 254).
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

import dflash2_kernel_base  # noqa: E402
import dflash2_kernel_qmv as qmv  # noqa: E402
import dflash2_kernel_qmv32 as qmv32  # noqa: E402

ARCH = "sm_90a"  # the H200's, as MLX's NVRTC call names it (jit_module.cpp: sm_90 + "a")


def kernel_unit(name: str, params, header: str, template, source: str) -> str:
    """The source MLX's build_kernel writes for one call of a custom kernel: its includes and
    Shape, the kernel's header, the signature (params: one "type name" each), the template's
    constexpr lines, then the source."""
    return kernels_unit({name: template}, params, header, source)


def kernels_unit(templates: dict, params, header: str, source: str) -> str:
    """kernel_unit's source with one kernel per template (name -> template): one nvcc run
    compiles them all, where its start-up is most of a one-kernel compile."""
    return (
        "#include <cooperative_groups.h>\n#include <cuda_fp16.h>\n#include <cuda/std/array>\n"
        "using Shape = cuda::std::array<int32_t, 10>;  // MLX's, MAX_NDIM 10\n"
        + header
        + "".join(
            "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            + f"__global__ void {name}(\n" + "".join(f"    {param},\n" for param in params[:-1]) + f"    {params[-1]}) {{\n"
            + dflash2_kernel_base._template_lines(template) + source
            + "\n}\n\n} // namespace mlx::core::cu\n"
            for name, template in templates.items())
    )


QMV_PARAMS = ("const __half* x", "const uint32_t* w", "const __grid_constant__ Shape w_shape",
              "const __half* scales", "const __half* biases", "__half* y")


def _template(rows: int, launch=None):
    return qmv._cuda_launch.__wrapped__((rows,), 17408, launch and tuple(launch))["template"]


def translation_unit(rows: int, launch=None) -> str:
    """The source MLX's build_kernel writes for the kernel's call at `rows` rows (launch: the
    table's by default; K and N are read at run time, so any call of that launch)."""
    return kernel_unit("qmv", QMV_PARAMS, qmv._CUDA_HEADER, _template(rows, launch), qmv._CUDA_SOURCE)


def launches_unit(launches: dict) -> str:
    """One unit with translation_unit's kernel for each name -> (rows, launch)."""
    templates = {name: _template(rows, launch) for name, (rows, launch) in launches.items()}
    return kernels_unit(templates, QMV_PARAMS, qmv._CUDA_HEADER, qmv._CUDA_SOURCE)


QMV32_PARAMS = ("const float* x", "const uint32_t* w", "const __grid_constant__ Shape w_shape",
                "const __half* scales", "const __half* biases", "float* y")


def fp32_translation_unit(rows: int, variant: str = "fma") -> str:
    """The same for dflash2_kernel_qmv32's kernel (fp32 rows) at `rows` rows, one variant."""
    return fp32_launches_unit({"qmv32": rows}, variant)


def fp32_launches_unit(rows_by_name: dict, variant: str = "fma") -> str:
    """One unit with fp32_translation_unit's kernel for each name -> rows."""
    templates = {name: qmv32.cuda_template(rows, variant) for name, rows in rows_by_name.items()}
    return kernels_unit(templates, QMV32_PARAMS, qmv32._CUDA_HEADER, qmv32._CUDA_SOURCE)


def _compile(unit: str, folder: str) -> tuple:
    """(ptxas's -v report, the cubin's path) of the unit compiled for ARCH."""
    source, cubin = Path(folder) / "qmv.cu", Path(folder) / "qmv.cubin"
    source.write_text(unit)
    built = subprocess.run(["nvcc", f"-arch={ARCH}", "-cubin", "-Xptxas", "-v", "-o", str(cubin), str(source)],
                           capture_output=True, text=True)
    if built.returncode:
        raise RuntimeError(f"nvcc failed:\n{built.stderr[-3000:]}")
    return built.stderr, cubin


def _registers_and_spills(report: str) -> dict:
    return {"registers": int(re.search(r"Used (\d+) registers", report).group(1)),
            "spill_bytes": int(re.search(r"(\d+) bytes spill stores", report).group(1))}


def compile_report(unit: str) -> dict:
    """{"registers", "spill_bytes", "loops": [{"instructions", "hfma2"}] (nvdisasm only)} of a
    one-kernel unit."""
    with tempfile.TemporaryDirectory() as folder:
        stderr, cubin = _compile(unit, folder)
        report = _registers_and_spills(stderr)
        if shutil.which("nvdisasm"):
            sass = subprocess.run(["nvdisasm", "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
            report["loops"] = loops(sass)
    return report


def compile_reports(unit: str, names) -> dict:
    """name -> {"registers", "spill_bytes"} for each kernel of a kernels_unit, one nvcc run."""
    with tempfile.TemporaryDirectory() as folder:
        stderr, _ = _compile(unit, folder)
    per_entry = stderr.split("Compiling entry function '")[1:]
    # An entry's mangled name starts _ZN3mlx4core2cu<length><name>E (mlx::core::cu::name(...)).
    return {name: _registers_and_spills(next(entry for entry in per_entry
                                             if entry.startswith(f"_ZN3mlx4core2cu{len(name)}{name}E")))
            for name in names}


def loops(sass: str) -> list:
    """Each backward branch's loop body: its instructions and HFMA2s, as nvdisasm prints them
    (an inner loop first)."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        instruction = re.match(r"^\s+/\*[0-9a-f]{4}\*/\s+(.*?);", line)
        if instruction:
            instructions.append(instruction.group(1))
    found = []
    for end, text in enumerate(instructions):
        target = re.search(r"BRA `\((\.L_x_\d+)\)", text)
        if target and labels.get(target.group(1), end + 1) <= end:
            body = instructions[labels[target.group(1)]:end + 1]
            opcodes = Counter(re.sub(r"^@!?U?P\w+ ", "", op).split()[0].split(".")[0] for op in body)
            if len(body) > 1:
                found.append({"instructions": len(body), "hfma2": opcodes["HFMA2"]})
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launch", default="{}", help="JSON: rows -> launch (R, C, prefetch[, S[, B]]); "
                                                      "rows not named take CUDA_LAUNCH's")
    parser.add_argument("--rows", default=",".join(map(str, qmv.CUDA_LAUNCH)), help="comma-separated row counts")
    args = parser.parse_args()
    if not shutil.which("nvcc"):
        parser.error("needs nvcc on PATH (the CUDA toolkit)")
    launches = {**qmv.CUDA_LAUNCH, **{int(rows): tuple(launch) for rows, launch in json.loads(args.launch).items()}}
    print("| rows | launch | registers | spill bytes | loops (instructions / HFMA2) |\n|---|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        report = compile_report(translation_unit(rows, launches[rows]))
        shown = ", ".join(f"{loop['instructions']} / {loop['hfma2']}" for loop in report.get("loops", [])) or "no nvdisasm"
        print(f"| {rows} | {launches[rows]} | {report['registers']} | {report['spill_bytes']} | {shown} |", flush=True)


if __name__ == "__main__":
    main()
