"""The README's commands and example stay true."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs_and_prints_what_it_says(capsys):
    text = README.read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out.split()
    assert out[0] == "True" and out[1] == "8" and out[2] == "49152"


def test_readme_gives_exactly_two_commands_and_ci_runs_the_test_one():
    text = README.read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", text, re.S)
    assert len(commands) == 2
    assert "fedexlora run" in commands[0]
    ci = (README.parent / ".ci" / "run").read_text()
    test_cmd = commands[1].split("&&")[-1].strip()
    assert test_cmd == "bash scripts/test.sh"
    assert test_cmd in ci
