"""The command line and environment both servers accept, checked before mlx-vlm is imported.

Options reach mlx-vlm only by exact name; the servers listen on 127.0.0.1 or localhost only;
inherited environment variables that change generation, caching or batching stop the
server (mlx_vlm.server reads them at import); the options are checked against the pack.
"""

import argparse
import atexit
import importlib.metadata
import json
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from dflash2_file_hashes import user_cache_folder
from dflash2_kernel_folder import nvidia_setup, remove_cut_entries, setup_folder_name
from dflash2_requests import PackLimits

LOOPBACK_HOSTS = ("127.0.0.1", "localhost")
DEFAULT_PORT = 8080
# Characters a prompt may average per context token before it is refused untokenized (the
# default --max-prompt-chars): text far above any tokenizer's usual 3-5 would tie up the
# tokenizer (about a second a megabyte, one request at a time) for a prompt that cannot fit.
PROMPT_CHARS_PER_TOKEN = 16
DEFAULT_REQUEST_TIMEOUT_S = 600
DEFAULT_PREFIX_CACHE_GB = 8.0
MAX_PREFILL_STEP = 4096
# With the prefix cache a next turn re-prefills from the last multiple of the step in its
# history: on an H200 at the 27B shape a 4k-token next turn took 14-16% of its cold time at
# 256 and 55% at mlx-vlm's 2048, for a first turn about a quarter slower
# (evidence/prefix-cache-cuda-27b-steps.md). Without the cache mlx-vlm's step stands.
PREFIX_CACHE_PREFILL_STEP = 256
MODEL_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")

# Environment variables mlx-vlm reads for generation, caching or batching. An inherited
# one would silently change what the pack serves, so the server refuses to start.
REFUSED_ENV_NAMES = {
    "MAX_KV_SIZE",
    "PREFILL_STEP_SIZE",
    "QUANTIZED_KV_START",
    "TOP_LOGPROBS_K",
    "EXPERT_CACHE_GB",
    "MLX_TRUST_REMOTE_CODE",
}
REFUSED_ENV_PREFIXES = ("KV_", "MLX_VLM_", "APC_")


def refused_environment(environ) -> list:
    """Names of inherited variables the server must not run with (APC_ENABLED=0 is fine)."""
    return sorted(
        name
        for name, value in environ.items()
        if (name in REFUSED_ENV_NAMES or name.startswith(REFUSED_ENV_PREFIXES))
        and not (name == "APC_ENABLED" and value == "0")
    )


def exit_if_environment_refused():
    names = refused_environment(os.environ)
    if names:
        sys.exit(
            "error: these inherited environment variables change generation, caching or "
            "batching and are not accepted; unset them and start again: " + ", ".join(names)
        )


_run_temp_folders = []  # made for this run alone: removed at exit


def _private_folder(path: Path, top: Optional[Path] = None) -> bool:
    """Makes `path` (and with `top` each folder from `top` down to it) 0700 unless it exists;
    whether it is a folder, not a link another user made and could point elsewhere later, of
    this user's alone, and each folder above it up to `top` one of this user's no one else can
    write (or swap `path` for another). With `top`, a folder of the chain this user owns loses
    what others could do there (a umask of 002 leaves folders group-writable)."""
    try:
        chain = [path] if top is None else [path, *path.parents[:len(path.relative_to(top).parts)]]
        chain[-1].parent.mkdir(parents=True, exist_ok=True)
        for folder in reversed(chain):  # each one made here 0700, whatever the umask would add
            folder.mkdir(mode=0o700, exist_ok=True)
        for folder in chain:
            status = os.lstat(folder)
            if not (stat.S_ISDIR(status.st_mode) and status.st_uid == os.getuid()):
                return False
            unwanted = 0o077 if folder == path else 0o022
            if status.st_mode & unwanted and top is not None:
                os.chmod(folder, stat.S_IMODE(status.st_mode) & ~unwanted)
            elif status.st_mode & unwanted:
                return False
    except (OSError, ValueError):
        return False
    return True


def use_private_temp_folder(environ=os.environ) -> None:
    """Make this process's temp folder (TMPDIR) one only this user can write: <tmp>/dflash2-UID,
    0700, inside the temp folder it had.

    MLX compiles kernels into <tmp>/mlx/VERSION and loads what it finds there under the names
    it looks for: shared libraries it dlopens (cpu/) and CUDA kernels (ptx/). That folder is
    owned by whoever creates it first, so on a shared machine another user could leave code
    there for the server to run. A folder that is not this user's alone gives way, with a
    warning, to a fresh private one for this run."""
    if not hasattr(os, "getuid"):
        return
    base = tempfile.gettempdir()
    folder = os.path.join(base, f"dflash2-{os.getuid()}")
    if not _private_folder(Path(folder)):
        fresh = tempfile.mkdtemp(prefix="dflash2-", dir=base)
        print(f"warning: {folder} is not this user's alone; kernels compile into {fresh} for this run "
              "(removed at exit)", file=sys.stderr)
        atexit.register(shutil.rmtree, fresh, ignore_errors=True)
        _run_temp_folders.append(fresh)
        folder = fresh
    environ["TMPDIR"] = tempfile.tempdir = folder


def use_persistent_kernel_folder(environ=os.environ) -> None:
    """With an NVIDIA driver, keep MLX's compiled CUDA kernels (and the pack's:
    dflash2_kernel_cache) in the user's cache folder, <cache>/dflash2/mlx-ptx/<mlx version>/<the
    NVIDIA setup's digest>, instead of the temp folder: a reboot often empties that, and a
    restart after one should not compile them again. One folder per setup (GPU models, driver,
    CUDA wheels: a home shared by several machines); entries a crash cut are removed first.
    MLX_PTX_CACHE_DIR chosen by the user stays; a folder others could write (or a folder above
    it) leaves MLX's default, in the private temp folder."""
    setup = nvidia_setup()
    if setup is None or "MLX_PTX_CACHE_DIR" in environ or not hasattr(os, "getuid"):
        return
    try:
        version = importlib.metadata.version("mlx")  # MLX's own folder names its version too
    except importlib.metadata.PackageNotFoundError:
        return
    try:
        top = user_cache_folder()
        folder = top / "mlx-ptx" / version / setup_folder_name(setup)
        if _private_folder(folder, top):
            remove_cut_entries(folder)
            environ["MLX_PTX_CACHE_DIR"] = str(folder)
            return
        why = f"{folder} or a folder above it is not this user's alone"
    except (OSError, RuntimeError) as error:  # no home folder (an arbitrary container uid), ...
        why = f"no user cache folder ({error})"
    print(f"warning: {why}: compiled CUDA kernels stay in the temp folder, which a reboot may empty",
          file=sys.stderr)


# ---------------------------------------------------------------------------------------
# Command line


def loopback_host(value: str) -> str:
    if value not in LOOPBACK_HOSTS:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not allowed: the server listens on 127.0.0.1 or localhost only"
        )
    return value


def int_in(low, high):
    def parse(value):
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number")
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"{number} is outside {low}..{high}")
        return number

    return parse


def positive_gb(value):
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number")
    if not 0 < number < 1 << 20:
        raise argparse.ArgumentTypeError(f"{number:g} is not a positive number of GB")
    return number


@contextmanager
def interrupted_start_exits():
    """Ctrl-C while a server starts: one line and exit status 130, not a traceback. os._exit,
    not sys.exit: by then the engine's generation thread runs, and Python's shutdown aborts on
    it ("terminate called without an active exception", SIGABRT)."""
    try:
        yield
    except KeyboardInterrupt:
        print("interrupted while starting: nothing served", file=sys.stderr, flush=True)
        for folder in _run_temp_folders:  # os._exit runs no atexit
            shutil.rmtree(folder, ignore_errors=True)
        os._exit(130)


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The options both servers accept; mlx-vlm's own pass through by exact name only."""
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    parser.add_argument("--pack", type=Path, help="pack folder (default: this script's folder)")
    parser.add_argument("--model-id", help="public model ID (default: the pack folder's name)")
    parser.add_argument("--host", type=loopback_host, default="127.0.0.1",
                        help="127.0.0.1 (default) or localhost; nothing else is accepted")
    parser.add_argument("--port", type=int_in(1, 65535), default=DEFAULT_PORT,
                        help=f"port to listen on (default: {DEFAULT_PORT})")
    parser.add_argument("--allow-image-dir", type=Path, metavar="DIR",
                        help="also accept image_url paths (or file:// URLs) of files inside DIR "
                             "(default: base64 data URLs only)")
    parser.add_argument("--max-prompt-chars", type=int_in(1, 1 << 40), metavar="N",
                        help="refuse a request whose messages and tools hold more characters of text "
                             "(any role or field), before tokenizing it (default: the context length x "
                             f"{PROMPT_CHARS_PER_TOKEN}, or what can never fit the context if less)")
    parser.add_argument("--request-timeout", type=int_in(0, 7 * 24 * 3600), metavar="SECONDS",
                        default=DEFAULT_REQUEST_TIMEOUT_S,
                        help="cancel a chat request still running after this long and answer 504 "
                             f"(default: {DEFAULT_REQUEST_TIMEOUT_S}; 0: no limit)")
    parser.add_argument("--full-hash", "--dflash2-full-hash", action="store_true",
                        help="at launch, hash every file pinned in dflash2-pack.json whole, also weights "
                             "an earlier start hashed and that have not changed since (by default those are "
                             "checked by size, header and file identity, and the rest hashed)")
    cache = parser.add_argument_group("prefix cache")
    cache.add_argument("--prefix-cache-gb", type=positive_gb, metavar="GB", default=DEFAULT_PREFIX_CACHE_GB,
                       help="memory for the exact prefix cache's snapshots of recent prompts, least "
                            f"recently used dropped first (default: {DEFAULT_PREFIX_CACHE_GB:g})")
    cache.add_argument("--no-prefix-cache", action="store_true",
                       help="prefill every prompt from its first token (default: prefix cache on)")
    mlx_vlm = parser.add_argument_group("mlx-vlm options passed through")
    mlx_vlm.add_argument("--enable-thinking", action="store_true",
                         help="think by default; a request can send \"enable_thinking\": false "
                              "(default: off)")
    mlx_vlm.add_argument("--log-level", default="INFO",
                         choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                         help="default: INFO (one line per request at arrival and at finish)")
    mlx_vlm.add_argument("--max-tokens", type=int_in(1, 1 << 20),
                         help="default max_tokens of a request (mlx-vlm's default: 2048); at most "
                              "the model's context length")
    # MLX CUDA could not capture a 16384-token prefill step at the 27B shape
    # (cudaGraphAddKernelNode: invalid argument); 4096 worked there.
    mlx_vlm.add_argument("--prefill-step-size", type=int_in(1, MAX_PREFILL_STEP),
                         help=f"prompt tokens per prefill step (default: {PREFIX_CACHE_PREFILL_STEP}, "
                              "mlx-vlm's 2048 with --no-prefix-cache; at most "
                              f"{MAX_PREFILL_STEP}); the prefix cache stores states at its multiples")
    mlx_vlm.add_argument("--thinking-start-token", metavar="TOKEN",
                         help="the token that opens a thinking block (default: mlx-vlm's, <think>)")
    mlx_vlm.add_argument("--thinking-end-token", metavar="TOKEN",
                         help="the token that closes a thinking block (default: mlx-vlm's, </think>)")
    mlx_vlm.add_argument("--top-logprobs-k", type=int_in(0, 20),
                         help="most top_logprobs a request may ask for (default: 0, none)")
    return parser


def prefix_cache_gb(args):
    """The prefix cache's budget, or None when it is off."""
    return None if args.no_prefix_cache else args.prefix_cache_gb


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    args, rest = parser.parse_known_args(argv)
    if rest:
        parser.error(
            f"not accepted: {' '.join(rest)}. Options pass through to mlx-vlm only by their "
            "exact names (no abbreviations); see --help for the full list"
        )
    if args.prefill_step_size is None and not args.no_prefix_cache:
        args.prefill_step_size = PREFIX_CACHE_PREFILL_STEP
    return args


def exit_if_address_taken(host: str, port: int):
    """Before minutes of loading and self-tests: the address the server listens on must be
    free (bound and let go here, with uvicorn's SO_REUSEADDR)."""
    try:
        socket.create_server((host, port)).close()
    except OSError as error:
        sys.exit(f"error: cannot listen on {host}:{port} ({error.strerror or error}): another server may "
                 "be running there; stop it or choose another --port")


def pass_options_to_mlx_vlm(args):
    """Hand the pass-through options to mlx-vlm the way its own CLI does: as variables.

    Runs after exit_if_environment_refused, so only these values are in effect.
    """
    os.environ["MLX_VLM_ENABLE_THINKING"] = "1" if args.enable_thinking else "0"
    if args.max_tokens is not None:
        os.environ["MLX_VLM_MAX_TOKENS"] = str(args.max_tokens)
    if args.thinking_start_token is not None:
        os.environ["MLX_VLM_THINKING_START_TOKEN"] = args.thinking_start_token
    if args.thinking_end_token is not None:
        os.environ["MLX_VLM_THINKING_END_TOKEN"] = args.thinking_end_token
    # mlx-vlm's own wait for the next token ends a request with a 500; --request-timeout
    # bounds every request instead, with a 504.
    os.environ["MLX_VLM_TOKEN_QUEUE_TIMEOUT"] = "0"


def exit_if_pins_differ(pack_dir: Path, full_hash: bool):
    """The launch checks against the pack's dflash2-pack.json (dflash2_pack.check_pins), said
    in the log. A pack folder in the release layout (the target's files at its top, as
    build_pack writes it) or with SHA256SUMS is refused without one; a source layout
    (target/ and drafter/ folders, never built) is served with a warning, and so is a pinned
    pack without its SHA256SUMS. Weights are hashed where no earlier start hashed them as they
    are now (dflash2_file_hashes)."""
    import logging

    from dflash2_file_hashes import RememberedHashes
    from dflash2_pack import PINS_FILE, SUMS_FILE, check_pins

    logger = logging.getLogger("dflash2.server")
    if not (pack_dir / PINS_FILE).is_file():
        if (pack_dir / SUMS_FILE).is_file() or (pack_dir / "config.json").is_file():
            sys.exit(f"error: {PINS_FILE} is missing from the pack folder (a built pack's layout): "
                     "download or build the pack again")
        logger.warning("no %s in the pack folder: file pins not checked", PINS_FILE)
        return
    remembered = RememberedHashes()
    if remembered.problem:
        logger.warning("remembered weight hashes: %s", remembered.problem)
    failures = check_pins(pack_dir, full_hash, remembered)
    if failures:
        sys.exit(f"error: the pack differs from {PINS_FILE}:\n  " + "\n  ".join(failures))
    problem = remembered.save()
    if problem:
        logger.warning("weight hashes could not be remembered (the next start hashes them again): %s", problem)
    if not (pack_dir / SUMS_FILE).is_file():
        # The pins still hold every file, but shasum -c and --verify-pack have nothing to check.
        logger.warning("%s is missing from the pack folder (a built pack ships it): shasum -a 256 -c "
                       "and --verify-pack cannot check the pack; download or build it again", SUMS_FILE)
    weights = ("--full-hash: every file hashed now" if full_hash else
               f"weights hashed now: {len(remembered.hashed)}, unchanged since an earlier start hashed "
               f"them: {len(remembered.reused)}")
    logger.info("launch checks against %s: every pinned file's sha256 matches (%s), and no weights file "
                "is unpinned", PINS_FILE, weights)


def exit_if_pack_invalid(target_dir: Path, drafter_dir: Path = None):
    """dflash2_pack's checks (config, tensor headers, drafter fit), before any weight loads."""
    from dflash2_pack import PackError, check_drafter, check_target

    try:
        check_target(target_dir)
        if drafter_dir is not None:
            check_drafter(drafter_dir, target_dir)
    except PackError as error:
        sys.exit(f"error: {error}")


DEMO_MODEL_ID = "dflash2-demo-tiny"
# The trained tiny pair (DIR/target, DIR/drafter): in the source repository, not in a pack folder.
DEMO_PACK = Path(__file__).absolute().parent / "fixtures" / "tiny-pair"


def demo_pack() -> Path:
    """The trained tiny pair, checked against its SHA256SUMS (its README and training record
    are not listed)."""
    from dflash2_pack import SUMS_FILE, listed_file_problems

    if not (DEMO_PACK / SUMS_FILE).is_file():
        sys.exit("error: --demo needs fixtures/tiny-pair from the source repository; a downloaded "
                 "pack folder does not ship it. Run the pack itself without --demo.")
    _, problems = listed_file_problems(DEMO_PACK)
    if problems:
        sys.exit("error: fixtures/tiny-pair differs from its SHA256SUMS (regenerate it with "
                 "tools/train_tiny_pair.py):\n  " + "\n  ".join(problems))
    return DEMO_PACK


def pack_folder(parser: argparse.ArgumentParser, args, default: Path) -> Path:
    """The folder to serve: --demo's checked fixture, else --pack, else default (the script's)."""
    if args.demo and args.pack:
        parser.error("--demo serves the trained tiny pair; leave out --pack")
    return demo_pack() if args.demo else (args.pack or default).absolute()


def public_model_id(requested, pack_dir: Path) -> str:
    model_id = requested or pack_dir.resolve().name
    if not MODEL_ID_PATTERN.fullmatch(model_id):
        what = "--model-id" if requested else f"the folder name {model_id!r}"
        sys.exit(f"error: {what} is not a usable model ID (letters, digits, . _ - and one /); "
                 "pass --model-id NAME")
    return model_id


def max_prompt_chars(target_dir: Path, context_length: int):
    """Characters of text that can never fit in context_length tokens, for a BPE tokenizer
    whose only normalizer is NFC (or none): a token covers at most its longest entry's
    characters, and NFC joins at most four characters into one. None for other tokenizers."""
    try:
        tokenizer = json.loads((target_dir / "tokenizer.json").read_text())
        model, normalizer = tokenizer["model"], tokenizer.get("normalizer")
        if model["type"] != "BPE" or normalizer not in (None, {"type": "NFC"}):
            return None
        longest = max(map(len, [*model["vocab"], *(token["content"] for token in tokenizer["added_tokens"])]))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # mlx-vlm's loader reports a missing or broken tokenizer
    return 4 * longest * context_length


def pack_limits(target_dir: Path, model_id: str, args) -> PackLimits:
    """What requests may ask of this pack (after exit_if_pack_invalid read its config)."""
    text = json.loads((target_dir / "config.json").read_text())["text_config"]
    context = text["max_position_embeddings"]
    if args.max_tokens is not None and args.max_tokens > context:
        sys.exit(f"error: --max-tokens {args.max_tokens} is above the model's context length {context}")
    image_dir = None
    if args.allow_image_dir is not None:
        if not args.allow_image_dir.is_dir():
            sys.exit(f"error: --allow-image-dir {args.allow_image_dir}: not a folder")
        image_dir = Path(os.path.realpath(args.allow_image_dir))
    never_fits = max_prompt_chars(target_dir, context)
    limit = args.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * context
    return PackLimits(model_id, text["vocab_size"], context, args.top_logprobs_k or 0, image_dir,
                      never_fits, None if never_fits is not None and limit >= never_fits else limit)
