"""The app shell: help, version, usage errors, one-line errors with exit codes, lazy imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from encache.cli import errors
from encache.cli.app import DEBUG_HINT, guard
from encache.connectors.store import StoreError
from encache.connectors.store.disk.store import DiskStore
from cli_support import invoke, one_line_error, populated

COMMANDS = ("list", "stats", "size", "verify", "purge", "hash")


def test_help_lists_every_command():
    r = invoke("--help")
    assert r.exit_code == 0
    for c in COMMANDS:
        assert c in r.stdout


@pytest.mark.parametrize("cmd", COMMANDS)
def test_each_command_has_help(cmd):
    r = invoke(cmd, "--help")
    assert r.exit_code == 0, r.output
    assert "Usage" in r.stdout


def test_no_args_shows_help_with_usage_exit_code():
    r = invoke()
    assert r.exit_code == errors.EXIT_USAGE
    assert "Usage" in r.output and "list" in r.output


def test_version():
    r = invoke("--version")
    assert r.exit_code == 0
    assert r.stdout.startswith("encache ")


def test_unknown_command_and_missing_store_are_usage_errors():
    assert invoke("bogus").exit_code == errors.EXIT_USAGE
    r = invoke("list")  # no --store, no $ENCACHE_STORE
    assert r.exit_code == errors.EXIT_USAGE
    assert "--store" in r.output


def test_store_from_environment(tmp_path):
    populated(tmp_path / "s")
    r = invoke("list", "-q", env={"ENCACHE_STORE": str(tmp_path / "s")})
    assert r.exit_code == 0 and len(r.stdout.split()) == 9


def test_missing_store_is_one_line_store_error(tmp_path):
    r = invoke("stats", "-s", tmp_path / "nope")
    assert r.exit_code == errors.EXIT_STORE
    assert "no store" in one_line_error(r)
    assert not (tmp_path / "nope").exists()  # management commands never create a store


def test_bad_url_scheme_is_store_error():
    r = invoke("list", "-s", "ftp://host/x")
    assert r.exit_code == errors.EXIT_STORE
    assert "scheme" in one_line_error(r)


def test_unreadable_store_is_store_error(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads everything")
    s = populated(tmp_path / "s")
    os.chmod(s.root, 0)
    try:
        r = invoke("list", "-s", s.root)
        assert r.exit_code == errors.EXIT_STORE
        one_line_error(r)
    finally:
        os.chmod(s.root, 0o755)


# -- the error guard, on a toy app built with the same guard ----------------------------

def _toy(tmp_path):
    toy = typer.Typer()

    @toy.command()
    def boom(kind: str):
        if kind == "bug":
            raise ZeroDivisionError("division by zero")
        if kind == "encache":
            raise errors.EncacheError("custom", errors.EXIT_ABORTED, hint="a hint")
        if kind == "store":
            raise StoreError("store down")
        if kind == "lock":
            a, b = DiskStore(tmp_path / "l"), DiskStore(tmp_path / "l")
            with a.lock("precompute"), b.lock("precompute"):
                pass
        if kind == "usage":
            raise typer.BadParameter("bad value")

    toy.registered_commands[0].callback = guard(toy.registered_commands[0].callback)
    return toy


@pytest.mark.parametrize("kind, code, text", [
    ("bug", errors.EXIT_ERROR, f"ZeroDivisionError: division by zero ({DEBUG_HINT})"),
    ("encache", errors.EXIT_ABORTED, "custom (a hint)"),
    ("store", errors.EXIT_STORE, "store down"),
    ("lock", errors.EXIT_LOCKED, "locked by another precompute"),
])
def test_errors_are_one_line_with_exit_code(tmp_path, kind, code, text):
    r = CliRunner().invoke(_toy(tmp_path), [kind], env={"ENCACHE_DEBUG": None})
    assert r.exit_code == code
    assert text in one_line_error(r)


def test_usage_errors_keep_typer_handling(tmp_path):
    r = CliRunner().invoke(_toy(tmp_path), ["usage"], env={"ENCACHE_DEBUG": None})
    assert r.exit_code == errors.EXIT_USAGE
    assert "bad value" in r.output


def test_debug_env_reraises(tmp_path):
    r = CliRunner().invoke(_toy(tmp_path), ["bug"], env={"ENCACHE_DEBUG": "1"})
    assert isinstance(r.exception, ZeroDivisionError)
    assert "Error: " not in r.stderr


# -- the real console script ---------------------------------------------------------------

def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "encache.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ENCACHE_DEBUG": "", **(env or {})})


def test_process_exit_code_and_single_stderr_line(tmp_path):
    p = _run("list", "-s", tmp_path / "missing")
    assert p.returncode == errors.EXIT_STORE
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("Error: ")
    assert p.stdout == ""


@pytest.mark.parametrize("args, says", [
    (["list", "-s", "S", "--limit", "0"],
     "Error: Invalid value for '--limit': Input should be greater than or equal to 1 "
     "(see: encache list -h)"),
    (["list"], "Error: Missing option '--store' / '-s' (env var: 'ENCACHE_STORE'). "
               "(see: encache list -h)"),
    (["lst"], "Error: No such command 'lst'. Did you mean 'list'? (see: encache -h)"),
    (["connector-config", "-s", "S", "--max-bytes", "9Q"],
     "Error: Invalid value for '--max-bytes': invalid size"),
])
def test_usage_errors_are_one_line_with_exit_2(tmp_path, args, says):
    """What Typer finds wrong with the command line is one line too (not a boxed panel
    under a usage block), with where the help is; the store is left alone."""
    p = _run(*[tmp_path if a == "S" else a for a in args])
    assert p.returncode == errors.EXIT_USAGE, p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith(says), p.stderr
    assert p.stdout == "" and list(tmp_path.iterdir()) == []


def test_bare_command_shows_the_help_and_a_command_succeeds(tmp_path):
    bare = _run()
    assert bare.returncode == errors.EXIT_USAGE and "Usage: encache" in bare.stdout
    ok = _run("stats", "-s", tmp_path, "--json")
    assert ok.returncode == 0 and ok.stderr == "" and json.loads(ok.stdout)["entries"] == 0


def test_management_commands_do_not_import_vllm_or_torch(tmp_path):
    populated(tmp_path / "s")
    code = (
        "import sys\n"
        "from encache.cli.app import main\n"
        "for argv in (['list', '--json'], ['stats'], ['size', '--by', 'model'], ['verify'],"
        " ['purge', '--lora', 'zz', '--dry-run']):\n"
        "    try:\n"
        "        main(argv + ['-s', sys.argv[1]])\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), (argv, e.code)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch'))\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
        "sys.exit(9 if heavy else 0)\n"
    )
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "HEAVY []" in p.stderr



def test_shell_completion():
    # --show-completion detects the user's shell from the process tree (shellingham): run
    # it under bash, as a user would (the trailing `; true` keeps bash from exec'ing it, so
    # the test does not depend on what started pytest)
    r = subprocess.run(["bash", "-c", f"'{sys.executable}' -m encache.cli --show-completion; true"],
                       capture_output=True, text=True, timeout=120)
    assert "_encache_completion" in r.stdout, r.stderr[-2000:]
    p = subprocess.run([sys.executable, "-m", "encache.cli"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "_ENCACHE_COMPLETE": "complete_bash",
                                         "COMP_WORDS": "encache size --by ", "COMP_CWORD": "3"})
    assert p.stdout.split() == ["model", "lora"]


@pytest.mark.parametrize("debug", [False, True])
def test_engine_start_keeps_vllm_deprecation_warnings_off_the_terminal(debug):
    """What vLLM's import draws from torch (FutureWarning / DeprecationWarning raised from a
    ``vllm.*`` module) is not shown to a precompute user, unless ENCACHE_DEBUG asks."""
    code = ("import os, warnings\n"
            "from encache.cli.common import quiet_engine_start\n"
            "quiet_engine_start()\n"
            "warnings.warn_explicit('reduce_op is deprecated', FutureWarning, 'dispatcher.py', 1,"
            " module='vllm.triton_utils.dispatcher')\n"
            "warnings.warn_explicit('ours', FutureWarning, 'x.py', 1, module='encache.x')\n"
            "print(os.environ['VLLM_LOGGING_LEVEL'] if 'VLLM_LOGGING_LEVEL' in os.environ else '-')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("ENCACHE_DEBUG", "VLLM_LOGGING_LEVEL")}
    if debug:
        env["ENCACHE_DEBUG"] = "1"
    r = subprocess.run([sys.executable, "-W", "default", "-c", code], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert ("reduce_op is deprecated" in r.stderr) is debug
    assert "ours" in r.stderr  # other modules' warnings are left alone
    assert r.stdout.strip() == ("-" if debug else "ERROR")
