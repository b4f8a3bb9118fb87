"""The kernel lab's tools (tools/lab/), in what runs without a GPU or the CUDA toolkit.

tools/lab/qmv_sass.py compiles with nvcc (tests/test_kernel_qmv.py runs that where nvcc
exists); here, the translation unit it hands nvcc and its reading of nvdisasm's listing.
kernel_parity, compare_qmv_launch, ncu_summary and profile_verify are tested in
tests/test_evidence_tools.py and tests/test_kernel_qmv.py."""

import sys
from pathlib import Path

import pytest

import dflash2_kernel_qmv as qmv

REPO = Path(__file__).resolve().parents[1]

# nvdisasm -c's listing: labels, then each instruction with its address and encoding. An inner
# loop (.L_x_2) inside an outer one (.L_x_1), a forward branch, and a one-instruction self-loop
# (the kernel's trailing trap), which is no loop body.
SASS = """\
        .text.qmv:
.L_x_0:
        /*0000*/                   MOV R1, c[0x0][0x28] ;                  /* 0x00000a0000017a02 */
.L_x_1:
        /*0010*/                   HFMA2 R4, R2, R3, R4 ;                  /* 0x0000000302047231 */
.L_x_2:
        /*0020*/                   LDG.E.CONSTANT R2, desc[UR4][R6.64] ;   /* 0x0000000406027981 */
        /*0030*/              @P0 HFMA2.MMA R5, R2, R3, R5 ;               /* 0x0000000302050235 */
        /*0040*/                   HFMA2 R4, R2, R3, R4 ;                  /* 0x0000000302047231 */
        /*0050*/              @P1 BRA `(.L_x_2) ;                          /* 0xfffffffc00f01947 */
        /*0060*/                   IADD3 R6, R6, 0x1, RZ ;                 /* 0x0000000106067810 */
        /*0070*/             @!P2 BRA `(.L_x_1) ;                          /* 0xfffffff800f0a947 */
        /*0080*/              @P3 BRA `(.L_x_3) ;                          /* 0x0000000000003947 */
        /*0090*/                   EXIT ;                                  /* 0x000000000000794d */
.L_x_3:
        /*00a0*/                   BRA `(.L_x_3) ;                         /* 0xfffffff000007947 */
"""


def test_qmv_sass_counts_each_loop_s_instructions_and_hfma2s():
    from qmv_sass import loops

    # Inner loop first: its 4 instructions (2 HFMA2s, a predicated one counted as its opcode),
    # then the outer one's 7, the inner one's included; no forward branch or self-loop.
    assert loops(SASS) == [{"instructions": 4, "hfma2": 2}, {"instructions": 7, "hfma2": 3}]
    assert loops("") == []


def test_qmv_sass_writes_the_unit_mlx_builds_for_a_launch():
    """The translation unit: MLX's includes and Shape, the kernels' header, the qmv signature,
    then the template's constexpr lines (the launch's fields in cuda_launch_fields' order)
    before the kernel source; with no launch named, the table's."""
    from qmv_sass import translation_unit

    unit = translation_unit(8, (2, 2, 1, 1, 264))
    constexprs = ["  constexpr int M = 8;", "  constexpr int S = 1;", "  constexpr int R = 2;", "  constexpr int C = 2;",
                  "  constexpr int PREFETCH = 1;", "  constexpr bool TILES = true;", "  constexpr bool SWIZZLED = false;"]
    assert unit.index("using Shape = cuda::std::array<int32_t, 10>;") < unit.index(qmv._CUDA_HEADER)
    signature, body = unit.split("    __half* y) {\n")
    assert signature.endswith("__global__ void qmv(\n    const __half* x,\n    const uint32_t* w,\n"
                              "    const __grid_constant__ Shape w_shape,\n    const __half* scales,\n"
                              "    const __half* biases,\n")
    assert body.startswith("\n".join(constexprs) + "\n\n" + qmv._CUDA_SOURCE)
    assert unit.count("{") == unit.count("}")
    assert "  constexpr bool TILES = false;" in translation_unit(8, (4, 2, 1, 2))  # an uncapped grid
    for rows, launch in qmv.CUDA_LAUNCH.items():
        assert translation_unit(rows) == translation_unit(rows, launch)
        assert f"  constexpr int M = {rows};" in translation_unit(rows)


def test_qmv_sass_needs_nvcc(monkeypatch):
    import qmv_sass

    monkeypatch.setattr(qmv_sass.shutil, "which", lambda name: None)
    monkeypatch.setattr(sys, "argv", ["qmv_sass.py", "--rows", "8"])
    with pytest.raises(SystemExit) as refused:
        qmv_sass.main()
    assert refused.value.code == 2


def test_the_decode_probe_times_each_condition_once_a_sample(target):
    """tools/lab/decode_probe.py's arms on the tiny pack (runtime installed): six conditions,
    each sample a positive ms per step, and its summary names every arm."""
    sys.path.insert(0, str(REPO / "tools" / "lab"))
    from decode_probe import probe_arms, summary

    lm = target[0].language_model
    arms = probe_arms(lm, [0], context=8, long=16)
    assert list(arms) == ["pipelined, 4-token cache", "pipelined, prompt cache", "pipelined, prompt cache, batch stream",
                          "evaluated alone, batch stream", "pipelined, prompt + 16 tokens",
                          "pipelined, after a verify round"]
    samples = {name: sample() for name, sample in arms.items()}
    assert all(ms > 0 for ms in samples.values()), samples
    record = {"backend": "cpu", "device": "x", "command": "c", "git_commit": "0" * 40, "git_clean": True,
              "plain_decode_path": "mlx", "repeats": 1,
              "step_ms": {name: {"median": ms, "min": ms, "max": ms} for name, ms in samples.items()},
              "ratio_to_first": {name: 1.0 for name in samples}}
    assert all(f"| {name} |" in summary(record) for name in arms)
