"""Every command of benchmarks/README.md's suite table is one its benchmark accepts as written.

Each command is handed to its module's ``main`` (its arguments as ``argv``, or as ``sys.argv`` for a
``main`` without one) with argparse stopped right after it parsed: the module imports on this CPU
machine, and its own parser reads every documented option and value, nothing left over. What runs after
the parse needs a GPU and is the benchmark itself.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMAND = re.compile(r"`((?:python|torchrun)[^`]*?-m benchmarks\.[^`]*)`")
COMMANDS = COMMAND.findall((ROOT / "benchmarks/README.md").read_text())


class _Parsed(Exception):
    """Raised in place of running the benchmark, with what its parser read and left over."""


def parse_as_documented(command: str, monkeypatch) -> tuple[argparse.Namespace, list[str]]:
    """The namespace and the leftover words of ``command``'s first argument parse in its module."""
    words = shlex.split(command)
    module = words[words.index("-m") + 1]
    argv = words[words.index("-m") + 2:]
    parse = argparse.ArgumentParser.parse_known_args

    def stop_after_parsing(self, args=None, namespace=None):
        raise _Parsed(*parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", stop_after_parsing)
    monkeypatch.setattr(sys, "argv", [module, *argv])
    main = importlib.import_module(module).main
    with pytest.raises(_Parsed) as parsed:
        main(argv) if inspect.signature(main).parameters else main()
    return parsed.value.args


def test_the_table_lists_every_suite():
    suites = {shlex.split(c)[shlex.split(c).index("-m") + 1] for c in COMMANDS}
    assert len(COMMANDS) >= 15 and "benchmarks.bench_vllm" in suites and "benchmarks.bench_fp8_linear" in suites


@pytest.mark.parametrize("command", COMMANDS)
def test_a_documented_command_parses_as_written(command, monkeypatch):
    namespace, leftover = parse_as_documented(command, monkeypatch)
    assert leftover == [], f"{command}: its parser does not know {leftover}"
    assert vars(namespace)


def test_a_misspelled_option_is_caught(monkeypatch):
    """The negative control: the same check on a command with an option its parser lacks."""
    _, leftover = parse_as_documented("python -m benchmarks.bench_rollout_decode --layerz 8", monkeypatch)
    assert leftover == ["--layerz", "8"]
