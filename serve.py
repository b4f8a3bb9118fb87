"""Serve the pack plain: mlx-vlm's OpenAI-compatible server, locked to this folder's model.

    python serve.py [--port 8080] [--model-id NAME] [--enable-thinking] [--pack DIR]
    python serve.py --demo        # serves the trained tiny pair's target in fixtures/tiny-pair

Start-up only: the start-up sequence (dflash2_launch.py: options, environment, pack checks,
the engine) and the hardened gateway in front of it (dflash2_gateway.py), shared with
serve_dflash2.py.
"""

import os
import sys

# First, before any other import (os and sys are Python's own, frozen or built in): the pack's
# folder off the module path, here and in any child Python (a file beside the pack's modules,
# logging.py say, would run in place of the real one), then the pack's own modules from their
# checked sources alone (dflash2_source.py says why). serve.py and serve_dflash2.py open alike.
if __name__ == "__main__":  # Python's own entry, and any PYTHONPATH one ('.', or empty: the current folder)
    script = os.path.abspath(__file__)
    folders = {os.path.realpath(os.path.dirname(path)) for path in (script, os.path.realpath(script))}
    sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or ".") not in folders]
    os.environ["PYTHONSAFEPATH"] = "1"
import runpy  # noqa: E402  (frozen into Python: nothing of this folder's)
from pathlib import Path  # noqa: E402

# The pack's folder: this script's, as it was started (not resolved): a Hugging Face cache
# snapshot links each file into blobs/, and the pack is the links' folder.
HERE = Path(__file__).absolute().parent
runpy.run_path(str(HERE / "dflash2_source.py"))["load_from_source"](str(HERE))

from dflash2_engine import warm_up
from dflash2_gateway import Gateway, serve
from dflash2_launch import compiling_alone, open_pack, read_options, start_pack_engine
from dflash2_options import interrupted_start_exits, make_parser
from dflash2_routing import decider, plain_decision


def main(argv=None):
    with interrupted_start_exits():
        gateway, args = start(argv)
    serve(gateway, args)


def start(argv=None):
    """Everything before serving: options, pack checks, the engine, its warm-up; the gateway."""
    parser = make_parser("serve.py", "Serve the pack's model plain (no drafter) with mlx-vlm.")
    parser.add_argument("--demo", action="store_true",
                        help="serve the trained tiny pair's target plain (fixtures/tiny-pair of the source "
                             "repository; a fixture, not the 27B)")
    args = read_options(parser, argv)
    pack = open_pack(parser, args, HERE, with_drafter=False)
    with compiling_alone():
        generator, inner_app = start_pack_engine(pack, args)
        warm_up(generator, "plain")
    return Gateway(inner_app, limits=pack.limits, scrubber=pack.scrubber, request_timeout=args.request_timeout,
                   decide=decider(pack.limits, plain_decision)), args


if __name__ == "__main__":
    main()
