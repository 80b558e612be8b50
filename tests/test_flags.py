"""Every ``kvseal serve`` flag reaches the process it concerns: set each to a value other than its default,
build the argument lists ``serve`` starts its workers and its router with, parse those as the workers and the
router do, and compare. A flag ``serve`` accepts and then drops (as ``--prefix-cache`` once was) fails here."""

import argparse
import os
import signal
import subprocess
import sys

import pytest
from conftest import free_port

from kvseal.cli import parser
from kvseal.model.files import default_model_path
from kvseal.server.launch import _router_argv, _worker_argv

# serve's own (not forwarded as flags): where it listens, the colocated switch, what serve sets up itself
SERVE_ONLY = {"help", "colocated", "host", "port", "transport", "insecure_no_auth", "share_cores"}


def subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def other_value(action: argparse.Action) -> list[str]:
    """Command-line words that give ``action`` a value other than its default."""
    flag = action.option_strings[0]
    if isinstance(action, argparse._StoreTrueAction):
        return [flag]
    if action.choices:
        return [flag, next(str(c) for c in action.choices if c != action.default)]
    if action.nargs == "+":
        return [flag, "name-a", "name-b"]
    kind = getattr(action.type, "__name__", None)  # int, float, or kvseal.cli's bounded numbers of either
    if kind == "int":
        return [flag, str((action.default or 0) + 7)]
    if kind == "float":
        return [flag, str((action.default or 0) + 2.5)]
    return [flag, "key=tenant" if action.dest == "api_key" else f"/tmp/{action.dest}"]


def test_every_serve_flag_reaches_the_process_it_concerns():
    serve = subparser("serve")
    actions = [a for a in serve._actions if a.option_strings and a.dest not in SERVE_ONLY]
    words = [w for a in actions for w in other_value(a)]
    a = parser().parse_args(["serve", *words])
    worker_dests = {x.dest for x in subparser("prefill")._actions}
    router_dests = {x.dest for x in subparser("router")._actions}
    w = parser().parse_args(["prefill", "--port", "1", *_worker_argv(a)])
    r = parser().parse_args(["router", "--prefill", "u", "--decode", "u", *_router_argv(a)])
    reached = set()
    for act in actions:
        d = act.dest
        if d in worker_dests:
            assert getattr(w, d) == getattr(a, d), f"--{d} does not reach the workers"
            reached.add(d)
        if d in router_dests:
            assert getattr(r, d) == getattr(a, d), f"--{d} does not reach the router"
            reached.add(d)
    assert reached == {act.dest for act in actions}, f"flags no process takes: {sorted({x.dest for x in actions} - reached)}"


def test_kvseal_bench_sends_its_api_key(tmp_path):
    """Against a keyed server: with ``--api-key`` the benchmark runs (here sampled, as it says in its result),
    without it every request is a 401."""
    import json
    import subprocess
    import sys

    from conftest import Server

    s = Server(["serve", "--colocated", "--kv-pool-tokens", "8192", "--api-key", "key-a=tenant-a"])
    try:
        bench = [sys.executable, "-m", "kvseal.cli", "bench", "--url", s.url, "--streams", "1", "--prompt", "8",
                 "--output", "4", "--out", str(tmp_path / "b")]
        r = subprocess.run([*bench, "--api-key", "key-a", "--temperature", "0.7", "--top-p", "0.9"],
                           capture_output=True, text=True, timeout=300, check=False)
        assert r.returncode == 0, r.stderr[-2000:]
        got = json.loads((tmp_path / "b.json").read_text())
        assert got["levels"][0]["output_tok_s"] > 0 and got["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 0}
        r = subprocess.run(bench, capture_output=True, text=True, timeout=300, check=False)
        assert r.returncode != 0 and "401" in r.stderr
    finally:
        s.stop()


def test_the_flag_reference_is_current():
    from pathlib import Path

    from kvseal.flagdoc import render

    doc = Path(__file__).resolve().parent.parent / "docs" / "flags.md"
    assert doc.read_text() == render(), "docs/flags.md is stale: python -m kvseal.flagdoc > docs/flags.md"


def test_a_gpu_serve_leaves_its_workers_cores_alone_and_their_weights_unshared():
    """A model on a GPU: the cores lock (for CPU forwards) is off by default and the workers load their own
    weights (the shared file holds CPU-packed weights, which a GPU's model cannot use); a lock named is kept."""
    from pathlib import Path

    from kvseal.server.launch import _shared_weights

    def argv(*words: str) -> list[str]:
        return _worker_argv(parser().parse_args(["serve", *words]))

    gpu, cpu = argv("--device", "cuda"), argv()
    assert gpu[gpu.index("--share-cores") + 1] == "none" and gpu[gpu.index("--device") + 1] == "cuda"
    assert cpu[cpu.index("--share-cores") + 1].startswith("/dev/shm/kvseal-cores-")
    named = argv("--device", "cuda", "--share-cores", "/tmp/lock")
    assert named[named.index("--share-cores") + 1] == "/tmp/lock"
    private = Path("/tmp/private")
    assert _shared_weights(parser().parse_args(["serve", "--device", "cuda"]), private) == []
    assert _shared_weights(parser().parse_args(["serve"]), private) == ["--shared-weights", "/tmp/private/weights"]


BAD_NUMBERS = [
    (["--page-size", "0"], "argument --page-size: must be a positive integer, not 0"),
    (["--threads", "-1"], "argument --threads: must be 0 (every core) or more, not -1"),
    (["--kv-pool-tokens", "-5"], "argument --kv-pool-tokens: must be a positive integer, not -5"),
    (["--max-running", "0"], "argument --max-running: must be a positive integer, not 0"),
    (["--context", "0"], "argument --context/--max-model-len: must be a positive integer, not 0"),
    (["--kv-memory", "nan"], "argument --kv-memory: must be a positive number of GiB, not nan"),
    (["--port", "70000"], "argument --port: must be a port number (0-65535), not 70000"),
]


@pytest.mark.parametrize("flags,says", BAD_NUMBERS, ids=[f[0][0] for f in BAD_NUMBERS])
def test_a_number_that_cannot_work_is_a_usage_error(flags, says, capsys):
    """Each once got past the command line: a zero page size divided by it, a negative thread count failed in
    the engine thread, a pool of -5 tokens was told to "lower --context to -5", port 70000 failed at bind."""
    with pytest.raises(SystemExit) as e:
        parser().parse_args(["serve", *flags])
    assert e.value.code == 2 and says in capsys.readouterr().err


BAD_START = [
    (["--api-key", "no-tenant"], "--api-key takes KEY=TENANT, not 'no-tenant'"),
    (["--api-keys", "/nonexistent/keys"], "--api-keys /nonexistent/keys: No such file or directory"),
    (["--model", "/etc/hostname"], "/etc/hostname: expected a .gguf file or a directory with config.json"),
    (["--model", "{bad_gguf}"], "not a GGUF file (it does not begin with the GGUF magic bytes)"),
    (["--model", "{cut_gguf}"], "cannot read it as GGUF (damaged or cut short)"),
]


@pytest.mark.parametrize("mode", [[], ["--colocated"]], ids=["disaggregated", "colocated"])
@pytest.mark.parametrize("flags,says", BAD_START, ids=[f[0][0] + "=" + f[0][1].strip("{}") for f in BAD_START])
def test_a_key_or_model_that_cannot_work_is_refused_in_one_line_before_anything_starts(flags, says, mode,
                                                                                      tmp_path):
    """Each once was a traceback (a keys line without a tenant, a file that is not a model), some only after the
    model had loaded. Now each is one line naming the flag or file, before any model loads; a GGUF file cut
    short is found as it is read (serve's workers each say so, then serve ends)."""
    (tmp_path / "bad.gguf").write_bytes(b"not a model at all")
    with open(default_model_path(), "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(1000))  # its header, cut inside the metadata
    argv = [a.format(bad_gguf=tmp_path / "bad.gguf", cut_gguf=tmp_path / "cut.gguf") for a in flags]
    # its own session: a server that does start (the fault this test looks for) goes with all its workers
    p = subprocess.Popen([sys.executable, "-m", "kvseal.cli", "serve", *mode, *argv, "--port", str(free_port())],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise AssertionError(f"kvseal serve {' '.join(argv)} started instead of refusing") from None
    lines = err.strip().splitlines()
    assert p.returncode != 0 and "Traceback" not in err, err[-2000:]
    assert says in lines[-1] or (flags[1] == "{cut_gguf}" and not mode and says in lines[0]), err[-2000:]
