"""The start-up sequence both servers share, from the command line to a started engine.

serve.py and serve_dflash2.py take the same steps in the same order, so a check added here
holds for both, and the same bad command line stops both at the same check, before any
weight loads.
"""

import fcntl
import logging
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dflash2_engine import start_engine
from dflash2_gateway import PathScrubber, local_paths, setup_logging
from dflash2_options import (
    DEMO_MODEL_ID,
    exit_if_address_taken,
    exit_if_environment_refused,
    exit_if_pack_invalid,
    exit_if_pins_differ,
    pack_folder,
    pack_limits,
    parse_args,
    pass_options_to_mlx_vlm,
    prefix_cache_gb,
    public_model_id,
    use_persistent_kernel_folder,
    use_private_temp_folder,
)

logger = logging.getLogger("dflash2.server")


def read_options(parser, argv=None):
    """The options, then the environment, a private temp folder and the kernels' folder: before
    anything imports MLX."""
    args = parse_args(parser, argv)
    exit_if_environment_refused()
    use_private_temp_folder()
    use_persistent_kernel_folder()
    return args


@dataclass
class OpenedPack:
    """A checked pack, ready to load: its folders, public name, path scrubber and limits."""

    pack_dir: Path
    target_dir: Path
    drafter_dir: Optional[Path]
    model_id: str
    scrubber: PathScrubber
    limits: object  # dflash2_requests.PackLimits


def open_pack(parser, args, default: Path, *, with_drafter: bool) -> OpenedPack:
    """The pack folder, the listening address, logging and every launch check (pins, configs,
    tensor headers, the drafter's fit when with_drafter), then mlx-vlm's options."""
    from dflash2_pack import find_pack

    pack_dir = pack_folder(parser, args, default)
    exit_if_address_taken(args.host, args.port)
    target_dir, drafter_dir = find_pack(pack_dir)  # flat release layout, or target/ + drafter/
    model_id = public_model_id(args.model_id or (DEMO_MODEL_ID if args.demo else None), pack_dir)
    folders = [folder for folder in (pack_dir, target_dir, drafter_dir) if folder is not None]
    scrubber = PathScrubber(local_paths(folders, model_id))
    setup_logging(args.log_level, scrubber)
    exit_if_pins_differ(pack_dir, args.full_hash)
    # A missing drafter/ folder is reported by its config.json.
    exit_if_pack_invalid(target_dir, (drafter_dir or pack_dir / "drafter") if with_drafter else None)
    limits = pack_limits(target_dir, model_id, args)
    pass_options_to_mlx_vlm(args)
    return OpenedPack(pack_dir, target_dir, drafter_dir, model_id, scrubber, limits)


def start_pack_engine(pack: OpenedPack, args, drafter=None):
    """mlx-vlm's engine on the pack (dflash2_engine.start_engine): (generator, its app)."""
    return start_engine(pack.target_dir, pack.model_id, pack.limits.context_length,
                        prefill_step_size=args.prefill_step_size, top_logprobs_k=args.top_logprobs_k,
                        prefix_cache_gb=prefix_cache_gb(args), drafter=drafter)


@contextmanager
def compiling_alone():
    """On MLX's CPU backend, hold <TMPDIR>/start-up.lock while the body runs (a start, from the
    engine's start to the end of the warm-ups; --verify-pack's self-tests), so that servers
    started together take turns compiling.

    MLX's CPU backend writes each kernel it compiles into TMPDIR/mlx in place, under the name
    other processes look for: a server that loads one half written exits ("file too short",
    "undefined symbol"), as seen with three servers started at once on a cold folder. A CPU
    start takes seconds. What a later request compiles first (a sampled one's sampling ops)
    is not covered: the warm-ups run greedy requests. CUDA's PTX files go there too, but a CUDA
    start measures for minutes (several servers on one GPU start together in the benchmarks),
    and no clash was seen there: no lock on the GPU."""
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        yield
        return
    path = os.path.join(tempfile.gettempdir(), "start-up.lock")
    with open(path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            logger.info("waiting for the start-up of server process %s: MLX compiles kernels into %s in place",
                        lock.read().strip() or "?", tempfile.gettempdir())
            fcntl.flock(lock, fcntl.LOCK_EX)
        lock.truncate(0)  # the holder's pid, for the next one's waiting line
        lock.write(str(os.getpid()))
        lock.flush()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
