"""Assemble a DFlash2 pack folder from a base (target) pack and a drafter.

    python tools/build_pack.py --base SRC --drafter SRC --out DIR [--drafter-form 4bit] [--dry-run]

SRC is a local folder or a Hugging Face repo id, optionally with @revision (downloaded
through huggingface_hub, or taken from the local HF cache when offline). The pack holds
the target files unchanged at the top level, the drafter in drafter/, the runtime files,
NOTICE.txt, a README card filled from evidence/, dflash2-pack.json (sources, pins,
runtime versions) and SHA256SUMS. Sources are only read. A rebuild from the same sources
gives the same bytes (no timestamps). DIR must be empty, absent, or a previous build.
"""

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash2_pack import (  # noqa: E402
    PINS_FILE,
    SUMS_FILE,
    PackError,
    check_drafter,
    check_target,
    folder_files,
    read_sha256sums,
    safetensors_header_sha256,
    sha256_file,
)
from make_synthetic_pack import prequantize_drafter  # noqa: E402

RUNTIME_FILES = (
    "serve_dflash2.py",
    "serve.py",
    "dflash2_launch.py",
    "dflash2_engine.py",
    "dflash2_generator.py",
    "dflash2_speculation.py",
    "dflash2_prefix_cache.py",
    "dflash2_gateway.py",
    "dflash2_record.py",
    "dflash2_options.py",
    "dflash2_routing.py",
    "dflash2_openapi.py",
    "dflash2_messages_request.py",
    "dflash2_responses_request.py",
    "dflash2_requests.py",
    "dflash2_runtime.py",
    "dflash2_decode_arms.py",
    "dflash2_drafter.py",
    "dflash2_verify.py",
    "dflash2_timing.py",
    "dflash2_rounds.py",
    "dflash2_policy.py",
    "dflash2_sampling.py",
    "dflash2_verdicts.py",
    "dflash2_file_hashes.py",
    "dflash2_pack.py",
    "dflash2_audit.py",
    "dflash2_kernels.py",
    "dflash2_kernel_prefill.py",
    "dflash2_kernel_attention.py",
    "dflash2_kernel_attention_metal.py",
    "dflash2_kernel_fused.py",
    "dflash2_kernel_rope.py",
    "dflash2_kernel_conv32.py",
    "dflash2_kernel_gdn.py",
    "dflash2_kernel_linear.py",
    "dflash2_kernel_rotate.py",
    "dflash2_kernel_qmv32.py",
    "dflash2_kernel_qmv.py",
    "dflash2_kernel_qmv_metal.py",
    "dflash2_kernel_base.py",
    "dflash2_kernel_cache.py",
    "dflash2_kernel_folder.py",
    "dflash2_source.py",
    "requirements.txt",
)
# Files the pack writes itself; a base file of the same name is replaced, not copied.
GENERATED_FILES = ("NOTICE.txt", "README.md", PINS_FILE, SUMS_FILE)
# Base files that make no sense beside the DFlash2 runtime (the card lists them).
OMITTED_FILES = ("lmstudio-model.yaml",)
NOTICE_NAMES = ("NOTICE", "NOTICE.txt", "NOTICE.md")
PINNED_PACKAGES = ("mlx", "mlx-vlm")
COPY_CHUNK = 8 * 1024 * 1024


# ---------------------------------------------------------------------------------------
# Sources


def resolve_source(spec):
    """(local folder, source id, revision or None) for a folder or `repo/id[@revision]`."""
    if Path(spec).is_dir():
        return Path(spec).resolve(), Path(spec).resolve().name, None
    if Path(spec).exists() or spec.startswith(("/", ".", "~")):
        sys.exit(f"error: {spec}: not a folder (a Hugging Face source is namespace/name[@revision])")
    repo_id, _, revision = spec.partition("@")
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(repo_id, revision=revision or None)
    except Exception as error:  # offline or unreachable: the local HF cache may have it
        print(f"download failed ({error.__class__.__name__}); using the local HF cache", file=sys.stderr)
        try:
            folder = snapshot_download(repo_id, revision=revision or None, local_files_only=True)
        except Exception as cache_error:
            sys.exit(f"error: {spec}: neither a folder here, nor downloadable, nor in the local Hugging Face "
                     f"cache ({cache_error.__class__.__name__})")
    # The cache keeps each snapshot in a folder named after its commit.
    return Path(folder), repo_id, Path(folder).name


def plan_copies(base_dir, drafter_dir):
    """[(source path, pack path)] for target, drafter, runtime and evidence files, and the
    base files left out (replaced or omitted)."""
    copies, left_out = [], []
    for name in folder_files(base_dir):
        if name in GENERATED_FILES + RUNTIME_FILES + OMITTED_FILES or name.startswith("drafter/"):
            left_out.append(name)
        else:
            copies.append((base_dir / name, name))
    copies += [(drafter_dir / name, f"drafter/{name}") for name in folder_files(drafter_dir)]
    copies += [(REPO / name, name) for name in RUNTIME_FILES]
    copies += [(REPO / "evidence" / name, f"evidence/{name}") for name in folder_files(REPO / "evidence")]
    return copies, left_out


# ---------------------------------------------------------------------------------------
# Output folder


def previous_build_files(out_dir):
    """Files of a previous build (listed in its SHA256SUMS); raises SystemExit when out_dir
    holds anything else, so that user files are never overwritten or deleted."""
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return set()
    sums = out_dir / SUMS_FILE
    if not sums.is_file() or not (out_dir / PINS_FILE).is_file():
        sys.exit(f"error: {out_dir} is not empty and is not a previous pack build "
                 f"(no {SUMS_FILE} / {PINS_FILE}); choose an empty or new folder")
    listed = set(read_sha256sums(out_dir)[0]) | {SUMS_FILE}
    unknown = [name for name in folder_files(out_dir) if name not in listed]
    if unknown:
        sys.exit(f"error: {out_dir} holds files that no build wrote: {', '.join(unknown[:8])}; "
                 "move them away first")
    return listed


def check_apart(out_dir, sources):
    """SystemExit unless the output folder and each source folder are apart (neither the
    same nor one inside the other): a build reads its sources while it writes the pack."""
    out = out_dir.resolve()
    for source in sources:
        source = source.resolve()
        if out == source or source in out.parents or out in source.parents:
            sys.exit(f"error: the output folder {out_dir} and the source folder {source} overlap; "
                     "build into a folder outside the sources")


def copy_verified(source, destination, progress):
    """Copy one file and prove the copy byte-identical by sha256; returns the digest. The
    copy is written beside the destination, then renamed over it: a link there is replaced,
    never written through, and an interrupted copy never has the final name."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_name(destination.name + ".partial")
    digest = hashlib.sha256()
    with open(source, "rb") as reader, open(partial, "wb") as writer:
        while chunk := reader.read(COPY_CHUNK):
            digest.update(chunk)
            writer.write(chunk)
            progress.update(len(chunk))
    expected = digest.hexdigest()
    if sha256_file(partial) != expected:
        partial.unlink()
        sys.exit(f"error: {destination} differs from {source} after copying")
    os.replace(partial, destination)
    return expected


# ---------------------------------------------------------------------------------------
# Generated files


def runtime_pins():
    """{package: version} of the exact pins in requirements.txt."""
    pins = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        match = re.match(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^;\s]+)", line.strip())
        if match and match.group(1) in PINNED_PACKAGES:
            pins[match.group(1)] = match.group(3)
    return pins


def notice_text(base_dir, drafter_dir):
    """The repo's NOTICE.txt, then every upstream notice found in the sources, verbatim."""
    parts = [(REPO / "NOTICE.txt").read_text().rstrip() + "\n"]
    for label, folder in (("base pack", base_dir), ("drafter", drafter_dir)):
        for name in NOTICE_NAMES:
            if (folder / name).is_file():
                text = (folder / name).read_text(errors="replace").rstrip()
                parts.append(f"\n----- Upstream notice from the {label} ({name}), kept unchanged -----\n\n"
                             f"{text}\n")
    return "".join(parts)


def evidence_rows(evidence):
    """Markdown table rows of the figures of one evidence JSON, copied as written: its
    top-level values, and one level into tables of values (e.g. e2e_speedup.chat)."""
    rows = []
    for key, value in evidence.items():
        if isinstance(value, (bool, int, float, str)) and key != "command":
            rows.append(f"| {key} | {value} |")
        elif isinstance(value, dict) and value and all(
            isinstance(item, (bool, int, float, str)) for item in value.values()
        ):
            rows += [f"| {key}.{name} | {item} |" for name, item in value.items()]
    return rows


def card_license(base_dir) -> str:
    """The base pack's license from its README's card metadata ("other" if none)."""
    readme = base_dir / "README.md"
    text = readme.read_text(errors="replace") if readme.is_file() else ""
    front = re.match(r"---\n(.*?)\n---", text, re.S)
    license_line = front and re.search(r"^license:\s*(\S+)", front.group(1), re.M)
    return license_line.group(1) if license_line else "other"


def card_results(pack_dir) -> list:
    """Correctness and speed lines filled from the pack's own evidence records."""
    lines = []
    for name, label in (("parity-", "Correctness"), ("bench-", "Measured speed")):
        records = sorted((pack_dir / "evidence").glob(f"{name}*.json"))
        lines += ["", f"## {label}", ""]
        if not records:
            lines.append("No record in evidence/ yet: run `python tools/make_evidence.py --pack DIR`.")
        for path in records:
            record = json.loads(path.read_text())
            where = f"{record.get('backend', '?')} ({record.get('device', '?')})"
            lines += [f"From `evidence/{path.name}` on {where}; command `{record.get('command', 'not recorded')}`:",
                      "", "| figure | value |", "| --- | --- |", *evidence_rows(record), ""]
    return lines


def readme_text(pack_dir, base_dir, pins):
    """The pack's Hugging Face model card: metadata, what it is, how to check and serve it,
    routing, how it works, correctness and speed filled from evidence/, limits, licenses."""
    base, drafter = pins["base"], pins["drafter"]
    lines = [
        "---",
        f"license: {card_license(base_dir)}",
        f"base_model: {base['source']}",
        "library_name: mlx",
        "pipeline_tag: image-text-to-text",
        "tags: [mlx, mlx-vlm, dflash2, speculative-decoding, qwen3.5, 2-bit]",
        "---",
        "",
        f"# {base['source']} with DFlash2",
        "",
        "The base pack's files, unchanged, with a DFlash 2 drafter and the runtime that serves",
        "it on pinned mlx-vlm. Greedy output is token-identical to plain decoding of the same",
        "pack: the target verifies each drafted block with the arithmetic of its own",
        "single-token decode step, bit for bit, and rolls back what it rejects.",
        "",
        "| part | source | revision |",
        "| --- | --- | --- |",
        f"| target | {base['source']} | {base['revision'] or 'local folder'} |",
        f"| drafter (drafter/) | {drafter['source']} | {drafter['revision'] or 'local folder'} |",
        "",
        "Runtime pins: " + ", ".join(f"{name}=={version}" for name, version in pins["runtime"].items()),
        "",
        "## Check and serve",
        "",
        "```",
        "shasum -a 256 -c SHA256SUMS && python serve_dflash2.py --verify-pack",
        "python -m pip install -r requirements.txt",
        "python serve_dflash2.py          # DFlash2, OpenAI-compatible, 127.0.0.1:8080",
        "python serve.py                  # plain decoding, same pack",
        "```",
        "",
        "## Routing",
        "",
        "Every response says how it was served in its `x-dflash2` header: `speculative`",
        "(explicit temperature 0, no logprobs, penalties or logit_bias, n = 1), `fallback;",
        "reason=...` (served plain, same answer as `serve.py`), or `refused; reason=...` (HTTP",
        "4xx naming the field). `/health` reports the start-up self-tests, the exact verify",
        "self-check, plain decode's path and the measured round costs.",
        "",
        "## How it works",
        "",
        "At start-up the runtime checks the audited mlx-vlm sources (any drift refuses to",
        "start), self-tests every exact kernel bit for bit at this pack's shapes, and runs one",
        "verify round per block size against plain decode steps on the pack's own weights,",
        "with stock verify as the negative control; anything that differs turns speculation",
        "off. Per request, a round policy picks each block, or plain decode steps, from the",
        "round costs measured on this machine and the request's acceptance.",
        *card_results(pack_dir),
        "## Limitations",
        "",
        "- Only greedy requests are speculative; sampling, logprobs, penalties and logit_bias",
        "  are served plain.",
        "- One sequence at a time; every turn prefills its whole prompt.",
        "- Metal kernels are written from MLX's source; they serve only after passing their",
        "  self-test on the user's machine.",
        "",
        "## Licenses and attribution",
        "",
        "See NOTICE.txt: the base pack's and the drafter's notices are kept there unchanged.",
    ]
    return "\n".join(lines) + "\n"


def file_pin(path, sha256):
    pin = {"size": path.stat().st_size, "sha256": sha256}
    if path.name.endswith(".safetensors"):
        pin["header_sha256"] = safetensors_header_sha256(path)
    return pin


def write_text(path, text):
    """Writes a generated file as copy_verified does (beside it, then renamed over it);
    returns its sha256."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------


def build_pack(base, drafter, out_dir, dry_run=False, drafter_form="as-is", drafter_source=None):
    """drafter_source: the (source id, revision) to pin for the drafter, where `drafter` is a
    form of it written here (--drafter-form 4bit's temporary folder)."""
    base_dir, base_id, base_revision = resolve_source(base)
    drafter_dir, drafter_id, drafter_revision = resolve_source(drafter)
    drafter_id, drafter_revision = drafter_source or (drafter_id, drafter_revision)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        sys.exit(f"error: --out {out_dir}: a file, not a folder")
    check_apart(out_dir, [base_dir, drafter_dir])
    if drafter_form == "4bit":
        with tempfile.TemporaryDirectory() as folder:
            try:
                kept = prequantize_drafter(drafter_dir, Path(folder) / "drafter")
            except ValueError as error:
                sys.exit(f"error: --drafter-form 4bit: {error}")
            print(f"drafter prequantized to 4 bits (group 64, affine); {len(kept)} matrices kept "
                  f"in bf16: {', '.join(kept)}")
            return build_pack(base, Path(folder) / "drafter", out_dir, dry_run,
                              drafter_source=(f"{drafter_id}, prequantized to 4 bits by build_pack", drafter_revision))
    try:
        check_target(base_dir)
        check_drafter(drafter_dir, base_dir)
    except PackError as error:
        sys.exit(f"error: the sources fail the pack checks: {error}")
    copies, left_out = plan_copies(base_dir, drafter_dir)
    previous = previous_build_files(out_dir)

    print(f"pack {out_dir}: target {base_id} ({base_revision or 'local'}), "
          f"drafter {drafter_id} ({drafter_revision or 'local'})")
    for source, name in copies:
        print(f"  copy  {name}  ({source.stat().st_size} bytes)")
    for name in left_out:
        print(f"  leave out base file {name} (the pack writes or omits it)")
    for name in GENERATED_FILES:
        print(f"  write {name}")
    if dry_run:
        print("dry run: nothing written")
        return None

    digests = {}
    with tqdm(total=sum(source.stat().st_size for source, _ in copies), unit="B", unit_scale=True,
              desc="copy + sha256") as progress:
        for source, name in copies:
            digests[name] = copy_verified(source, out_dir / name, progress)
    digests["NOTICE.txt"] = write_text(out_dir / "NOTICE.txt", notice_text(base_dir, drafter_dir))

    pins = {
        "base": {"source": base_id, "revision": base_revision},
        "drafter": {"source": drafter_id, "revision": drafter_revision},
        "runtime": runtime_pins(),
        "config_sha256": {name: digests[name] for name in ("config.json", "drafter/config.json")},
    }
    digests["README.md"] = write_text(out_dir / "README.md", readme_text(out_dir, base_dir, pins))
    pins["files"] = {name: file_pin(out_dir / name, digests[name]) for name in sorted(digests)}
    digests[PINS_FILE] = write_text(out_dir / PINS_FILE, json.dumps(pins, indent=2, sort_keys=True) + "\n")

    # Files a previous build wrote that this one does not (e.g. a renamed shard).
    for name in sorted(previous - digests.keys() - {SUMS_FILE}):
        (out_dir / name).unlink(missing_ok=True)
    sums = "".join(f"{digests[name]}  {name}\n" for name in sorted(digests))
    write_text(out_dir / SUMS_FILE, sums)
    print(f"wrote {len(digests)} files and {SUMS_FILE} to {out_dir}")
    return out_dir


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="base (target) pack: folder or repo/id[@revision]")
    parser.add_argument("--drafter", required=True, help="drafter: folder or repo/id[@revision]")
    parser.add_argument("--out", required=True, help="pack folder to write")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    parser.add_argument("--drafter-form", choices=["as-is", "4bit"], default="as-is",
                        help="4bit: write the bf16 drafter prequantized (4-bit, group 64, affine; the "
                             "conv kernel projections and the candidate selector stay bf16)")
    args = parser.parse_args(argv)
    build_pack(args.base, args.drafter, args.out, dry_run=args.dry_run, drafter_form=args.drafter_form)


if __name__ == "__main__":
    main()
