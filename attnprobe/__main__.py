"""`python -m attnprobe`: the command line."""

from .cli.program import command_line

if __name__ == "__main__":
    command_line()
