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
