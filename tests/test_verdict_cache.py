"""The start-up verdict cache (dflash2_verdicts.py): a second start takes the verdicts a first one
cached, answers the same, and anything that could change a verdict, or a damaged file, or
--recheck, means a full check that says why.

The servers run the demo (fixtures/tiny-pair, a fixed block: no round cost table) on CPU;
servers of one workdir share its HOME and so its cache folder (tools/server_process.py). The
round policy's table is cached by a start without a fixed block, its blocks capped at 2.
"""

import json
import re
import shutil
from pathlib import Path

import pytest

import dflash2_kernels
import dflash2_verdicts
from conftest import request
from server_process import ServerProcess

REPO = Path(__file__).resolve().parents[1]
CACHED = {"kernel self-tests", "plain decode path", "verify path", "sampled verify draws", "drafter activations"}
PAIR = REPO / "fixtures" / "tiny-pair"
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


def cache_files(workdir: Path) -> list:
    return sorted((workdir / "home" / ".cache" / "dflash2" / "verdicts").glob("*.json"))


def answer(server) -> str:
    response = request(server, "POST", "/v1/chat/completions", {
        "model": "dflash2-demo-tiny", "messages": [{"role": "user", "content": "Write a haiku about rivers."}],
        "temperature": 0, "max_tokens": 16})
    assert response.status == 200 and response.mode == "speculative", response.body
    return response.json()["choices"][0]["message"]["content"]


def start(name, workdir: Path, *options, script=REPO / "serve_dflash2.py"):
    """A server in workdir (the demo unless options name a --pack), ready: (the server,
    /health's start_up_checks). Stop it."""
    server = ServerProcess(name, [str(script), *([] if "--pack" in options else ["--demo"]), *options], workdir)
    try:
        return server, server.wait_ready()["start_up_checks"]
    except Exception:
        server.stop()
        raise


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """The first start in a fresh HOME, stopped: its workdir, answer, checks, log and /health."""
    workdir = tmp_path_factory.mktemp("verdicts")
    server, checks = start("first", workdir)
    try:
        return {"workdir": workdir, "answer": answer(server), "checks": checks, "log": server.log(),
                "health": server.health()[1]}
    finally:
        server.stop()


def home_copy(first, tmp_path) -> Path:
    """A workdir whose HOME holds the first start's cache."""
    shutil.copytree(first["workdir"] / "home", tmp_path / "home")
    return tmp_path


def full_check(workdir, *options, script=REPO / "serve_dflash2.py") -> tuple:
    """(start_up_checks, log) of a start that must check everything."""
    server, checks = start("again", workdir, *options, script=script)
    server.stop()
    assert checks["from_cache"] == {}
    assert {"kernel self-tests", "verify self-check", "plain decode path", "drafter activations"} <= set(
        checks["measured_s"])
    return checks, server.log()


def test_a_first_start_checks_everything_says_so_and_caches_it(first):
    checks = first["checks"]
    assert checks["full_check_because"] == "nothing cached for this key yet"
    assert checks["from_cache"] == {} and set(checks["measured_s"]) == CACHED | {"verify self-check"}
    assert "start-up checks: all of them: nothing cached for this key yet" in first["log"]
    # One progress line per check before it runs, in order.
    steps = [first["log"].index(f"start-up check {n} of 7: ") for n in range(1, 8)]
    assert steps == sorted(steps)
    assert len(cache_files(first["workdir"])) == 1
    # A fixed block's rounds run whatever a cost table says: none is measured.
    assert ("start-up check 7 of 7: round costs: not run: the block is fixed (--dflash2-block-size), "
            "so no decision reads a table") in first["log"]
    assert first["health"]["round_costs"] is None


def test_the_round_policy_s_cost_table_is_measured_then_taken_from_the_cache(first, tmp_path):
    workdir = home_copy(first, tmp_path)
    options = ("--pack", str(PAIR), "--dflash2-block-cap", "2")  # the policy decides, by blocks up to 2
    tables = []
    for name in ("policy", "policy-again"):
        server, checks = start(name, workdir, *options)
        try:
            tables.append((checks, server.health()[1]["round_costs"]))
        finally:
            server.stop()
    (measured, costs), (cached, costs_again) = tables
    assert measured["full_check_because"].startswith("nothing cached for this key yet")
    assert "round costs" in measured["measured_s"]
    assert "round costs" in cached["from_cache"] and "round costs" not in cached["measured_s"]
    file_costs = [json.loads(path.read_text())["verdicts"].get("round costs") for path in cache_files(workdir)]
    assert [entry["at"] for entry in file_costs if entry] == [cached["from_cache"]["round costs"]]
    assert list(costs["verify_steps_by_block"]) == list(costs_again["verify_steps_by_block"]) == ["2"]


def test_a_second_start_takes_the_cached_verdicts_and_answers_the_same(first):
    files = cache_files(first["workdir"])
    cached = json.loads(files[0].read_text())["verdicts"]
    server, checks = start("second", first["workdir"])
    try:
        assert answer(server) == first["answer"]
        log = server.log()
    finally:
        server.stop()
    # Each cached verdict served, with when it was measured; the verify self-check ran.
    assert checks["full_check_because"] is None
    assert checks["from_cache"] == {name: cached[name]["at"] for name in CACHED}
    assert all(TIMESTAMP.fullmatch(at) for at in checks["from_cache"].values())
    assert list(checks["measured_s"]) == ["verify self-check"]
    assert "the verdicts cached in" in log and "serve; the verify self-check runs at every start" in log
    for name in CACHED:
        assert f": {name}: from the cache (measured {cached[name]['at']})" in log
    assert "DFlash2 exact verify self-check: 7 blocks, 0 differing" in log
    # The verify self-check's progress line estimates from the first start's timing.
    assert "verify self-check: exact verify rounds" in log and "as the last cached start took" in log
    assert cache_files(first["workdir"]) == files  # nothing new to write


def test_recheck_means_a_full_check(first, tmp_path):
    workdir = home_copy(first, tmp_path)
    checks, log = full_check(workdir, "--recheck")
    assert checks["full_check_because"] == "--recheck"
    assert "start-up checks: all of them: --recheck" in log


def test_an_edited_pack_module_means_a_full_check_naming_it(first, tmp_path):
    workdir = home_copy(first, tmp_path)
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in REPO.glob("*.py"):
        shutil.copy2(path, copy / path.name)
    (copy / "fixtures").symlink_to(REPO / "fixtures")
    with open(copy / "dflash2_requests.py", "a") as module:
        module.write("# edited\n")
    checks, log = full_check(workdir, script=copy / "serve_dflash2.py")
    assert checks["full_check_because"] == (
        "nothing cached for this key yet (the newest cached start differed in: modules (dflash2_requests.py))")
    assert len(cache_files(workdir)) == 2  # one file per key


# ---------------------------------------------------------------------------------------
# In process


def test_every_kernel_verdict_table_is_cached_and_restored():
    tables = dflash2_kernels.VERDICT_TABLES
    named = {id(value) for name, value in vars(dflash2_kernels).items()
             if name.startswith("_") and name.endswith(("_serving", "verified")) and isinstance(value, dict)}
    assert named == {id(table) for table in tables.values()}  # a new kernel's table is cached too
    kept = {name: dict(table) for name, table in tables.items()}
    filled = {"attention": {("cuda", (1, 24, 4, 256)): {32, 64}, ("metal", (1, 2, 1, 64)): {None, 3}},
              "rotate": {("cuda", 5120, 512): True}, "rotate_group": {(5120, 512, 3): False},
              "qmv": {"cuda": True}, "gdn": {"cuda": "fma"}, "rope": {"cuda": None}}
    result = dflash2_kernels.SelfTestResult(True, "cuda", None, 0, 12, cases=[{"rows": 1}], variant="fma",
                                            variants={"fma": 0}, seconds=3.5)
    try:
        for name, table in tables.items():
            table.clear()
            table.update(filled.get(name, {}))
        saved = json.loads(json.dumps(dflash2_kernels.kernel_verdicts({"gdn": result})))
        for table in tables.values():
            table.clear()
        restored = dflash2_kernels.restore_kernel_verdicts(saved)
        assert {name: table for name, table in tables.items() if table} == filled
        assert restored == {"gdn": dflash2_kernels.SelfTestResult(True, "cuda", None, 0, 12, variant="fma",
                                                                  variants={"fma": 0})}
    finally:
        for name, table in tables.items():
            table.clear()
            table.update(kept[name])


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A cache folder of this test's own and a fixed machine part of the key."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(dflash2_verdicts, "machine_key", lambda: {"backend": "cuda", "device": {"device_name": "X"}})


def opened(pack, recheck=False):
    verdicts = dflash2_verdicts.VerdictCache(pack, recheck=recheck)
    verdicts.open()
    return verdicts


def test_a_cached_verdict_is_restored_instead_of_measured(machine, caplog):
    caplog.set_level("INFO", "dflash2.server")
    pack = {"modules": {"dflash2_requests.py": "aa"}, "pack": {}, "options": {}}
    first = opened(pack)
    assert first.check("round costs", lambda: {"table": 1}, dict, dict) == {"table": 1}
    assert first.check("verify self-check", lambda: "checked") == "checked"
    assert "about 58 s on an H100 at the 27B shape" in caplog.text  # no cached start yet
    first.save()
    second = opened(pack)
    assert second.check("round costs", lambda: pytest.fail("measured"), lambda value: ("restored", value)) == (
        "restored", {"table": 1})
    assert second.check("verify self-check", lambda: "checked again") == "checked again"
    assert set(second.used) == {"round costs"} and list(second.measured) == ["verify self-check"]
    assert opened(pack, recheck=True).full_check_because == "--recheck"
    changed = opened({**pack, "options": {"block_size": 4}})
    assert changed.full_check_because == (
        "nothing cached for this key yet (the newest cached start differed in: options (block_size))")
    assert changed.estimates["round costs"] >= 0  # the newest cached start's timings
    # A check that fails on cached verdicts (the verify self-check) drops them: the next start checks all.
    second.discard()
    assert opened(pack).full_check_because.startswith("nothing cached for this key yet")


@pytest.mark.parametrize("damage, because", [
    (lambda data: data.update(schema=2), "was edited or is corrupt (its content sha256 differs)"),
    (lambda data: data.pop("sha256"), "is not a verdict file"),
    (lambda data: data["verdicts"]["round costs"].update(at="2000-01-01T00:00:00Z"),
     "was edited or is corrupt (its content sha256 differs)"),
    (lambda data: data["verdicts"]["round costs"].update(value={"table": 2}), "was edited or is corrupt"),
    (None, "is not valid JSON"),  # cut short, as by a full disk
])
def test_a_damaged_file_means_a_full_check_that_names_it(machine, caplog, damage, because):
    """The servers' own full checks (a changed module, --recheck) run above; these damages
    differ only in what open() reads."""
    caplog.set_level("INFO", "dflash2.server")
    pack = {"modules": {}, "pack": {}, "options": {}}
    verdicts = opened(pack)
    verdicts.check("round costs", lambda: {"table": 1}, dict, dict)
    verdicts.save()
    if damage is None:
        verdicts.path.write_bytes(verdicts.path.read_bytes()[:100])
    else:
        data = json.loads(verdicts.path.read_text())
        damage(data)
        verdicts.path.write_text(json.dumps(data))
    caplog.clear()
    again = opened(pack)
    assert again.full_check_because.startswith(f"{verdicts.path.name} ") and because in again.full_check_because
    assert f"start-up checks: all of them: {again.full_check_because}" in caplog.text
    assert again.check("round costs", lambda: {"table": 3}, dict, dict) == {"table": 3}  # measured, not restored
