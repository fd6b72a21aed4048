"""The command line for a newcomer: help at once (no torch), an example in every help text, -q/-v
after the command too, and a mistyped model alias answered with the alias meant."""

import re
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from attnprobe.cli import main

COMMANDS = sorted(main.commands)


def test_every_help_has_an_example():
    for args in ([], *([name] for name in COMMANDS)):
        result = CliRunner().invoke(main, [*args, "--help"])
        assert result.exit_code == 0 and "Example: attnprobe" in result.output, (args, result.output)


def test_help_imports_neither_torch_nor_transformers():
    code = (
        "import sys\nfrom click.testing import CliRunner\nfrom attnprobe.cli import main\n"
        f"for args in ([], *([c] for c in {COMMANDS!r})):\n"
        "    assert CliRunner().invoke(main, [*args, '--help']).exit_code == 0\n"
        "print(sorted(m for m in ('torch', 'transformers', 'pandas') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_suite_is_read_and_refused_without_torch(tmp_path):
    """A suite's error (the most common first mistake) comes before torch loads: every shipped suite
    parses without it, and `run`, `check` and `probe` refuse bad input in one line without it."""
    (tmp_path / "bad.yaml").write_text("name: x\ntemplates: [{id: a, text: hi}]\nbogus: 1\n")
    code = (
        "import sys, glob\nfrom click.testing import CliRunner\nfrom attnprobe.cli import main\n"
        "from attnprobe.suite import load_suite\n"
        "for path in sorted(glob.glob('probes/*.yaml')):\n    load_suite(path)\n"
        f"bad = {str(tmp_path / 'bad.yaml')!r}\n"
        "for args in (['run', bad], ['check', bad], ['probe', '/dev/zero']):\n"
        "    result = CliRunner().invoke(main, args)\n"
        "    assert result.exit_code == 2 and len(result.output.splitlines()) == 1, result.output\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_quiet_and_verbose_after_the_command():
    both = CliRunner().invoke(main, ["check", "probes/minimal.yaml", "-q", "-v"])
    assert both.exit_code == 2 and "-q and -v contradict each other" in both.output
    mixed = CliRunner().invoke(main, ["-q", "check", "probes/minimal.yaml", "--verbose"])
    assert mixed.exit_code == 2 and "contradict" in mixed.output


def test_a_mistyped_alias_names_the_alias_meant():
    result = CliRunner().invoke(main, ["check", "probes/minimal.yaml", "--model", "smolm2-135m"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "unknown model 'smolm2-135m'; did you mean smollm2-135m?" in result.output


def test_a_mistyped_key_or_column_names_the_one_meant_in_the_yamls_spelling(tmp_path):
    import pytest

    from attnprobe.errors import SuiteError
    from attnprobe.suite import load_suite

    minimal = Path(__file__).resolve().parents[2] / "probes" / "minimal.yaml"
    (tmp_path / "occupations-bls.tsv").write_text((minimal.parent / "occupations-bls.tsv").read_text())
    cases = [
        ("templates:", "templats:", "unknown key 'templats'; did you mean 'templates'? allowed: analysis,"),
        ("{cut: pronoun, candidates", "{cut: pronoun, candidate", "did you mean 'candidates'?"),
        ("  clusters: [occupation]", "  clusters: [ocupation]", "'ocupation' is not a slot, slot.field or"),
        (
            "covariate: occupation.bls_pct_female",
            "covariate: occupation.bls_pct_femal",
            "did you mean 'occupation.bls_pct_female'? (known: template, item, occupation, "
            "occupation.anti_stereotype,",
        ),
    ]
    for old, new, message in cases:
        path = tmp_path / "suite.yaml"
        path.write_text(minimal.read_text().replace(old, new))
        with pytest.raises(SuiteError, match=re.escape(message)):
            load_suite(path)
    path.write_text(minimal.read_text().replace("templates:", "zzz: 1\ntemplates:"))
    with pytest.raises(SuiteError) as raised:  # nothing near: no guess
        load_suite(path)
    assert "did you mean" not in str(raised.value)


def test_the_program_ends_with_mains_code_after_its_exit_handlers(tmp_path):
    """command_line (the console script and `python -m attnprobe`) skips the interpreter's teardown:
    the exit code is main()'s, what it printed arrives whole, exit handlers still run, and nothing
    after it runs, not even the teardown's finalizers (`kept`'s, which a normal exit runs)."""
    code = (
        "import atexit\nfrom attnprobe.cli.program import command_line\n"
        "class Torn:\n    def __del__(self):\n        print('torn down')\nkept = Torn()\n"
        "atexit.register(lambda: print('handler ran'))\ncommand_line()\nprint('not reached')"
    )
    listed = subprocess.run([sys.executable, "-c", code, "models"], capture_output=True, text=True)
    lines = listed.stdout.splitlines()
    assert listed.returncode == 0 and lines[-1] == "handler ran", listed.stdout + listed.stderr
    assert any(line.startswith("smollm2-135m") for line in lines)
    assert {"not reached", "torn down"}.isdisjoint(lines), listed.stdout
    missing = str(tmp_path / "missing.yaml")
    refused = subprocess.run(
        [sys.executable, "-m", "attnprobe", "check", missing], capture_output=True, text=True
    )
    assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert refused.stderr.startswith("attnprobe: error:") and missing in refused.stderr
