"""The CLI's contract: --help everywhere, one-line errors with exit code 2, tracebacks only with --debug."""

import subprocess
import sys

import pytest

from oarlock.cli import build_parser, main


def _subcommands():
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return sorted(action.choices)


def test_top_level_help_lists_inspect(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "inspect" in capsys.readouterr().out


@pytest.mark.parametrize("cmd", _subcommands())
def test_every_subcommand_has_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    assert "usage: oarlock" in capsys.readouterr().out


def test_unknown_command_is_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["no-such-command"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid choice" in err


def test_console_script_bad_path_one_line_no_traceback(tmp_path):
    missing = tmp_path / "missing"
    r = subprocess.run([sys.executable, "-m", "oarlock.cli", "inspect", str(missing)], capture_output=True,
                       text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == f"oarlock: error: {missing}: no such file or directory"
    assert "Traceback" not in r.stderr


def test_debug_flag_shows_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "oarlock.cli", "--debug", "inspect", str(tmp_path / "x")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" in r.stderr and "CheckpointFormatError" in r.stderr


def _torch_imported_after(argv: list[str]) -> tuple[bool, int, str]:
    """(torch in sys.modules, exit code, stderr) after main(argv) in a fresh interpreter."""
    code = ("import sys, io, contextlib\nfrom oarlock.cli import main\nerr = io.StringIO()\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):\n"
            f"    try:\n        rc = main({argv!r})\n    except SystemExit as e:\n        rc = e.code\n"
            "print('torch' in sys.modules, rc, repr(err.getvalue()))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    flag, rc, err = r.stdout.strip().split(" ", 2)
    return flag == "True", int(rc), err


@pytest.mark.parametrize("argv,code", [
    (["--help"], 0), (["--version"], 0), (["no-such-command"], 2), ([], 2),
    (["debug", "--help"], 0), (["debug", "diff"], 2), (["debug", "render", "--help"], 0),
    (["memory", "--help"], 0), (["memory", "simulate"], 2), (["memory", "view", "--bogus"], 2),
    # the checkpoint commands (issue 29: `convert --help` waited ~4 s for torch before printing)
    (["convert", "--help"], 0), (["inspect", "--help"], 0), (["verify", "--help"], 0), (["diff", "--help"], 0),
    (["aoa", "--help"], 0), (["aoa", "explain", "--help"], 0), (["convert"], 2), (["inspect", "--bogus"], 2),
])
def test_help_and_argument_errors_do_not_import_torch(argv, code):
    imported, rc, err = _torch_imported_after(argv)
    assert rc == code
    assert not imported, f"oarlock {' '.join(argv)} imported torch"
    if code == 2:
        assert "error:" in err


def test_commands_table_matches_what_each_module_registers():
    import argparse
    import importlib

    from oarlock.cli import COMMANDS

    for module in {m for m, _ in COMMANDS.values()}:
        p = argparse.ArgumentParser()
        sub = p.add_subparsers()
        importlib.import_module(module).register(sub)
        listed = sorted(n for n, (m, _) in COMMANDS.items() if m == module)
        assert sorted(sub.choices) == listed, f"{module} registers {sorted(sub.choices)}; add them to COMMANDS"


def test_lazy_packages_list_their_public_names_in_dir():
    code = ("import sys, oarlock.memory as m, oarlock.debug as d\n"
            "print('torch' in sys.modules, all(n in dir(m) for n in m.__all__), all(n in dir(d) for n in d.__all__),"
            " 'trace_region' in dir(m), 'render_memory_html' in dir(m), 'capture' in dir(d))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.split() == ["False", "True", "True", "True", "True", "True"], r.stderr
    import oarlock.debug as od
    import oarlock.memory as om

    assert om.render_html is om.render_memory_html and od.render_html is od.render_graph_html
    assert callable(om.trace_region) and callable(od.capture)


def test_checkpoint_package_is_lazy_and_complete():
    """``import oarlock.checkpoint`` imports neither torch nor torch.distributed.checkpoint; every name of its
    ``__all__`` resolves (to the object its submodule defines) and is listed by ``dir()``."""
    code = ("import sys, oarlock.checkpoint as c\n"
            "print('torch' in sys.modules, 'torch.distributed.checkpoint' in sys.modules,"
            " all(n in dir(c) for n in c.__all__))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.split() == ["False", "False", "True"], r.stderr
    import oarlock.checkpoint as c
    from oarlock.checkpoint.lifecycle.async_save import async_save
    from oarlock.checkpoint.lifecycle.manager import RankLocal

    assert all(getattr(c, n) is not None for n in c.__all__)
    assert c.async_save is async_save and c.RankLocal is RankLocal


@pytest.mark.parametrize("argv", [["verify", "{p}", "--json"], ["inspect", "{p}", "--json"],
                                  ["diff", "{p}", "{p}", "--json"]])
def test_json_commands_report_bad_input_as_json(tmp_path, capsys, argv):
    """With --json a failure is also a JSON object on stdout (naming the missing path), exit 2; the one-line
    error stays on stderr."""
    import json

    missing = tmp_path / "nope"
    assert main([a.format(p=missing) for a in argv]) == 2
    out, err = capsys.readouterr()
    rec = json.loads(out)
    assert rec["exit_code"] == 2 and str(missing) in rec["error"], rec
    assert err.startswith("oarlock: error:") and str(missing) in err
