"""Serve the pack with DFlash2 speculative decoding, routed request by request.

    python serve_dflash2.py [--port 8080] [--enable-thinking] [--no-dflash2] [--pack DIR]
    python serve_dflash2.py --demo        # serves the trained tiny pair in fixtures/tiny-pair

Speculation reproduces plain decoding only for greedy requests, so each chat request
is routed, and every response says how in its x-dflash2 header:
- speculative: explicit temperature 0, no logprobs, no penalties, no logit_bias, n=1
  (images too, unless --dflash2-multimodal plain);
- fallback; reason=R: served plain. Per request R is temperature-omitted (the pack's
  sampling defaults apply), sampling, logprobs, penalties, logit-bias or multimodal-plain;
  for every request it is no-dflash2 (--no-dflash2), kernel-self-test-failed or
  speculative-warm-up-failed;
- refused; reason=R: thinking-budget, structured-output, n-above-1, and the gateway's
  refusals (serve.py, dflash2_http.py; README lists them all).
Responses that generate nothing (/v1/models, /health) carry the server's mode.
A speculative request runs rounds only while they pay: dflash2_policy picks each round's
block, or plain decode steps, from a round cost table measured at start-up (in /health) and
the request's acceptance; its timings say how many tokens came from rounds and from plain steps.
The hardening (loopback only, exact pass-through options, refused environment, path
scrubbing, one sequence at a time) is serve.py's.
"""

import hashlib
import json
import logging
import sys
from pathlib import Path

from dflash2_http import Refusal, check_chat_request, has_images
from serve import (
    Decision,
    Gateway,
    PathScrubber,
    exit_if_environment_refused,
    exit_if_pack_invalid,
    int_in,
    local_paths,
    make_parser,
    pack_limits,
    parse_args,
    pass_options_to_mlx_vlm,
    public_model_id,
    serve,
    setup_logging,
    start_engine,
    warm_up,
)

logger = logging.getLogger("dflash2.server")

HERE = Path(__file__).resolve().parent
PINS_FILE = "dflash2-pack.json"
DEMO_MODEL_ID = "dflash2-demo-tiny"
DEMO_PACK = HERE / "fixtures" / "tiny-pair"
# The demo's fixed verify block. On a CPU no round pays for itself (a verify of B tokens costs
# about B decode steps), so the adaptive policy would serve plain steps and the drafter's work
# would not show; a fixed block runs a round every time.
DEMO_BLOCK_SIZE = 4
HASH_CHUNK = 8 * 1024 * 1024

# Penalty values that change nothing; a client sending them still gets speculation.
NEUTRAL_PENALTIES = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1}


def make_dflash2_parser():
    parser = make_parser("serve_dflash2.py", "Serve the pack's model with DFlash2 speculative decoding.")
    parser.add_argument("--demo", action="store_true",
                        help="serve the trained tiny target + drafter pair (fixtures/tiny-pair of the "
                             f"source repository; a fixture, not the 27B) with a fixed block of {DEMO_BLOCK_SIZE}")
    parser.add_argument("--verify-pack", action="store_true",
                        help="check the pack (SHA256SUMS, pins, schema, drafter fit, kernel self-test), "
                             "print a pass/fail table and exit 0 or 1 without serving")
    parser.add_argument("--no-dflash2", action="store_true",
                        help="serve the same wrapper without the drafter (like-for-like baseline)")
    dflash2 = parser.add_argument_group("DFlash2 options")
    dflash2.add_argument("--dflash2-multimodal", choices=["speculative", "plain"], default="speculative",
                         help="route requests with images speculative (default) or plain")
    dflash2.add_argument("--dflash2-full-hash", action="store_true",
                         help=f"re-hash every file pinned in {PINS_FILE} at launch (slow for real packs)")
    dflash2.add_argument("--dflash2-block-size", type=int_in(2, 8),
                         help="experimental: fixed verify block instead of the adaptive one")
    dflash2.add_argument("--dflash2-block-cap", type=int_in(2, 8),
                         help="experimental: upper bound for the adaptive verify block")
    dflash2.add_argument("--dflash2-candidate-selector", action="store_true",
                         help="experimental: draft greedily through the trained candidate selector")
    dflash2.add_argument("--dflash2-sliding-window", action="store_true",
                         help="experimental: the drafter attends to its sliding_window last context "
                              "positions only (flat drafter memory)")
    dflash2.add_argument("--dflash2-round-costs", type=Path, metavar="FILE",
                         help="use this round cost table (JSON, as /health's round_costs, measured on "
                              "this machine) instead of measuring it at start-up")
    return parser


# ---------------------------------------------------------------------------------------
# Routing


def route_chat(body: dict, *, server_reason=None, multimodal_plain=False) -> Decision:
    """Refuses what the pack does not serve, then routes speculative or plain with a reason.

    The refusals hold with --no-dflash2 too, so the baseline answers the same requests.
    """
    if "thinking_budget" in body:
        raise Refusal(400, "thinking-budget", "thinking budgets are not supported; use "
                                              "\"enable_thinking\" and max_tokens", "thinking_budget")
    if body.get("response_format", {}).get("type", "text") != "text":
        raise Refusal(400, "structured-output",
                      "structured output (response_format) is not supported", "response_format")
    body.pop("response_format", None)
    for name, neutral in NEUTRAL_PENALTIES.items():
        if body.get(name) == neutral:
            del body[name]
    if body.get("logit_bias") == {}:
        del body["logit_bias"]
    reason = server_reason or fallback_reason(body, multimodal_plain)
    return Decision("fallback" if reason else "speculative", reason, body)


def fallback_reason(body: dict, multimodal_plain: bool):
    """Why speculation could not give this request plain decoding's answer, or None."""
    if "temperature" not in body:
        return "temperature-omitted"  # the pack's sampling defaults apply
    if body["temperature"] > 0:
        return "sampling"
    if body.get("logprobs") or body.get("top_logprobs"):
        return "logprobs"
    if any(name in body for name in NEUTRAL_PENALTIES):
        return "penalties"
    if "logit_bias" in body:
        return "logit-bias"
    if multimodal_plain and has_images(body):
        return "multimodal-plain"
    return None


# ---------------------------------------------------------------------------------------
# Launch checks


def sha256_file(path: Path, progress=None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            if progress is not None:
                progress.update(len(chunk))
    return digest.hexdigest()


def safetensors_header_sha256(path: Path) -> str:
    """sha256 of the 8-byte header length and the JSON header: every tensor's name,
    dtype, shape and offsets, read without touching the weights."""
    with open(path, "rb") as f:
        length_bytes = f.read(8)
        length = int.from_bytes(length_bytes, "little")
        return hashlib.sha256(length_bytes + f.read(length)).hexdigest()


def read_pins(pack_dir: Path) -> dict:
    """dflash2-pack.json, checked for the shape the launch checks read; raises ValueError
    with a one-line message otherwise."""
    try:
        pins = json.loads((pack_dir / PINS_FILE).read_text())
    except OSError as error:
        raise ValueError(f"{PINS_FILE}: cannot be read ({error.strerror})") from None
    except ValueError as error:
        raise ValueError(f"{PINS_FILE}: not valid JSON ({error})") from None
    files = pins.get("files") if isinstance(pins, dict) else None
    if not isinstance(files, dict) or not isinstance(pins.get("runtime", {}), dict):
        raise ValueError(f'{PINS_FILE}: expected {{"files": {{...}}, "runtime": {{...}}}}')
    for name, pin in files.items():
        hashes = ("sha256", "header_sha256") if name.endswith(".safetensors") else ("sha256",)
        well_formed = (
            isinstance(pin, dict) and isinstance(pin.get("size"), int)
            and all(isinstance(pin.get(key), str) for key in hashes)
            and not Path(name).is_absolute() and ".." not in Path(name).parts
        )
        if not well_formed:
            raise ValueError(f'{PINS_FILE}: files[{name!r}]: expected a path inside the pack with '
                             f'{{"size": bytes, {", ".join(repr(h) + ": hex" for h in hashes)}}}')
    return pins


def check_pins(pack_dir: Path, full_hash: bool) -> list:
    """Compares the pack folder with dflash2-pack.json; returns one line per failure.

    dflash2-pack.json holds {"files": {"<path in the pack>": {"size": bytes, "sha256": hex,
    "header_sha256": hex}}} (header_sha256 for .safetensors files). At launch every pinned
    file's size is checked, small files (configs, README, tokenizer, template) are hashed
    whole, and weights by their safetensors header; --dflash2-full-hash hashes every file.
    """
    from tqdm import tqdm

    try:
        pins = read_pins(pack_dir)["files"]
    except ValueError as error:
        return [str(error)]
    failures, to_hash = [], []
    for name, pin in sorted(pins.items()):
        path = pack_dir / name
        if not path.is_file():
            failures.append(f"{name}: missing (expected size {pin['size']})")
            continue
        size = path.stat().st_size
        if size != pin["size"]:
            failures.append(f"{name}: size expected {pin['size']}, actual {size}")
            continue
        if name.endswith(".safetensors") and not full_hash:
            actual = safetensors_header_sha256(path)
            if actual != pin["header_sha256"]:
                failures.append(f"{name}: safetensors header sha256 expected {pin['header_sha256']}, "
                                f"actual {actual}")
        else:
            to_hash.append((name, path, pin))
    with tqdm(total=sum(path.stat().st_size for _, path, _ in to_hash), unit="B", unit_scale=True,
              desc="sha256", disable=not full_hash) as progress:
        for name, path, pin in to_hash:
            actual = sha256_file(path, progress)
            if actual != pin["sha256"]:
                failures.append(f"{name}: sha256 expected {pin['sha256']}, actual {actual}")
    return failures


def read_round_costs(path: Path):
    """The --dflash2-round-costs table, or exit with what is wrong with the file."""
    from dflash2_policy import RoundCosts

    try:
        return RoundCosts.from_json(json.loads(path.read_text()))
    except (OSError, ValueError) as error:
        sys.exit(f"error: --dflash2-round-costs {path.name}: {error}")


def demo_pack() -> Path:
    """The trained tiny pair (DIR/target, DIR/drafter), checked against its SHA256SUMS."""
    sums = DEMO_PACK / "SHA256SUMS"
    if not sums.is_file():
        sys.exit("error: --demo needs fixtures/tiny-pair from the source repository; a downloaded "
                 "pack folder does not ship it. Run the pack itself without --demo.")
    for line in sums.read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        path = DEMO_PACK / name
        if not path.is_file() or sha256_file(path) != digest:
            sys.exit(f"error: fixtures/tiny-pair/{name} differs from its SHA256SUMS; "
                     "regenerate the pair with tools/train_tiny_pair.py")
    return DEMO_PACK


# ---------------------------------------------------------------------------------------


def main(argv=None):
    parser = make_dflash2_parser()
    args = parse_args(parser, argv)
    exit_if_environment_refused()
    if args.demo and args.pack:
        parser.error("--demo serves the trained tiny pair; leave out --pack")
    if args.demo and args.dflash2_block_size is None:
        args.dflash2_block_size = DEMO_BLOCK_SIZE
    from dflash2_pack import find_pack

    pack_dir = demo_pack() if args.demo else (args.pack or HERE).absolute()
    if args.verify_pack:
        from dflash2_pack import format_verify_table, verify_pack

        results = verify_pack(pack_dir)
        print(format_verify_table(results))
        sys.exit(0 if all(ok for _, ok, _ in results) else 1)
    target_dir, drafter_dir = find_pack(pack_dir)  # flat release layout, or target/ + drafter/
    model_id = public_model_id(args.model_id or (DEMO_MODEL_ID if args.demo else None), pack_dir)
    scrubber = PathScrubber(local_paths([pack_dir, target_dir, drafter_dir], model_id))
    setup_logging(args.log_level, scrubber)

    if (pack_dir / PINS_FILE).is_file():
        failures = check_pins(pack_dir, args.dflash2_full_hash)
        if failures:
            sys.exit(f"error: the pack differs from {PINS_FILE}:\n  " + "\n  ".join(failures))
        if args.dflash2_full_hash:
            logger.info("launch checks against %s: every file's sha256 matches", PINS_FILE)
        else:
            logger.info("launch checks against %s: sizes, small files' sha256 and safetensors headers "
                        "match; weight data not hashed (--dflash2-full-hash or --verify-pack hash it)",
                        PINS_FILE)
    else:
        logger.warning("no %s in the pack folder: file pins not checked", PINS_FILE)
    # A missing drafter/ folder is reported by its config.json; --no-dflash2 needs none.
    exit_if_pack_invalid(target_dir, None if args.no_dflash2 else drafter_dir or pack_dir / "drafter")
    limits = pack_limits(target_dir, model_id, args)

    speculation = {"reason": "no-dflash2" if args.no_dflash2 else None, "error": None, "round_costs": None}
    given_costs = read_round_costs(args.dflash2_round_costs) if args.dflash2_round_costs else None

    def load_drafter(model):
        # Runs on mlx-vlm's worker thread, right after it loaded the target.
        import dflash2_policy
        import dflash2_runtime
        from mlx_vlm.speculative.drafters import load_drafter as load_stock_drafter
        from mlx_vlm.speculative.drafters import validate_drafter_compatibility

        options = dflash2_runtime.RuntimeOptions(block_size=args.dflash2_block_size,
                                                 block_cap=args.dflash2_block_cap,
                                                 candidate_selector=args.dflash2_candidate_selector,
                                                 sliding_window=args.dflash2_sliding_window)
        try:
            status = dflash2_runtime.install(model)
        except dflash2_runtime.RuntimeMismatch as mismatch:
            speculation["error"] = str(mismatch)
            return None, None
        logger.info("DFlash2 runtime: backend %s, speculation %s", status.backend,
                    "on" if status.speculative else f"off ({status.reason})")
        if not status.speculative:
            speculation["reason"] = status.reason.split(":")[0]  # e.g. kernel-self-test-failed
            return None, None
        drafter, kind = load_stock_drafter(str(drafter_dir), kind="dflash")
        validate_drafter_compatibility(model, drafter, kind)
        try:
            dflash2_runtime.configure_drafter(drafter, options)
        except ValueError as error:  # e.g. a block size beyond what the drafter was trained for
            speculation["error"] = f"--dflash2-* options: {error}"
            return None, None
        # What a round costs here decides, per request, each round's block or plain steps.
        try:
            drafter.round_costs = given_costs or dflash2_policy.measure_round_costs(model, drafter)
        except Exception:
            logger.exception("measuring the round costs failed; every request is served plain")
            speculation["reason"] = "speculative-warm-up-failed"
            return None, None
        logger.info("DFlash2 round costs (%s): %s", "from --dflash2-round-costs" if given_costs else "measured",
                    drafter.round_costs.summary())
        speculation["round_costs"] = drafter.round_costs.to_json()
        return drafter, kind

    pass_options_to_mlx_vlm(args)
    generator, inner_app = start_engine(
        target_dir, model_id, prefill_step_size=args.prefill_step_size,
        top_logprobs_k=args.top_logprobs_k, load_drafter=None if args.no_dflash2 else load_drafter)
    if speculation["error"]:
        generator.stop_and_join()
        sys.exit(f"error: {speculation['error']}")
    server_reason = speculation["reason"]
    if not server_reason:
        try:
            warm_up(generator, "speculative")
        except Exception:
            # Serving plain beats failing every greedy request; the header says why.
            logger.exception("the speculative warm-up failed; every request is served plain")
            server_reason, generator.pack_drafter = "speculative-warm-up-failed", None
    warm_up(generator, "plain")

    server_mode = ("fallback", server_reason) if server_reason else ("speculative", None)

    def decide(body):
        return route_chat(check_chat_request(body, limits), server_reason=server_reason,
                          multimodal_plain=args.dflash2_multimodal == "plain")

    health = {"dflash2": server_mode[0], "reason": server_reason, "round_costs": speculation["round_costs"]}
    serve(Gateway(inner_app, model_id=model_id, scrubber=scrubber, decide=decide, header="x-dflash2",
                  server_mode=server_mode, health=health, request_timeout=args.request_timeout), args)


if __name__ == "__main__":
    main()
