"""The evidence and lab tools' records and summaries, on the committed records and small
synthetic ones, and README's results table written from the records."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EVIDENCE = REPO / "evidence"


def test_a_split_bench_record_keeps_each_phase_s_own_process():
    """tools/bench.py --part e2e on a round-phase record, twice: the round phase's command,
    repeats and decode path stay under round_process; the summary names both phases."""
    from bench import ROUND_PROCESS_KEYS, start_e2e_phase
    from bench_summary import summary_markdown

    rounds = json.loads((EVIDENCE / "bench-cuda-27b.json").read_text())
    for key in ("round_process", "e2e_ms"):
        rounds.pop(key)
    rounds.update(complete=False, command="python tools/bench.py --part rounds", repeats=7, code="c0de0f0a0000")
    rounds["plain_decode_path"] = {**rounds["plain_decode_path"], "arm": "rotation"}
    first_phase = {key: rounds.get(key) for key in ROUND_PROCESS_KEYS}  # git_commit: None, from before it
    for run in range(2):
        process = {"command": f"python tools/bench.py --part e2e # {run}", "repeats": 5, "tokens": 32, "code": f"e2e{run}",
                   "plain_decode_path": {"arm": f"arm {run}", "why": "measured", "step_ms_by_arm": {}},
                   "runtime_status": {}, "round_costs": rounds["round_costs"], "drafter_dtype_by_form": {}}
        start_e2e_phase(rounds, process)
        assert rounds["round_process"] == first_phase
        assert rounds["command"].endswith(f"# {run}") and rounds["plain_decode_path"]["arm"] == f"arm {run}"
    markdown = summary_markdown(rounds)
    assert "Round phase: `python tools/bench.py --part rounds`, 7 repeats, code c0de0f0a0000" in markdown
    assert "`rotation`" in markdown and "`arm 1`" in markdown
    assert "End-to-end phase, in a second process: `python tools/bench.py --part e2e # 1`, 5 repeats, code e2e1" in markdown


def test_bench_s_verdict_cache_is_keyed_by_the_modules_and_the_model():
    """--verdict-cache keys the start-up verdicts by the runtime's modules and the synthetic
    model (its dtype, kernel shapes and builder's source), and the e2e phase's summary names the
    checks it took from the round phase's cache; without it there is no cache."""
    from argparse import Namespace

    from bench import start_up_verdicts
    from bench_summary import cached_checks_text
    from dflash2_pack import kernel_shapes
    from dflash2_verdicts import modules_key
    from make_synthetic_pack import build_target_model

    def args(**given):
        return Namespace(**{"verdict_cache": True, "pack": None, "size": "tiny", "dense_dtype": "float16", **given})

    fp16_model, fp32_model = (build_target_model("tiny", seed=0, dense_dtype=dtype) for dtype in ("float16", "float32"))
    assert start_up_verdicts(args(verdict_cache=False), fp16_model).pack is None
    fp16 = start_up_verdicts(args(), fp16_model).pack
    fp32 = start_up_verdicts(args(dense_dtype="float32"), fp32_model).pack
    assert fp16["modules"] == modules_key() and "dflash2_kernels.py" in fp16["modules"]
    assert fp16["pack"]["kernel_shapes"] == kernel_shapes(fp16_model) != fp32["pack"]["kernel_shapes"]
    assert len(fp16["pack"]["make_synthetic_pack.py"]) == len(fp16["pack"]["synthetic_tokenizer.py"]) == 64
    assert fp16 != fp32
    took = {"from_cache": {"kernel self-tests": "2026-12-07T19:24:28Z", "verify path": "2026-12-07T19:24:28Z"}}
    assert cached_checks_text({"start_up_verdicts": took}) == (
        " Start-up checks from the verdict cache (measured 2026-12-07T19:24:28Z): kernel self-tests, verify path.")
    assert cached_checks_text({"start_up_verdicts": {"from_cache": {}}}) == cached_checks_text({}) == ""


def test_a_bench_start_that_fails_its_checks_leaves_no_verdicts_behind(tmp_path, monkeypatch):
    """A bench process whose start took cached verdicts and then did not serve speculation
    removes the cache file, as the server does; one that serves saves its verdicts."""
    import dflash2_verdicts
    from bench import keep_start_up_verdicts

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = {"at": "2026-12-07T19:24:28Z", "seconds": 1.0, "value": {"arm": "mlx"}}
    first = dflash2_verdicts.VerdictCache({"modules": {}, "pack": {"synthetic": "tiny"}, "options": {}})
    first.open()
    first.measured["plain decode path"] = measured
    keep_start_up_verdicts(first, True)
    assert first.path.is_file()
    second = dflash2_verdicts.VerdictCache(first.pack)
    second.open()
    assert second.cached and second.path == first.path
    second.used["plain decode path"] = measured["at"]
    keep_start_up_verdicts(second, False)
    assert not first.path.exists()


def test_the_e2e_part_takes_round_records_from_before_the_verdict_cache():
    """--part e2e needs of a round record what every committed one holds: records written
    before start_up_verdicts was kept still serve (a cold machine carries them back in)."""
    from bench import ROUND_RECORD_KEYS

    assert "start_up_verdicts" not in ROUND_RECORD_KEYS
    for stem in ("bench-cuda-27b", "bench-cuda-27b-fp32"):
        assert set(ROUND_RECORD_KEYS) - json.loads((EVIDENCE / f"{stem}.json").read_text()).keys() == set(), stem


def test_bench_keeps_each_token_count_s_pass_and_puts_the_longest_on_top():
    """--part e2e at 256 tokens, then at 40 (separate device calls), then 256 again: each
    count's section under e2e_by_tokens, the top-level keys (README's) always the 256 pass's,
    git_commit and git_clean at top level beside the round phase's own."""
    from bench import add_e2e_section, start_e2e_phase
    from bench_summary import summary_markdown, tokens_lines

    record = json.loads((EVIDENCE / "bench-cuda-27b.json").read_text())
    record.pop("round_process")
    record.update(git_commit="a" * 40, git_clean=True)
    keys = set(record)

    def section(tokens, commit):
        return {**{key: record[key] for key in ("runtime_status", "plain_decode_path", "round_costs",
                                                  "drafter_dtype_by_form", "e2e_ms", "e2e_speedup")},
                "command": f"python tools/bench.py --tokens {tokens}", "code": "c0de", "repeats": 3, "tokens": tokens,
                "tokens_generated": tokens, "git_commit": commit, "git_clean": True, "tokens_identical": tokens != 40,
                "e2e_tok_s": {arm: tokens / stats["median"] * 1000 for arm, stats in record["e2e_ms"].items()},
                "e2e_speedup": {profile: speedup * (1 + tokens / 1000) for profile, speedup in record["e2e_speedup"].items()}}

    for tokens, commit in ((256, "b" * 40), (40, "c" * 40), (256, "d" * 40)):
        start_e2e_phase(record, {"command": "x", "code": "y", "tokens": tokens, "git_commit": commit})
        add_e2e_section(record, section(tokens, commit))
        assert record["tokens_generated"] == 256 and record["complete"]
        assert record["e2e_speedup"] == record["e2e_by_tokens"]["256"]["e2e_speedup"]
    assert keys <= set(record) and sorted(record["e2e_by_tokens"], key=int) == ["40", "256"]
    assert record["git_commit"] == "d" * 40 and record["round_process"]["git_commit"] == "a" * 40
    assert record["e2e_by_tokens"]["40"]["git_commit"] == "c" * 40
    lines = tokens_lines(record)
    assert lines[5].startswith("| 40 | ") and lines[5].endswith(" | False |") and lines[6].startswith("| 256 | ")
    assert "(tok/s: tokens generated over the request's whole time" in summary_markdown(record)
    assert " tok/s |" in summary_markdown(record)


def test_bench_records_the_acceptance_curve_and_tokens_per_round_at_every_block():
    """acceptance_model: per profile the curve, expected and measured (over the passes' draws)
    tokens per round at blocks 2..8; a fixed-block arm that accepted other than its draws is
    named; the summary renders it."""
    from bench import PROFILE_TOKENS_PER_ROUND, acceptance_record
    from bench_summary import acceptance_lines

    from oracle_drafter import DepthAcceptance

    models = {p: DepthAcceptance.calibrated(t) for p, t in PROFILE_TOKENS_PER_ROUND.items()}
    profiles, blocks, seeds = list(models), [2, 4, 8], [0, 1, 2]

    def arm_name(profile, block):
        return f"{profile}, block {block}"

    runs = {arm_name(p, b): [(seed, models[p].simulate(b, 256, seed)) for seed in seeds] for p in profiles for b in blocks}
    runs[arm_name("chat", 4)][1] = (1, [0, 0, 0])  # an arm that did not accept what its draws say
    model = acceptance_record(models, runs, profiles, blocks, 256, arm_name)
    assert model["kind"] == "stochastic" and model["seeds"] == seeds
    assert model["fixed_block_arms_differing_from_draws"] == [["chat, block 4", 1]]
    code = model["profiles"]["code"]
    assert code["p_by_depth"][0] == pytest.approx(models["code"].first, abs=1e-6) and len(code["p_by_depth"]) == 7
    assert list(code["measured_tokens_per_round_by_block"]) == [str(b) for b in range(2, 9)]
    assert code["measured_tokens_per_round_by_block"]["8"] == code["measured_tokens_per_round_by_fixed_block_arm"]["8"]
    assert code["measured_tokens_per_round_by_block"]["8"] == pytest.approx(4.5, rel=0.1)
    assert code["expected_tokens_per_round_by_block"]["8"] == pytest.approx(4.5)
    assert model["profiles"]["zero"]["measured_tokens_per_round_by_block"]["2"] == 1.0
    lines = acceptance_lines(json.loads(json.dumps(model)))
    assert "accepting other than the draws: chat, block 4 (seed 1)" in lines[1]
    assert any(line.startswith("| code | 0.969 | 0.97 0.87 ") for line in lines)
    exact = acceptance_record(None, runs, profiles, blocks, 256, arm_name)
    assert exact["kind"] == "exact-rate" and "exact rate" in acceptance_lines(exact)[1]


def test_profiles_are_named_by_their_full_rounds():
    """The oracle's exact-rate pattern for code (3.5 accepted a round: 3, 4, 3, 4, ...) gives
    4.5 tokens a round; a last round cut by the token budget is left out."""
    from bench import full_round_tokens

    assert full_round_tokens([3, 4, 3, 4, 3, 4, 1]) == 4.5
    assert full_round_tokens([0, 0, 0]) == 1.0
    assert full_round_tokens([2]) == 3.0  # a single round is all there is
    assert full_round_tokens([]) == 0.0


def test_server_ratios_pair_each_request_with_serve_py_s_of_the_same_pass():
    from bench_server import REFERENCE, summarise

    def runs(tok_s):
        return [{"mode": None, "tokens": 8, "decode_tok_s": t, "ttft_s": 0.1, "tokens_from_rounds": None,
                 "tokens_from_plain_steps": None} for t in tok_s]

    # A slow stretch reached serve.py two passes before the speculative server: each pass's
    # ratio is 2 (but where the stretch lies between them), the medians' 4.
    results = summarise({"chat": {REFERENCE: runs([10, 10, 5, 5, 5]), "dflash2": runs([20, 20, 20, 10, 10])}})
    assert results["chat"]["dflash2"]["decode_tok_s"]["median"] / results["chat"][REFERENCE]["decode_tok_s"]["median"] == 4
    assert results["chat"]["dflash2"]["ratio_to_serve_py"] == {"decode_tok_s": 2.0, "ttft_s": 1.0}


def test_the_server_record_sets_each_server_s_memory_beside_serve_py_s():
    """bench_server's memory table: at rest over serve.py's, and the request peaks; a record
    written before it had memory renders without the table."""
    from bench_server import REFERENCE, summary_markdown

    record = json.loads((EVIDENCE / "bench-server-cpu.json").read_text())
    assert "active memory" not in summary_markdown(record)
    peaks = {"median": 9.5, "min": 9.2, "max": 13.1, "n": 10}
    record["memory"] = {"dflash2": {"at_rest_gb": 9.1, "request_peak_gb": {**peaks, "median": 12.4}},
                        REFERENCE: {"at_rest_gb": 7.6, "request_peak_gb": peaks}}
    text = summary_markdown(record)
    assert "| dflash2 | 9.100 | +1.500 | 12.400 (9.200-13.100) |" in text
    assert f"| {REFERENCE} | 7.600 | +0.000 | 9.500 (9.200-13.100) |" in text


def test_the_memory_bench_pairs_each_pass_and_says_where_rounds_did_not_run():
    """bench_memory's extra peak is the speculative request's peak less serve.py's of the same
    pass (a slow drift moves both), and its summary sets the routes and round tokens beside it."""
    from bench_memory import PLAIN, SPECULATIVE, summarise, summary_markdown

    def runs(peaks, mode="speculative", rounds=7):
        return [{"mode": mode, "prompt_tokens": 120, "tokens_from_rounds": rounds, "peak_gb": p} for p in peaks]

    results = summarise({100: {SPECULATIVE: runs([10.0, 11.0, 12.0, 13.0, 14.0]),
                               PLAIN: runs([9.5, 10.0, 10.5, 11.0, 11.5], "plain", None)}})
    assert results["100"]["extra_peak_gb"] == {"median": 1.5, "min": 0.5, "max": 2.5, "n": 5}
    assert results["100"]["peak_gb"][PLAIN]["median"] == 10.5 and results["100"]["speculative_modes"] == ["speculative"]
    record = {"backend": "cpu", "device": "x", "pack": "p", "command": "c", "versions": {"mlx": "m", "mlx_vlm": "v"},
              "method": "m", "repeats": 5, "max_tokens": 16, "memory_at_rest_gb": {SPECULATIVE: 9.0, PLAIN: 7.5},
              "results": results, "git_commit": "abc", "git_clean": True}
    text = summary_markdown(record)
    assert "difference +1.500" in text
    assert "| 100 | 120 | speculative | 7 | 12.000 (10.000 to 14.000) | 10.500 (9.500 to 11.500) | +1.500 (+0.500 to +2.500) |" in text


def test_the_memory_bench_takes_no_peak_of_a_request_served_from_the_prefix_cache():
    """A request whose prompt the prefix cache restored peaks at a repeat turn's memory, not a
    prefill's at its context: bench_memory refuses its finish line."""
    from bench_memory import finish_peak
    from dflash2_record import RequestRecord

    record = RequestRecord(7, "POST /v1/chat/completions", "speculative", status=200, tokens=16, prompt_tokens=276,
                           cached_tokens=0, peak_memory_gb=12.3456)
    line = f"request 7 finished in 1.20s: {record.finish_summary()}"
    assert finish_peak(line) == 12.346
    record.cached_tokens = 275
    with pytest.raises(ValueError, match="restored cached tokens"):
        finish_peak(f"request 7 finished in 1.20s: {record.finish_summary()}")


def test_gpu_benchmarks_give_each_server_its_own_kernel_folder(tmp_path, monkeypatch):
    """On a GPU the benchmarks' servers start together, and MLX writes what it compiles into the
    temp folder in place: each gets its own, the same for its name in every run. On CPU they
    share one (warm) and take turns over their start-ups."""
    import mlx.core as mx

    from server_process import ServerProcess, own_kernel_folder, own_kernels

    assert own_kernel_folder("serve.py") is None and own_kernels("serve.py") == {}
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    folders = {name: own_kernel_folder(name) for name in ("serve_dflash2.py", "serve.py")}
    assert len(set(folders.values())) == 2 and own_kernel_folder("serve.py") == folders["serve.py"]
    assert own_kernels("serve.py") == {"tmpdir": folders["serve.py"], "kernels": folders["serve.py"] / "ptx"}
    probe = ServerProcess("probe", ["-c", "import os; print(os.environ['TMPDIR'], os.environ['MLX_PTX_CACHE_DIR'])"],
                          tmp_path, tmpdir=tmp_path / "kernels", kernels=tmp_path / "kernels" / "ptx")
    assert probe.process.wait(60) == 0 and f"{tmp_path / 'kernels'} {tmp_path / 'kernels' / 'ptx'}" in probe.log()


def test_the_memory_bench_prompts_have_about_the_context_s_tokens():
    from transformers import AutoTokenizer

    from bench_memory import prompts

    target = REPO / "fixtures" / "tiny-pair" / "target"
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    for context, text in prompts(target, [40, 600]).items():
        assert abs(len(tokenizer.encode(text, add_special_tokens=False)) - context) <= 4, context


def test_the_bench_summary_says_how_its_ratios_were_taken():
    from bench_summary import ratio_method

    medians, paired = {"median": 1.0}, {"median": 1.0, "samples": [1.0]}
    assert ratio_method({"round_ms": {"decode": medians}}) == "."
    assert ratio_method({"round_ms": {"decode": paired}, "e2e_ms": {"plain mlx": paired}}).startswith(
        "; a ratio of two arms is the median over passes of their ratio within a pass.")
    # An end-to-end phase added to an older round phase's record names the round phase apart.
    assert "the round phase's, from a record without samples: a ratio of medians" in ratio_method(
        {"round_ms": {"decode": medians}, "e2e_ms": {"plain mlx": paired}})


def test_the_bench_summary_sets_the_peer_beside_the_pack():
    """--peer-arms: mlx-vlm's own speculative decoding over plain, the pack's policy over it and
    its tokens that differ from plain's, per profile; a record without the peer renders without."""
    from bench_summary import summary_markdown

    record = json.loads((EVIDENCE / "bench-cuda-27b.json").read_text())
    for key in ("e2e_speedup_peer", "pack_over_peer", "peer_tokens_differing"):
        record.pop(key, None)
    assert "The peer" not in summary_markdown(record)
    record.update(e2e_speedup_peer={"median": 1.1, "code": 1.5}, pack_over_peer={"median": 1.32, "code": 1.41},
                  peer_tokens_differing={"median": 7, "code": 0})
    assert ("its tokens that differ from plain decoding's: median 1.10x, pack 1.32x, 7 differing; "
            "code 1.50x, pack 1.41x, 0 differing.") in summary_markdown(record)


def test_the_verify_profile_ranks_kernels_by_added_launches():
    """profile_verify's launch table: kernels whose launches per step grow most from the decode
    step to the longest round come first (on CUDA the host's cost follows launches); a record
    from before launches were counted renders without the table."""
    from profile_verify import growth_order, summary_markdown

    record = json.loads((EVIDENCE / "profile-verify-cuda.json").read_text())
    record.pop("launches_by_growth", None)  # as records before launches were counted
    for arm in record["arms"].values():
        arm.pop("launches_by_kernel", None)
    assert "by launches" not in summary_markdown(record)
    arms = {"decode": {"launches_by_kernel": {"gemv": 96, "norm": 200}},
            "verify 8": {"launches_by_kernel": {"gemv": 96, "norm": 210, "p @ v": 128}}}
    assert growth_order(arms, "verify 8", "launches_by_kernel") == ["p @ v", "norm", "gemv"]
    for name, arm in record["arms"].items():
        arm["launches_by_kernel"] = arms["verify 8" if name.startswith("verify") else "decode"]["launches_by_kernel"]
    record["launches_by_growth"] = growth_order(arms, "verify 8", "launches_by_kernel")
    table = summary_markdown(record).split("by launches added")[1]
    assert table.index("`p @ v` | 0 | 128") < table.index("`norm` | 200 | 210") < table.index("`gemv`")


def test_the_verify_profile_counts_overlapping_kernels_once_and_names_the_slow_layers():
    """Kernels of two streams can overlap: busy time is their intervals' union, not their sum.
    The summary shows busy ms and the layers whose host build stands out where the record has
    them, and renders a record from before they were measured without either."""
    from profile_verify import busy_us, summary_markdown

    assert busy_us([(0, 10), (20, 30)]) == 20
    assert busy_us([(0, 10), (5, 12), (2, 3), (12, 14)]) == 14  # nested, overlapping, touching
    assert busy_us([(20, 347), (20, 347), (0, 5)]) == 332  # two kernels side by side count once
    record = json.loads((EVIDENCE / "profile-verify-cuda.json").read_text())
    for arm in record["arms"].values():
        for key in ("busy_ms", "api_ms", "api_calls"):
            arm.pop(key, None)
    record.pop("host_ms_by_layer", None)
    older = summary_markdown(record)
    assert "busy ms" not in older and "Host ms" not in older
    for arm in record["arms"].values():
        arm["busy_ms"] = 12.5
    record["host_ms_by_layer"] = [0.5] * 10 + [9.0] + [0.5] * 53
    summary = summary_markdown(record)
    assert "| busy ms |" in summary and "| 12.50 |" in summary
    assert "40.50 in all, median layer 0.500; slowest: layer 10 9.00, layer 0 0.50" in summary
    assert "Host CUDA API calls" not in summary  # a record from before they were read


def test_the_verify_profile_lists_host_api_calls_by_the_longest_round_s_time():
    from profile_verify import summary_markdown

    record = json.loads((EVIDENCE / "profile-verify-cuda.json").read_text())
    longest = f"verify {max(record['blocks'])}"
    for name, arm in record["arms"].items():
        arm["api_ms"] = {"cudaGraphLaunch": 1.0, "cudaGraphInstantiateWithFlags": 9.5 if name == longest else 0.5}
        arm["api_calls"] = {"cudaGraphLaunch": 30, "cudaGraphInstantiateWithFlags": 4 if name == longest else 0.25}
    table = summary_markdown(record).split("Host CUDA API calls")[1]
    assert table.index("`cudaGraphInstantiateWithFlags` | 0.50 (0.2)") < table.index("`cudaGraphLaunch` | 1.00 (30.0)")
    assert "| 9.50 (4.0) |" in table  # calls per step: a call every few steps is not 0


def test_the_launch_comparison_weights_shapes_by_calls_and_refuses_off_cuda():
    """compare_qmv_launch: each arm's per-step figure is its per-shape medians times the
    shapes' calls in a 27B decode step; the committed record's figures are those sums; on a
    machine without CUDA the tool says so and times nothing."""
    import dflash2_kernel_qmv
    from compare_qmv_launch import step_sums, summary_markdown

    arms = ("mlx single row", "previous 8", "current 8")
    shapes = {f"{n}x{k}": {"timings_us": {arm: {"median": 1000.0 * (i + 1)} for i, arm in enumerate(arms)}}
              for n, k in dflash2_kernel_qmv.PACKED_SHAPES_27B}
    shapes["248320x5120"]["timings_us"]["current 8"]["median"] = 0.0  # the lm_head: one call a step
    calls = sum(calls for _, calls in dflash2_kernel_qmv.PACKED_SHAPES_27B.values())
    assert step_sums(shapes) == {"mlx single row": calls, "previous 8": 2 * calls, "current 8": 3 * (calls - 1)}
    # GPU times (CUPTI): an arm without a figure at some shape (its kernel not told apart) has no sum
    for entry in shapes.values():
        entry["kernel_us"] = dict(entry["timings_us"])
    shapes["1024x5120"]["kernel_us"]["previous 8"] = None
    assert step_sums(shapes, "kernel_us") == {"mlx single row": calls, "current 8": 3 * (calls - 1)}
    for entry in shapes.values():  # busy time per call: a record of it sums the same way
        for arm, figures in entry["kernel_us"].items():
            entry["kernel_us"][arm] = figures and {**figures, "busy_per_call": figures["median"] / 2}
    assert step_sums(shapes, "kernel_us", "busy_per_call") == {"mlx single row": calls / 2,
                                                               "current 8": 3 * (calls - 1) / 2}
    record = json.loads((EVIDENCE / "qmv-launch-cuda.json").read_text())
    assert record["mismatches"] == 0 and step_sums(record["shapes"]) == record["step_ms"]
    assert step_sums(record["shapes"], "kernel_us") == record["kernel_step_ms"]
    assert step_sums(record["shapes"], "kernel_us", "busy_per_call") == record.get("busy_step_ms", {})
    assert summary_markdown(record) == (EVIDENCE / "qmv-launch-cuda.md").read_text()
    refused = subprocess.run([sys.executable, str(REPO / "tools" / "lab" / "compare_qmv_launch.py"), "--previous", "{}"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "CUDA only" in refused.stderr


def test_the_kernel_tools_time_the_rows_as_the_served_verify_hands_them():
    """kernel_parity and compare_qmv_launch call a CUDA qmv module through
    served_cuda_matmul: on swizzled rows where the module has that layout, on plain rows where
    an older revision's has not."""
    import types

    import mlx.core as mx

    import dflash2_kernel_qmv
    from kernel_parity import served_cuda_matmul

    calls = []
    x = mx.arange(2 * 1024).reshape(2, 1024)
    for module, swizzled in ((types.SimpleNamespace(swizzle_steps=dflash2_kernel_qmv.swizzle_steps), True),
                             (types.SimpleNamespace(), False)):
        module.cuda_matmul = lambda x, w, s, b, **options: calls.append((x, options))
        layout, call = served_cuda_matmul(module, [2, 2, 3])
        call(layout(x), None, None, None)
        rows, options = calls[-1]
        assert options == {"launch": (2, 2, 3), **({"swizzled": True} if swizzled else {})}
        assert mx.array_equal(rows, dflash2_kernel_qmv.swizzle_steps(x) if swizzled else x)


def test_the_launch_comparison_can_time_another_revisions_kernel(tmp_path):
    """--previous-kernels: another revision's dflash2_kernel_qmv.py loads as a module of its own
    (its kernel source, not this one's), and a record whose previous arm ran it says so in
    place of the same-launch control sentence."""
    import dflash2_kernel_qmv
    from compare_qmv_launch import load_kernels, summary_markdown

    before = tmp_path / "before.py"
    source = (REPO / "dflash2_kernel_qmv.py").read_text()
    before.write_text(source.replace('_CUDA_HEADER = r"""', '_CUDA_HEADER = r"""// an earlier kernel\n', 1))
    previous = load_kernels(before)
    assert previous is not dflash2_kernel_qmv and previous.CUDA_LAUNCH == dflash2_kernel_qmv.CUDA_LAUNCH
    assert previous.cuda_qmv_source_digest() != dflash2_kernel_qmv.cuda_qmv_source_digest()

    record = json.loads((EVIDENCE / "qmv-launch-cuda.json").read_text())
    # the same launches and kernel: one kernel against itself
    record.update(previous=dict(record["current"]), previous_kernel_source=record["cuda_kernel_source"],
                  previous_kernels=None)
    control = "a control: their current / previous is the comparison's own noise"
    assert control in summary_markdown(record)
    record.update(previous_kernel_source=previous.cuda_qmv_source_digest(), previous_kernels=before.name)
    summary = summary_markdown(record)
    assert control not in summary
    assert f"another kernel: source {previous.cuda_qmv_source_digest()} (before.py)" in summary


NCU_DETAILS = """[688] python3.12@127.0.0.1
  void qmv_kernel<8, 16>(const T6 *, int) (2176, 1, 1)x(32, 8, 1), Context 1, Stream 14, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Duration                         us        50.98
    L1/TEX Cache Throughput           %        95.91
    Section: Launch Statistics
    Registers Per Thread             register/thread              40
    Instructions Executed                         inst   15,057,920
    Instructions Executed                         inst   99
  custom_kernel_dflash2_qmv_2bit_g128_8_2_4_2_1(const __half *, __half *) (2176, 1, 1)x(32, 4, 1), Context 1, Stream 14, Device 0, CC 9.0
    Duration                         us        69.09
    Stall Long Scoreboard           inst         0.84
"""
NCU_SASS = """"Kernel Name","void mlx::core::cu::qmv_kernel<(int)8, (int)16>(const T6 *, int)",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"
"0x1","      HFMA2 R1, R2, R3, R1","5","30"
"0x2","@P0   LDG.E.CONSTANT R4, desc[UR4][R2.64]","7","10"
"0x3","      HFMA2.MMA R1, R2, R3, R1","1","60"
"""


def test_the_ncu_summary_reads_each_kernels_metrics_and_opcode_mix(tmp_path):
    """ncu_summary on ncu's text formats: each kernel's first value of each metric, its launch
    shape, its instruction mix and stall samples by opcode (predicated and suffixed opcodes
    counted as theirs); output without a kernel section is refused."""
    (tmp_path / "details.txt").write_text(NCU_DETAILS)
    (tmp_path / "sass.csv").write_text(NCU_SASS)
    tool = [sys.executable, str(REPO / "tools" / "lab" / "ncu_summary.py")]
    done = subprocess.run([*tool, str(tmp_path / "details.txt"), str(tmp_path / "sass.csv"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "ncu-qmv-cuda.json").read_text())
    mlx, exact = record["kernels"]["qmv_kernel<8, 16>"], record["kernels"]["custom_kernel_dflash2_qmv_2bit_g128_8_2_4_2_1"]
    assert mlx["grid"] == [2176, 1, 1] and mlx["block"] == [32, 8, 1] and exact["block"] == [32, 4, 1]
    assert mlx["Duration"] == [50.98, "us"] and mlx["Instructions Executed"] == [15057920.0, "inst"]
    assert exact["Stall Long Scoreboard"] == [0.84, "inst"] and "Duration" not in record["kernels"].get("", {})
    assert record["sass"]["mlx::core::cu::qmv_kernel<(int)8, (int)16>"] == {
        "instructions": 100, "opcodes": [["HFMA2", 0.9, 6], ["LDG", 0.1, 7]]}
    assert "| Duration | 50.98 us | 69.09 us |" in (tmp_path / "ncu-qmv-cuda.md").read_text()
    (tmp_path / "empty.txt").write_text("==PROF== Disconnected from process 688\n")
    refused = subprocess.run([*tool, str(tmp_path / "empty.txt"), "--out", str(tmp_path / "none")],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "no kernel sections" in refused.stderr and not (tmp_path / "none").exists()


def test_the_verify_profile_times_each_layer_the_served_verify_builds():
    """profile_verify's host time by layer, on the tiny target with the runtime installed: one
    figure per layer of the served verify forward, and the served forward back as it was."""
    import bench_arms
    import dflash2_runtime
    import dflash2_verify
    from make_synthetic_pack import SIZES, build_target_model
    from profile_verify import host_ms_by_layer, host_split_ms, split_steps

    model = build_target_model("tiny", seed=0)
    assert dflash2_runtime.install().speculative  # the patches; the model's checks add nothing here
    lm = model.language_model
    taps = list(SIZES["tiny"]["drafter"]["target_layer_ids"])
    cache, hidden = bench_arms.prefill(lm, [3, 5, 7, 9], taps)
    served = dflash2_verify.ExactVerifier._layer
    layers = host_ms_by_layer(bench_arms.verify_round_steps(lm, cache, taps, 3), 2)
    assert len(layers) == len(lm.model.layers) and all(ms >= 0 for ms in layers)
    assert dflash2_verify.ExactVerifier._layer is served

    # The host split: each step's parts timed, and a verify step commits its round (the cache
    # advances by its accepted half plus the bonus token, as bench's verify rounds do).
    settle = bench_arms.cache_settler(cache)
    steps = split_steps(lm, cache, taps, [4])
    assert list(steps) == ["decode", "verify 4", "verify 4, one eval", "decode after verify 4, its commit queued",
                           "decode after verify 4, its commit done"]
    before = cache[lm.model.fa_idx].offset
    split = host_split_ms(steps["verify 4, one eval"][0], settle, 2)
    assert cache[lm.model.fa_idx].offset == before + 3 * 3
    # A decode step after a round: each sample runs the round untimed first (3 positions kept), then the step.
    step, after_round = steps["decode after verify 4, its commit queued"]
    host_split_ms(step, settle, 2, after_round)
    assert cache[lm.model.fa_idx].offset == before + 3 * 3 + 3 * (3 + 1)
    # With a drafter, its pass of the longest block: the drafter's tokens, the target's cache untouched.
    drafter = bench_arms.random_drafters("tiny", ["4bit"])["4bit"]
    steps = split_steps(lm, cache, taps, [2, 4], (drafter, hidden))
    assert list(steps)[-1] == "draft 4" and steps["draft 4"][0]()[0][0].shape == (1, 3)
    offset = cache[lm.model.fa_idx].offset
    assert host_split_ms(steps["draft 4"][0], settle, 2)["wait"] >= 0 and cache[lm.model.fa_idx].offset == offset
    assert all(split[part] >= 0 and split[f"{part}_min_max"][0] <= split[part] <= split[f"{part}_min_max"][1]
               for part in ("build", "launch", "wait"))
    assert dflash2_verify.VERIFY_EVAL_EVERY == 8  # the served interval is back


def test_the_bench_summary_takes_the_server_s_round_apart_where_the_record_timed_it():
    from bench_summary import summary_markdown

    record = json.loads((EVIDENCE / "bench-cuda-27b.json").read_text())
    record.pop("served_round_by_part", None)  # as records from before it was timed
    assert "The server's round" not in summary_markdown(record)
    record["served_round_by_part"] = {"served round": 2.1, "verify on the generation stream": 1.8,
                                      "verify on the batch stream": 1.3, "draft 4bit": 0.2}
    assert ("in decode steps: served round 2.10; verify on the generation stream 1.80; "
            "verify on the batch stream 1.30; draft 4bit 0.20.") in summary_markdown(record)


def readme_results() -> str:
    """README's results table: the lines between its markers."""
    from records import RESULTS_END, RESULTS_START

    text = (REPO / "README.md").read_text()
    return text[text.index(RESULTS_START) + len(RESULTS_START):text.index(RESULTS_END)].lstrip("\n")


def test_readme_s_results_table_is_what_the_records_write():
    """After a record changes: python tools/records.py --readme."""
    printed = subprocess.run([sys.executable, str(REPO / "tools" / "records.py")], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    assert readme_results() == printed, "README's results differ from evidence/: run python tools/records.py --readme"


def test_a_changed_record_changes_readme_s_results(tmp_path):
    import records

    evidence = Path(shutil.copytree(EVIDENCE, tmp_path / "evidence"))
    record = json.loads((evidence / "parity-cuda.json").read_text())
    record.update(exact_mismatches=3, code="0123456789ab", device="NVIDIA H200")
    for key in ("git_commit", "git_clean"):  # as records from before commits were recorded
        record.pop(key, None)
    (evidence / "parity-cuda.json").write_text(json.dumps(record))
    table = records.results_table(evidence)
    assert table != readme_results()
    assert ("| 3 (negative controls: 85,190,586) | NVIDIA H200 | [parity-cuda](evidence/parity-cuda.md) "
            "(no commit recorded, code 0123456789ab) |") in table
    # A record that names its commit shows it (short), marked where the tree had changes.
    record.update(git_commit="89abcdef0123456789abcdef0123456789abcdef", git_clean=False)
    (evidence / "parity-cuda.json").write_text(json.dumps(record))
    assert "[parity-cuda](evidence/parity-cuda.md) (89abcdef0123, uncommitted changes) |" in records.results_table(evidence)


def git(*args, env=None):
    return subprocess.run(["git", *args], cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout.strip()


def test_records_readme_quotes_name_commits_head_descends_from(tmp_path):
    """Every commit a record README quotes names (its own, its round phase's, each end-to-end
    section's) is an ancestor of HEAD; records from before commits were recorded name none and
    the table says so. Negative controls, fabricated records: an unknown commit, and a real
    commit off HEAD's line (made in a scratch object store beside the repository's), fail;
    HEAD's parent passes."""
    import os

    import records

    try:
        head = git("rev-parse", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git history (a device's copy of the tree)")
    assert records.commits_outside_history() == [], "a quoted record names a commit HEAD does not descend from"
    for stem in records.quoted_stems():
        record = json.loads((EVIDENCE / f"{stem}.json").read_text())
        assert record.get("git_commit") or "no commit recorded" in records.measured_code(record)

    objects = tmp_path / "objects"
    objects.mkdir()
    env = {**os.environ, "GIT_OBJECT_DIRECTORY": str(objects),
           "GIT_ALTERNATE_OBJECT_DIRECTORIES": git("rev-parse", "--path-format=absolute", "--git-common-dir") + "/objects"}
    off_line = git("commit-tree", "HEAD^{tree}", "-m", "a commit no branch holds", env=env)
    evidence = Path(shutil.copytree(EVIDENCE, tmp_path / "evidence"))
    record = json.loads((evidence / "bench-cuda-27b.json").read_text())
    sections = {"40": {"git_commit": "0" * 40}, "256": {"git_commit": head}}
    record.update(git_commit=off_line, git_clean=True, round_process={**record.get("round_process", {}), "git_commit": head},
                  e2e_by_tokens=sections)
    (evidence / "bench-cuda-27b.json").write_text(json.dumps(record))
    assert records.commits_outside_history(evidence, env=env) == [("bench-cuda-27b", off_line),
                                                                  ("bench-cuda-27b", "0" * 40)]
    parent = git("rev-parse", "HEAD~1")
    record.update(git_commit=parent, e2e_by_tokens={"256": {"git_commit": head}})
    (evidence / "bench-cuda-27b.json").write_text(json.dumps(record))
    assert records.commits_outside_history(evidence, env=env) == []


def test_parity_parts_add_only_to_the_same_runs_earlier_parts(tmp_path):
    """parity.py runs a record in three parts, one process each (one process ran past a device
    call's limit): contexts adds to a verify part's record, tokens to a verify and contexts
    one. A part refuses before loading anything where that record is missing, holds other parts,
    or measured other code or another machine."""
    from parity import earlier_part, same_run, summary_markdown

    with pytest.raises(SystemExit, match="unreadable"):
        earlier_part(tmp_path, "parity-cuda", "contexts")
    record = json.loads((EVIDENCE / "parity-cuda.json").read_text())
    assert "Not in this record yet" not in summary_markdown(record)  # verify (with the contexts) and tokens
    for part, parts in (("contexts", ["verify", "tokens"]), ("contexts", ["verify", "contexts"]),
                        ("tokens", ["verify"]), ("tokens", ["verify", "contexts", "tokens"])):
        (tmp_path / "parity-cuda.json").write_text(json.dumps({**record, "parts": parts}))
        with pytest.raises(SystemExit, match=f"--part {part} adds to the .* record: .* has parts"):
            earlier_part(tmp_path, "parity-cuda", part)
    (tmp_path / "parity-cuda.json").write_text(json.dumps({**record, "parts": ["verify"], "git_commit": "a" * 40}))
    verify = earlier_part(tmp_path, "parity-cuda", "contexts")
    assert "Not in this record yet: the contexts and tokens parts (`--part contexts` adds the next)" in summary_markdown(verify)
    (tmp_path / "parity-cuda.json").write_text(json.dumps({**verify, "parts": ["verify", "contexts"]}))
    assert earlier_part(tmp_path, "parity-cuda", "tokens")["parts"] == ["verify", "contexts"]
    verify.pop("dense_dtype", None)  # a record from before --dense-dtype: any later part's layout
    environment = {key: verify.get(key) for key in ("git_commit", "git_clean", "code", "device", "versions")}
    same_run(verify, environment, "contexts")
    with pytest.raises(SystemExit, match="--part contexts: the earlier parts' record has another git_commit"):
        same_run(verify, {**environment, "git_commit": "b" * 40}, "contexts")
    with pytest.raises(SystemExit, match="another code"):
        same_run(verify, {**environment, "code": "0" * 12})
    # --dense-dtype: a verify part that named its layout adds only the same layout's later parts.
    verify["dense_dtype"] = "float32"
    same_run(verify, {**environment, "dense_dtype": "float32"})
    with pytest.raises(SystemExit, match="another dense_dtype"):
        same_run(verify, {**environment, "dense_dtype": "float16"})


def test_the_parity_summary_counts_sampled_runs_and_says_how_block_rows_are_drawn():
    from parity import case_mismatches, summary_markdown

    record = json.loads((EVIDENCE / "parity-cuda.json").read_text())
    assert "| seeded sampled tokens, oracle drafter" in summary_markdown(record)
    record["cases"] = [case for case in record["cases"] if case["check"] != "sampled tokens"]  # as records from before
    record.pop("block_sampling", None)
    assert "seeded sampled tokens" not in summary_markdown(record)
    sampled = [{"check": "sampled tokens", "settings": {"temperature": 1.0, "top_p": 1.0}, "seed": 1, "block": block,
                "error_rate": 0.35, "accepted": 3, "rounds": 4, "identical": block != 5} for block in range(2, 9)]
    record["cases"] += sampled
    record["block_sampling"] = {"vocab": 248320, "differing_rows": 0, "batched": True, "seconds": 2.0,
                                "summary": "sampled verify draws: one call over a block's rows (2.0 s)"}
    markdown = summary_markdown(record)
    assert sum(map(case_mismatches, sampled)) == 1  # what feeds exact_mismatches
    assert ("| seeded sampled tokens, oracle drafter proposing plain seeded sampling's (blocks 2..8, 1 settings) "
            "| 7 | 1 runs differ |") in markdown
    assert "Block sampling self-test at vocabulary 248320: sampled verify draws: one call" in markdown


def test_the_bench_summary_gives_sampled_requests_speedups_by_temperature():
    from bench import SAMPLED_SETTINGS
    from bench_summary import summary_markdown

    record = json.loads((EVIDENCE / "bench-cuda-27b.json").read_text())
    assert "Sampled requests" in summary_markdown(record)
    for key in [key for key in record if "sampled" in key]:  # as records from before sampled arms
        record.pop(key)
    assert "Sampled requests" not in summary_markdown(record)
    counts = {"tokens_from_rounds": 30, "tokens_from_plain_steps": 9}
    record.update(e2e_speedup_sampled={"0.6": {"chat": 1.31, "code": 1.92}, "1": {"chat": 1.2, "code": 1.8}},
                  e2e_sampled_settings=SAMPLED_SETTINGS, sampled_block_sampling="sampled verify draws: per row",
                  policy_round_counts_sampled={t: {"chat": counts, "code": counts} for t in ("0.6", "1")},
                  policy_runs_routed_plain_sampled={t: {"chat": 1, "code": 0} for t in ("0.6", "1")})
    markdown = summary_markdown(record)
    assert "Sampled requests (top_p 0.95, top_k 20, seed 0; sampled verify draws: per row)" in markdown
    assert "| temperature | chat | code |" in markdown
    assert "| 0.6 | 1.31x (30 / 9; 1) | 1.92x (30 / 9; 0) |" in markdown


def test_device_27b_all_lists_the_calls_that_regenerate_readme_s_gpu_records(tmp_path):
    """`bash tools/device_27b.sh all` names every GPU record README quotes and the device calls
    that regenerate it at HEAD, each passing the commit; a part README quotes refuses to run
    where there is no git history and no RECORD_GIT_COMMIT (a device's copy of the tree)."""
    import os

    import records

    env = {**os.environ, "OUT": str(tmp_path / "out")}
    env.pop("RECORD_GIT_COMMIT", None)
    plan = subprocess.run(["bash", str(REPO / "tools" / "device_27b.sh"), "all"], capture_output=True, text=True,
                          env=env, timeout=30)
    assert plan.returncode == 0, plan.stderr
    gpu = [stem for stem in records.quoted_stems()
           if json.loads((EVIDENCE / f"{stem}.json").read_text())["backend"] == "cuda"]
    assert gpu and all(stem in plan.stdout.splitlines()[0] for stem in gpu)
    calls = [line for line in plan.stdout.splitlines() if "bash tools/device_27b.sh " in line]
    assert [line.split("device_27b.sh ")[1].split()[0] for line in calls] == ["parity", "parity-contexts", "parity-tokens", "rounds",
                                                                                   "e2e", "e2e-long", "prefix-4k", "rounds",
                                                                                   "pack", "starts-first", "starts"]
    # bench-cuda-27b-fp32: the round phase again with the real file's fp32 activations
    assert "DENSE_DTYPE=float32 " in calls[7] and sum("DENSE_DTYPE" in line for line in calls) == 1
    try:
        head = git("rev-parse", "HEAD")
        assert all(f"RECORD_GIT_COMMIT={head} " in line for line in calls)
    except (OSError, subprocess.CalledProcessError):
        pass
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "tools", copy / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    refused = subprocess.run(["bash", str(copy / "tools" / "device_27b.sh"), "parity"], capture_output=True, text=True,
                             env=env, timeout=30)
    assert refused.returncode == 3 and "RECORD_GIT_COMMIT=<full hash>" in refused.stderr


def routes_record(**changes):
    """A bench_routes record as it writes them, two passes (warm-up included in routes)."""
    arms = {"plain": (10.0, [0, 0, 0]), "speculative": (12.5, [3, 0, 0]), "speculative, plain steps only": (11.0, [0, 0, 0])}
    record = {
        "backend": "cpu", "device": "cpu", "pack": "tiny-dflash2-pack", "versions": {"mlx": "0.32.2", "mlx_vlm": "0.7.2"},
        "command": "python tools/bench_routes.py --pack PACK --repeats 5", "max_tokens": 8, "repeats": 5,
        "ms_per_token": {arm: {"median": ms, "min": ms - 1, "max": ms + 1, "samples": [ms] * 5}
                         for arm, (ms, _) in arms.items()},
        "plain_over_arm": {arm: 10.0 / ms for arm, (ms, _) in arms.items()},
        "routes": {"plain": ["plain"] * 3, "speculative": ["speculative", "plain", "plain"],
                   "speculative, plain steps only": ["speculative"] * 3},
        "tokens_from_rounds": {arm: rounds for arm, (_, rounds) in arms.items()},
        "tokens_identical": True,
    }
    return {**record, **changes}


def test_bench_routes_summary_gives_each_arm_its_routes_and_ratio_to_plain():
    from bench_routes import summary_markdown

    markdown = summary_markdown(routes_record())
    assert "One greedy request of 8 tokens per arm and pass" in markdown and "5 passes" in markdown
    assert "Tokens identical to plain in every request: True." in markdown
    assert "| plain | 10.00 (9.00-11.00) | 1.000 | 0 speculative, 3 plain | [0, 0, 0] |" in markdown
    assert "| speculative | 12.50 (11.50-13.50) | 0.800 | 1 speculative, 2 plain | [3, 0, 0] |" in markdown
    assert "| speculative, plain steps only | 11.00 (10.00-12.00) | 0.909 | 3 speculative, 0 plain |" in markdown


def test_bench_routes_variants_change_the_round_loop_only_while_flagged(monkeypatch, tmp_path):
    """bench_routes' measurement variants patch the round loop (dflash2_policy's choices,
    dflash2_rounds' steps): with no flag each patched call is the policy's own; no_rounds
    chooses plain steps for the whole request, drop_taps drops the tap a plain step kept,
    worker_stream builds the request on the calling thread's default stream until
    restore_stream. Its arguments are checked before any engine starts."""
    from types import SimpleNamespace

    import mlx.core as mx

    import bench_routes
    import dflash2_policy as policy
    import dflash2_rounds

    calls = []
    # Stand-ins for what the variant wraps (monkeypatch puts the real ones back afterwards).
    monkeypatch.setattr(policy.RoundPolicy, "choose_block", lambda p, remaining: 4)
    monkeypatch.setattr(policy.RoundPolicy, "plain_run", lambda p, remaining: 0)
    monkeypatch.setattr(dflash2_rounds.RequestDecoder, "_plain_step", lambda d, token: d.context.append(token) or token + 1)
    monkeypatch.setattr(dflash2_rounds.RequestDecoder, "__init__", lambda d, *a, **k: calls.append(dflash2_rounds.generation_stream))
    monkeypatch.setattr(dflash2_rounds, "generation_stream", dflash2_rounds.generation_stream)
    served = dflash2_rounds.generation_stream
    variant = bench_routes.Variant()
    rounds, decoder = policy.RoundPolicy, dflash2_rounds.RequestDecoder
    step = SimpleNamespace(context=[])

    assert rounds.choose_block(None, 9) == 4 and rounds.plain_run(None, 9) == 0
    assert decoder._plain_step(step, 1) == 2 and step.context == [1]
    decoder.__init__(step)
    assert calls[-1] == served

    variant.flags = ("no_rounds", "drop_taps", "worker_stream")
    assert rounds.choose_block(None, 9) is None and rounds.plain_run(None, 9) == 9
    assert decoder._plain_step(step, 5) == 6 and step.context == [1]  # the step ran, its tap dropped
    decoder.__init__(step)
    assert calls[-1] == mx.default_stream(mx.default_device()) and calls[-1] != served
    variant.flags = ()
    variant.restore_stream()
    assert dflash2_rounds.generation_stream is served

    with pytest.raises(SystemExit) as refused:
        bench_routes.main(["--pack", str(tmp_path), "--repeats", "4"])
    assert refused.value.code == 2


def starts_record_start(second: bool) -> dict:
    """One start as bench_starts.start returns it: a first that checked everything, a later one
    that took the verdicts from the cache."""
    checks = ({"full_check_because": None, "from_cache": {"kernels": "2025-01-01T00:00:00"}, "measured_s": {}}
              if second else {"full_check_because": "no verdict cache", "from_cache": {}, "measured_s": {"kernels": 41.5}})
    return {"ready_s": 25.0 if second else 80.0, "weights_loaded_s": 12.0, "after_load_s": 13.0 if second else 68.0,
            "milestones_s": {"launch checks": 2.5, "engine started": 3.0, "target loaded": 12.0},
            "start_up_checks": checks, "runtime_log": ["... INFO DFlash2 verify path: compiled (...)"],
            "answer": "def reverse(items):"}


def test_bench_starts_reads_the_server_s_log_time_and_records_its_starts(tmp_path, monkeypatch):
    """bench_starts times a start's weights load from the log line the verdict cache writes, in
    the servers' log format; its record holds its three starts, and a later start that checked
    everything again fails the run after the record is written."""
    import logging

    import bench_starts
    from dflash2_gateway import ScrubbedFormatter

    line = logging.LogRecord("dflash2_verdicts", logging.INFO, __file__, 1, "start-up checks: verdicts cached in %s",
                             ("/tmp/x",), None)
    text = ScrubbedFormatter(lambda text: text).format(line)
    assert bench_starts.LOADED in text and abs(bench_starts.log_time(text) - line.created) < 0.002
    # Each phase's end from the server's own lines, in launch order; a line not found is left out.
    lines = []
    for seconds, message in ((1.5, "launch checks against dflash2-pack.json: ..."), (2.0, "prefill inverse: ..."),
                             (9.5, "start-up checks: verdicts cached in /tmp/x")):
        record = logging.LogRecord("dflash2", logging.INFO, __file__, 1, message, (), None)
        record.created, record.msecs = line.created + seconds, ((line.created + seconds) % 1) * 1000
        lines.append(ScrubbedFormatter(lambda text: text).format(record))
    phases = bench_starts.milestones_s(["noise", *lines], line.created)
    assert list(phases) == ["launch checks", "engine started", "target loaded"]
    assert [abs(got - want) < 0.01 for got, want in zip(phases.values(), (1.5, 2.0, 9.5))] == [True] * 3
    assert bench_starts.milestones_s(lines[:1], line.created) == {"launch checks": phases["launch checks"]}

    pack = tmp_path / "pack"
    pack.mkdir()
    (pack / "serve_dflash2.py").write_text("")
    started = []

    def start(name, pack_dir, workdir, timeout):
        started.append((name, pack_dir, workdir))
        return starts_record_start(name != "first")

    monkeypatch.setattr(bench_starts, "start", start)
    bench_starts.main(["--pack", str(pack), "--out", str(tmp_path / "out")])
    assert [name for name, *_ in started] == ["first", "second", "after a reboot"]
    assert started[0][1:] == started[1][1:] == started[2][1:]  # one HOME and temp folder
    [written] = (tmp_path / "out").glob("starts-*.json")
    record = json.loads(written.read_text())
    assert record["answers_equal"] and record["second_after_load_within_target"]
    assert record["starts"]["second"]["start_up_checks"]["from_cache"] == {"kernels": "2025-01-01T00:00:00"}
    markdown = written.with_suffix(".md").read_text()
    assert "| first | 80.0 | 12.0 | 68.0 | - | kernels 41.5 |" in markdown
    assert "| second | 25.0 | 12.0 | 13.0 | kernels |  |" in markdown
    assert "| after a reboot | 25.0 | 12.0 | 13.0 | kernels |  |" in markdown
    assert ("Second start within 30 s of its weights load: True; the same greedy answer from every start: "
            "True.") in markdown
    assert "The second start's runtime log:\n\n```\n... INFO DFlash2 verify path: compiled (...)\n```" in markdown
    assert "first: launch checks 2.5, engine started 3.0, target loaded 12.0; second: launch checks 2.5" in markdown

    monkeypatch.setattr(bench_starts, "start", lambda name, *args: starts_record_start(False))
    with pytest.raises(SystemExit, match="checked everything again"):
        bench_starts.main(["--pack", str(pack), "--out", str(tmp_path / "again")])
    assert list((tmp_path / "again").glob("starts-*.json"))
    monkeypatch.setattr(bench_starts, "start", lambda name, *args: starts_record_start(True))
    with pytest.raises(SystemExit, match="the first start found verdicts cached"):
        bench_starts.main(["--pack", str(pack), "--out", str(tmp_path / "cached")])


def test_bench_starts_runs_its_starts_over_several_invocations(tmp_path, monkeypatch):
    """With --scratch, the first start in one run (a GPU call) and the others in the next, on the
    same HOME and temp folder; the record comes once the second start ran; a later start
    without a first is refused."""
    import bench_starts

    pack, scratch, out = tmp_path / "pack", tmp_path / "scratch", tmp_path / "out"
    pack.mkdir()
    (pack / "serve_dflash2.py").write_text("")
    started = []
    monkeypatch.setattr(bench_starts, "start", lambda name, pack_dir, workdir, timeout: started.append(
        (name, workdir)) or starts_record_start(name != "first"))
    run = ["--pack", str(pack), "--out", str(out), "--scratch", str(scratch)]
    (scratch / "home").mkdir(parents=True)
    (scratch / "home" / "verdicts.json").write_text("{}")  # an earlier run's: a first start finds none
    bench_starts.main([*run, "--starts", "first"])
    assert started == [("first", scratch)] and not out.exists() and not (scratch / "home").exists()
    bench_starts.main([*run, "--starts", "second,after a reboot"])
    assert started[1:] == [("second", scratch), ("after a reboot", scratch)]
    record = json.loads((out / "starts-cpu.json").read_text())
    assert list(record["starts"]) == ["first", "second", "after a reboot"] and record["answers_equal"]
    with pytest.raises(SystemExit) as refused:
        bench_starts.main([*run[:-1], str(tmp_path / "fresh"), "--starts", "second"])
    assert refused.value.code == 2
    with pytest.raises(SystemExit):
        bench_starts.main([*run, "--starts", "third"])


def test_bench_starts_after_a_reboot_finds_the_temp_folder_emptied(tmp_path, monkeypatch):
    """A reboot empties the temp folder and keeps the user's cache (HOME): the start after one
    runs in the same temp folder, emptied; the other starts find it as the last one left it."""
    import bench_starts

    seen = []

    class Server:
        def __init__(self, name, command, workdir, cwd, tmpdir):
            seen.append((name, tmpdir, sorted(path.name for path in tmpdir.glob("*"))))
            tmpdir.mkdir(parents=True, exist_ok=True)
            (tmpdir / f"left-by-{name}").write_text("")

        def wait_ready(self, timeout):
            return {"start_up_checks": {}}

        def log(self):
            return "2026-01-01 00:00:00,000 INFO start-up checks: ...\n"

        def stop(self):
            pass

    monkeypatch.setattr(bench_starts, "ServerProcess", Server)
    monkeypatch.setattr(bench_starts, "greedy_answer", lambda server: "same")
    for name in bench_starts.STARTS:
        bench_starts.start(name, tmp_path / "pack", tmp_path, 5)
    assert seen == [("first", tmp_path / "tmp", []), ("second", tmp_path / "tmp", ["left-by-first"]),
                    ("after-a-reboot", tmp_path / "tmp", [])]


def test_make_evidence_runs_parity_then_bench_on_the_pack(tmp_path, monkeypatch):
    """make_evidence runs tools/parity.py and tools/bench.py on the pack, both writing into
    PACK/evidence (or --out); a tool that fails fails the run, after the other still ran."""
    import make_evidence

    ran, failing = [], set()

    def run(command):
        ran.append(command)
        return subprocess.CompletedProcess(command, 1 if Path(command[1]).name in failing else 0)

    monkeypatch.setattr(make_evidence.subprocess, "run", run)
    pack = tmp_path / "pack"
    monkeypatch.setattr(sys, "argv", ["make_evidence.py", "--pack", str(pack)])
    assert make_evidence.main() == 0
    assert ran == [[sys.executable, str(REPO / "tools" / tool), "--pack", str(pack), "--out", str(pack / "evidence")]
                   for tool in ("parity.py", "bench.py")]
    assert all(Path(command[1]).is_file() for command in ran)

    ran.clear()
    failing.add("parity.py")
    monkeypatch.setattr(sys, "argv", ["make_evidence.py", "--pack", str(pack), "--out", str(tmp_path / "out")])
    assert make_evidence.main() == 1
    assert [Path(command[1]).name for command in ran] == ["parity.py", "bench.py"]
    assert all(command[-1] == str(tmp_path / "out") for command in ran)


# schemathesis's failure report as the battery's record at 2b542e7 kept it (the request cut short).
TIMEOUT_REPORT = """______________________________ POST /v1/messages _______________________________
1. Test Case ID: OWkn3Y

- ST101 Server error

[504] Gateway Timeout:

    `{"type": "error", "error": {"type": "timeout_error", "message": "the request did not finish within 30 s \
(the server's --request-timeout)", "param": null, "code": "request-timeout"}}`

Reproduce with:

    curl -X POST -H 'Content-Type: application/json' -d '{"messages": []}' http://127.0.0.1:1/v1/messages
"""


def test_the_battery_counts_a_schemathesis_request_timeout_apart():
    """tools/battery.py reads each answer in schemathesis's failure report: a 504 of
    --request-timeout on the CPU (as the record at 2b542e7 had) is a timeout under load, not a
    failure; any other answer, or a failure whose answer it cannot read, fails the run."""
    from battery import failure_answers, schemathesis_failed

    negative = {"failures": ["\u274c ST101 Server error: 1"], "failure_report": TIMEOUT_REPORT}
    timeouts = failure_answers(negative["failure_report"])
    assert timeouts == [(504, "request-timeout")] and negative["failures"]
    assert not schemathesis_failed(negative["failures"], timeouts)
    crashed = negative["failure_report"].replace("[504] Gateway Timeout", "[500] Internal Server Error").replace(
        '"code": "request-timeout"', '"code": "internal-error"')
    assert failure_answers(crashed) == [(500, "internal-error")]
    assert schemathesis_failed(negative["failures"], failure_answers(crashed))
    assert failure_answers("[500] Internal Server Error:\n\n    `not json`\n") == [(500, None)]
    assert schemathesis_failed(negative["failures"], []) and not schemathesis_failed([], [])


def test_the_battery_lists_the_servers_own_time_limit_apart_from_client_errors():
    """A 504 of --request-timeout or a 503 of shutdown is the server's own limit: listed by
    request apart from the 5xx answered to client errors, which fail the run."""
    from types import SimpleNamespace

    from battery import Tally, limited

    tally = Tally(SimpleNamespace(local_paths=[]))
    tally.note("huge prompt", 504, {}, b'{"error": {"code": "request-timeout"}}')
    tally.note("stopping", 503, {}, b'{"error": {"code": "shutting-down"}}')
    tally.note("bad tools", 500, {}, b'{"error": {"code": "server-error"}}')
    assert [answer.split(":")[0] for answer in tally.limit_5xx] == ["huge prompt", "stopping"]
    assert [answer.split(":")[0] for answer in tally.client_5xx] == ["bad tools"]
    assert tally.by_class == {"5xx": 3} and limited(tally.limit_5xx).startswith("2 (huge prompt: 504 ")
    assert limited([]) == "0"


def test_the_schemathesis_hooks_keep_answers_short_and_positive_cases_valid(monkeypatch):
    """tools/schemathesis_hooks.py, loaded from its file as schemathesis loads SCHEMATHESIS_HOOKS
    (tools/battery.py, tests/test_openapi_schemathesis.py), registers map_case: token limits
    within the context come down to MAX_TOKENS (one is added to chat and Responses bodies that
    ask none; Messages requires its own), values past the context and non-integers stay for the
    server to refuse; a positive case gets real images and tool names that are unique and named;
    with SCHEMATHESIS_MAX_PROMPT_BYTES, long valid requests that generate are not sent."""
    import importlib.util
    from types import SimpleNamespace

    hooks = pytest.importorskip("schemathesis.hooks")
    spec = importlib.util.spec_from_file_location("battery_schemathesis_hooks", REPO / "tools" / "schemathesis_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        assert module.map_case in hooks.GLOBAL_HOOK_DISPATCHER.get_all_by_name("map_case")
        chat, short = "/v1/chat/completions", module.MAX_TOKENS
        assert module.short(chat, {"messages": [], "max_tokens": 100}) == {"messages": [], "max_tokens": short}
        assert module.short(chat, {"messages": [], "max_tokens": 100.0}) == {"messages": [], "max_tokens": short}
        assert module.short(chat, {"messages": [], "max_completion_tokens": 9}) == {
            "messages": [], "max_completion_tokens": short}
        assert module.short(chat, {"messages": []}) == {"messages": [], "max_tokens": short}
        past = {"messages": [], "max_tokens": module.CONTEXT + 1, "max_completion_tokens": True}
        assert module.short(chat, dict(past)) == past
        assert module.short(chat, {"messages": [], "max_tokens": 2}) == {"messages": [], "max_tokens": 2}
        assert module.short(chat, {"messages": [], "max_tokens": 9.5}) == {"messages": [], "max_tokens": 9.5}
        assert module.short("/v1/responses", {"input": "hi"}) == {"input": "hi", "max_output_tokens": short}
        assert module.short(chat, {"max_tokens": None, "max_completion_tokens": None}) == {
            "max_tokens": short, "max_completion_tokens": None}
        assert module.short("/v1/messages", {"messages": []}) == {"messages": []}
        assert module.short("/v1/messages/count_tokens", {"messages": []}) == {"messages": []}
        assert module.short(chat, ["not", "a", "dict"]) == ["not", "a", "dict"]

        body = module.made_valid({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x", "detail": "low"}},
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {"type": "url", "url": ""}}]}]}],
            "tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f", "x": 1}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}})
        assert body["messages"][0]["content"][0]["image_url"] == {"url": module.PNG_URL, "detail": "low"}
        assert body["messages"][0]["content"][1]["content"][0]["source"]["data"] == module.PNG
        assert body["tools"] == [{"type": "function", "function": {"name": "f"}}]
        assert body["tool_choice"]["function"]["name"] == "f"
        body = module.made_valid({"input": [{"type": "function_call_output", "call_id": "c", "output": [
            {"type": "input_image", "image_url": ""}]}], "tool_choice": {"type": "function", "name": "g"}})
        assert body == {"input": [{"type": "function_call_output", "call_id": "c", "output": [
            {"type": "input_image", "image_url": module.PNG_URL}]}]}

        def case(path, positive, body):
            mode = SimpleNamespace(is_positive=positive)
            return SimpleNamespace(operation=SimpleNamespace(path=path), body=body,
                                   meta=SimpleNamespace(generation=SimpleNamespace(mode=mode)))
        long = {"messages": [{"role": "user", "content": "x" * 500}]}
        assert module.filter_case(None, case(chat, True, long))  # no limit set
        monkeypatch.setenv("SCHEMATHESIS_MAX_PROMPT_BYTES", "400")
        assert not module.filter_case(None, case(chat, True, long))
        assert module.filter_case(None, case(chat, False, long))  # invalid requests are all sent
        assert module.filter_case(None, case("/v1/messages/count_tokens", True, long))  # generates nothing
        assert module.filter_case(None, case(chat, True, {"messages": [{"role": "user", "content": "x"}]}))
    finally:
        hooks.unregister(module.map_case)
        hooks.unregister(module.filter_case)


def test_device_27b_runs_only_tools_that_exist():
    """Every tool a device_27b.sh part runs is where the part says (tools/ or tools/lab/)."""
    import re

    script = (REPO / "tools" / "device_27b.sh").read_text()
    named = set(re.findall(r"python3 (tools/[\w/]+\.py)", script))
    assert {"tools/bench.py", "tools/parity.py", "tools/lab/kernel_parity.py"} <= named
    assert [path for path in sorted(named) if not (REPO / path).is_file()] == []


def test_readme_s_speedups_mark_profiles_the_policy_routed_plain():
    """A policy arm whose last run took no token from rounds compares plain with plain: its
    cell says routed plain, in the greedy row and the sampled one."""
    import records

    record = json.loads((EVIDENCE / "bench-cuda-27b.json").read_text())
    record.update(tokens_per_round={"chat": 2.0, "code": 4.5}, e2e_speedup={"chat": 0.98, "code": 2.2},
                  policy_round_counts={"chat": {"tokens_from_rounds": 0}, "code": {"tokens_from_rounds": 39}},
                  e2e_sampled_settings={"top_p": 0.9, "top_k": 40, "seed": 0},
                  e2e_speedup_sampled={"0.6": {"code": 1.9}},
                  policy_round_counts_sampled={"0.6": {"code": {"tokens_from_rounds": 0}}})
    assert records.end_to_end(record) == "2.0: 0.98x (routed plain), 4.5: 2.20x"
    assert records.sampled_end_to_end(record) == "top_p 0.9, top_k 40; temperature 0.6: 4.5: 1.90x (routed plain)"


def test_parity_measures_the_fp32_layout_under_its_own_record_name(tmp_path):
    """--dense-dtype float32 (the real 27B file's layout): the synthetic target's activations
    run fp32, and the record, named -fp32, says so beside the default fp16 one's name; its
    contexts part, in a second process, adds its cases and controls to the verify part's."""
    parts = {}
    for part in ("verify", "contexts"):
        result = subprocess.run([sys.executable, str(REPO / "tools" / "parity.py"), "--size", "tiny", "--dense-dtype",
                                 "float32", "--part", part, "--max-tokens", "8", "--kernel-shapes", "tiny",
                                 "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        parts[part] = json.loads((tmp_path / "parity-cpu-fp32.json").read_text())
    record = parts["contexts"]
    assert record["dense_dtype"] == "float32" and record["activation_dtype"] == "float32"
    assert record["exact_mismatches"] == 0 and not (tmp_path / "parity-cpu.json").exists()
    assert record["parts"] == ["verify", "contexts"] and "--part contexts" in record["contexts_command"]
    verify = parts["verify"]
    assert "kernel_self_test_fp32" in verify and "kernel_self_test_fp32" in record  # fp32 rows' own kernel
    assert record["cases"][:len(verify["cases"])] == verify["cases"] and len(record["cases"]) > len(verify["cases"])
    assert len(record["stock_cases"]) > len(verify["stock_cases"])
    assert {case["check"] for case in record["cases"][len(verify["cases"]):]} >= {"prefill routes", "verify", "rollback"}


@pytest.mark.parametrize("environment, profiles", [
    ({}, None),  # every profile, as README's record measures
    ({"DENSE_DTYPE": "float32"}, "code,median"),  # all 18 arms' pass does not fit the call in fp32
    ({"DENSE_DTYPE": "float32", "PROFILES": ""}, None),  # asked for all
    ({"PROFILES": "chat"}, "chat"),
])
def test_device_27b_e2e_measures_the_profiles_that_fit_a_call(tmp_path, environment, profiles):
    """`device_27b.sh e2e` hands bench.py the profiles: all by default, code and median for the
    fp32 layout unless PROFILES says otherwise (a stub python3 records the command)."""
    import os

    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python3").write_text('#!/bin/sh\necho "$@" >> "$ARGS_LOG"\n')
    (stub / "python3").chmod(0o755)
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "tools", copy / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    for suffix in ("", "-fp32"):  # the round phase's record, carried in as after a cold machine
        (copy / ".gpu" / "b27").mkdir(parents=True, exist_ok=True)
        (copy / ".gpu" / "b27" / f"bench-cuda-27b{suffix}.json").write_text("{}")
    log = tmp_path / "args.log"
    env = {name: value for name, value in os.environ.items() if name not in ("PROFILES", "DENSE_DTYPE", "SAMPLED")}
    env.update(PATH=f"{stub}:{os.environ['PATH']}", ARGS_LOG=str(log), OUT=str(tmp_path / "out"),
               RECORD_GIT_COMMIT="0" * 40, RECORD_GIT_CLEAN="1", **environment)
    ran = subprocess.run(["bash", str(copy / "tools" / "device_27b.sh"), "e2e"], capture_output=True, text=True,
                         env=env, cwd=copy, timeout=30)
    assert ran.returncode == 0, ran.stderr
    command = log.read_text().split()
    assert command[0] == "tools/bench.py" and "--part" in command and "e2e" in command
    assert (command[command.index("--profiles") + 1] if "--profiles" in command else None) == profiles


def test_the_policy_simulation_records_every_table_and_workload_and_its_commit(tmp_path, monkeypatch):
    """tools/simulate_policy.py writes the policy against every fixed block for each of the
    record's three tables, both answer lengths and five workloads, naming its commit."""
    import simulate_policy

    calls = []
    serve = simulate_policy.serve
    monkeypatch.setattr(simulate_policy, "serve", lambda *args: calls.append(args) or serve(*args))
    monkeypatch.setattr(simulate_policy, "PASSES", 1)
    monkeypatch.setattr(simulate_policy, "REQUESTS", {40: 4, 256: 2})
    monkeypatch.setattr(sys, "argv", ["simulate_policy.py", "--out", str(tmp_path)])
    simulate_policy.main()
    assert len(calls) == 3 * 2 * 5 * 8  # tables, lengths, workloads, the policy and 7 fixed blocks: one pass
    record = json.loads((tmp_path / "policy-simulation.json").read_text())
    assert len(record["git_commit"]) == 40 and record["passes"] == 1 and record["first_seed"] == 1000
    assert list(record["results"]) == ["start-up", "median arm at its start", "learned"]
    for by_tokens in record["results"].values():
        assert list(by_tokens) == ["40", "256"]
        for by_workload in by_tokens.values():
            assert list(by_workload) == ["zero", "chat", "median", "code", "mixed"]
            assert all(len(cell["fixed_blocks"]) == 7 for cell in by_workload.values())
    summary = (tmp_path / "policy-simulation.md").read_text()
    assert record["git_commit"] in summary and "{" not in summary and "1 passes' ratios, seeds from 1000" in summary
    assert "Worst policy over best, by workload: zero" in summary and "; plain 1.00; " in summary


def test_pipelined_decode_steps_decode_as_generation_does():
    """The pipelined decode steps bench's arm and the decode arms' timing take: `count` greedy
    steps, each queued before the token before it is read, the tokens plain greedy decoding
    gives and the cache `count` positions on."""
    import mlx.core as mx

    import dflash2_decode_arms
    from make_synthetic_pack import build_target_model

    lm = build_target_model("tiny", seed=0).language_model
    prompt = mx.array([[3, 5, 7, 9]])
    cache = lm.make_cache()
    mx.eval(lm(prompt, cache=cache).logits)
    fed, events, forward, queue = [], [], lm.__call__, mx.async_eval

    class Recording:  # what each step is fed, read after it was evaluated
        def __call__(self, token, cache):
            fed.append(token)
            events.append("forward")
            return forward(token, cache=cache)

    def queued(*arrays):
        events.append(("queued", arrays[0]))
        return queue(*arrays)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mx, "async_eval", queued)
        dflash2_decode_arms.pipelined_decode_steps(Recording(), cache)(4)
    assert cache[lm.model.fa_idx].offset == 4 + 4
    # Each step queued as it is built, and the next one fed that very (queued) token.
    assert [e if e == "forward" else "queued" for e in events] == ["forward", "queued"] * 4
    assert all(events[2 * i + 1][1] is fed[i + 1] for i in range(3))
    plain, token = lm.make_cache(), mx.array([[7]])
    mx.eval(lm(prompt, cache=plain).logits)
    for step in range(4):
        assert fed[step].tolist() == token.tolist(), step
        logits = lm(token, cache=plain).logits[:, -1, :]
        token = mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)[:, None]
