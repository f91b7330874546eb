"""A demonstrations file is data: bounded before it is decoded, each line UTF-8 with no
lone surrogate and JSON of a sane depth, refused in one line naming the line (exit 2
through the command line), in bounded memory and time."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llamagym.errors import ConfigError
from llamagym_builtins.demonstrations_file import MAX_LINE_BYTES, load_demonstrations

GOOD = json.dumps({"prompt": "Which lever?", "response": "right"}).encode()


def _file(path: Path, bad: bytes) -> Path:
    path.write_bytes(GOOD + b"\n" + bad + b"\n" + GOOD + b"\n")
    return path


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (b'{"prompt": "\\ud800", "response": "right"}', "line 2: 'prompt' holds a lone surrogate"),
        (b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", '
         b'"content": "\\udfff"}]}', "line 2: message 1's content holds a lone surrogate"),
        (b'{"prompt": "\xff\xfe", "response": "right"}', "line 2: not UTF-8 \\(byte 13"),
        (b"[" * 100_000 + b"]" * 100_000, "line 2: JSON nested too deeply"),
        (b'{"prompt": "a", "response": "b", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
         "line 2: JSON nested too deeply"),
        (b'{"prompt": "' + b"a" * (MAX_LINE_BYTES + 10) + b'", "response": "b"}',
         f"line 2: longer than {MAX_LINE_BYTES:,} bytes"),
    ],
    ids=["surrogate", "surrogate-in-messages", "bad-utf8", "deep", "deep-in-a-field", "long"],
)
def test_a_bad_line_is_named(tmp_path: Path, bad: bytes, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_demonstrations(_file(tmp_path / "demos.jsonl", bad))


def test_a_huge_line_and_a_huge_file_are_refused_in_bounded_memory(tmp_path: Path) -> None:
    """A 100 MB line, and a 16 GB file with no newline (sparse: no disk is used), each
    refused with under 500 MB more of RSS and in seconds."""
    line = tmp_path / "line.jsonl"
    with line.open("wb") as out:
        out.write(b'{"prompt": "')
        out.write(b"a" * 100 * 2**20)
        out.write(b'", "response": "right"}\n')
    sparse = tmp_path / "sparse.jsonl"
    with sparse.open("wb") as out:
        out.truncate(16 * 2**30)  # 16 GB of zero bytes, no newline
    for path, said in ((line, "line 1: longer than"), (sparse, "bytes, over the")):
        code = (
            "import resource, sys\n"
            "from llamagym_builtins.demonstrations_file import load_demonstrations\n"
            "from llamagym.errors import ConfigError\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            f"try:\n    load_demonstrations({str(path)!r})\n"
            "except ConfigError as error:\n    print(error)\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
        )
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, check=True)
        said_line, grown_kb = done.stdout.strip().splitlines()
        assert said in said_line
        # What reading the file added to the process's peak (the imports before it
        # weigh 250-650 MB, with torch): under 500 MB.
        assert int(grown_kb) < 500 * 1024
        assert time.monotonic() - started < 60


def test_the_command_line_refuses_it_in_one_line(tmp_path: Path, cli) -> None:
    path = _file(tmp_path / "demos.jsonl", b'{"prompt": "\\ud800", "response": "right"}')
    code, _, err = cli("run", "blackjack", "--episodes", "8", "--quiet", "-o", tmp_path / "r",
                       "--set", f"algorithm.warm_start.demonstrations={path}")
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "line 2" in lines[0] and "lone surrogate" in lines[0]


@pytest.mark.parametrize("mode", ["generate", "score"])
def test_a_demonstration_longer_than_any_context_is_never_tokenized(
    mode: str, monkeypatch
) -> None:
    """A line under the byte limit can still hold more characters than the model's
    context has room for, however they tokenize: it is skipped as too long before its
    chat template renders or anything is tokenized; the others train."""
    from llamagym.testing import tiny_agent
    from llamagym_builtins import demonstrations_file

    tokenizer = tiny_agent().policy.tokenizer
    rendered: list[int] = []
    real_render = demonstrations_file.render_chat

    def render(tokenizer, conversations):
        rendered.extend(sum(len(m["content"]) for m in c) for c in conversations)
        return real_render(tokenizer, conversations)

    monkeypatch.setattr(demonstrations_file, "render_chat", render)
    huge = "lever " * 500_000  # 3 MB: under the line limit, far over a 512-token context
    small = [{"role": "user", "content": "Which lever?"},
             {"role": "assistant", "content": "right"}]
    big = [{"role": "user", "content": huge}, {"role": "assistant", "content": "right"}]
    if mode == "generate":
        turns = demonstrations_file.demonstration_turns([big, small], tokenizer, 512)
    else:
        turns = demonstrations_file.choice_turns(
            [demonstrations_file.Demonstration(big, ["left", "right"]),
             demonstrations_file.Demonstration(small, ["left", "right"])],
            tokenizer, 512, tokenizer.eos_token_id,
        )
    assert len(turns) == 1 and max(rendered) < 100
