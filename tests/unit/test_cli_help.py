"""The command line for a newcomer: help at once (no torch), an example in every help text, -q/-v
after the command too, and a mistyped model alias answered with the alias meant."""

import subprocess
import sys

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


def test_quiet_and_verbose_after_the_command():
    both = CliRunner().invoke(main, ["check", "probes/minimal.yaml", "-q", "-v"])
    assert both.exit_code == 2 and "-q and -v contradict each other" in both.output
    mixed = CliRunner().invoke(main, ["-q", "check", "probes/minimal.yaml", "--verbose"])
    assert mixed.exit_code == 2 and "contradict" in mixed.output


def test_a_mistyped_alias_names_the_alias_meant():
    result = CliRunner().invoke(main, ["check", "probes/minimal.yaml", "--model", "smolm2-135m"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "unknown model 'smolm2-135m'; did you mean smollm2-135m?" in result.output
