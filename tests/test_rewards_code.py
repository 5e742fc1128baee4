"""Code rewards: extraction, test-field validation, scoring, the harness protocol, the shipped problems."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowmem_grpo.rewards.code import code_binary_reward, code_reward, extract_code, run_tests, get_tests

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(0, 0) == 0", "assert add(2, 2) == 4"]
RIGHT = "def add(a, b):\n    return a + b\n"


def rows(n, tests=TESTS, field="tests"):
    return [{field: list(tests)} for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# Extraction

def test_extract_takes_the_last_python_block():
    text = "First try:\n```python\ndef add(a, b):\n    return a - b\n```\nFixed:\n```python\n" + RIGHT + "```\nDone."
    assert extract_code(text) == RIGHT


def test_extract_prefers_python_blocks_over_other_languages():
    text = "```python\n" + RIGHT + "```\nRun it with:\n```bash\npython add.py\n```"
    assert extract_code(text) == RIGHT
    assert extract_code("```py\nx = 1\n```") == "x = 1\n"


def test_extract_untagged_block_then_unclosed_block_then_whole_text():
    assert extract_code("Here:\n```\n" + RIGHT + "```") == RIGHT
    assert extract_code("Here:\n```python\n" + RIGHT) == RIGHT       # cut off by the length limit
    assert extract_code(RIGHT) == RIGHT


def test_extract_ignores_other_unclosed_blocks_and_junk():
    assert extract_code("```" * 20000) == "```" * 20000                  # one line, no block: the whole text
    assert extract_code("```python\n" + RIGHT + "```\n```text\nunfinished") == RIGHT


# ---------------------------------------------------------------------------------------------
# Rows

@pytest.mark.parametrize("row", [{}, {"tests": None}, {"tests": []}, {"tests": "assert True"}, {"tests": [1, 2]},
                                 {"tests": ["assert f(", "assert True"]}, {"tests": ["   "]}, "not a dict"])
def test_rows_without_usable_tests_are_skipped(row):
    assert get_tests(row) is None
    assert code_reward([RIGHT], prompts=[""], rows=[row]) == [None]


def test_tests_as_a_json_string_and_a_custom_field():
    assert get_tests({"tests": json.dumps(TESTS)}) == TESTS
    assert code_reward([RIGHT], rows=rows(1, field="checks"), tests_field="checks") == [1.0]
    assert code_reward([RIGHT], rows=rows(1, field="checks")) == [None]     # default field is 'tests'


def test_unknown_keyword_is_an_error():
    with pytest.raises(TypeError, match="timout"):
        code_reward([RIGHT], rows=rows(1), timout=3)


# ---------------------------------------------------------------------------------------------
# Scores

def test_fraction_and_binary_scores():
    completions = [
        "```python\n" + RIGHT + "```",
        "def add(a, b):\n    return a * b",        # right only for (0, 0) and (2, 2)
        "def add(a, b):\n    return 0",            # right for (-1, 1) and (0, 0)
        "def add(a, b):\n    return a + b +",      # syntax error
        "no code at all",
    ]
    assert code_reward(completions, rows=rows(5), timeout=2) == [1.0, 0.5, 0.5, 0.0, 0.0]
    assert code_binary_reward(completions, rows=rows(5), timeout=2) == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_results_keep_completion_order_with_parallel_workers():
    completions = [RIGHT if i % 3 == 0 else "def add(a, b):\n    return a - b" for i in range(7)]
    expected = [1.0 if i % 3 == 0 else 0.5 for i in range(7)]   # a - b passes only add(0, 0) == 0
    got = code_reward(completions, rows=rows(7, ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]), workers=2)
    assert got == expected


def test_one_hanging_test_fails_alone():
    code = "def add(a, b):\n    if a == 2:\n        while True:\n            pass\n    return a + b"
    run = run_tests(code, TESTS, timeout=0.5)
    assert run.passed == [True, True, True, False]
    assert run.details[3] == "_TestTimeout"
    assert run.fraction == 0.75


def test_state_is_shared_between_solution_and_tests_but_not_between_completions():
    code = "calls = []\ndef add(a, b):\n    calls.append(1)\n    return a + b"
    tests = ["assert add(1, 1) == 2", "assert len(calls) == 1"]
    assert code_reward([code, code], rows=rows(2, tests)) == [1.0, 1.0]


def test_solution_exception_fails_every_test_with_the_reason():
    run = run_tests("raise ValueError('no')\n" + RIGHT, TESTS, timeout=1)
    assert run.passed == [False] * 4
    assert all("ValueError" in d for d in run.details)


def test_printing_fake_verdicts_or_exiting_early_scores_nothing():
    for cheat in ["print('0 pass')\nprint('1 pass')\nprint('2 pass')\nprint('3 pass')",
                  "import os\nos._exit(0)",
                  "import sys\nsys.stdout.write('PASSED\\n' * 4)\nsys.exit(0)"]:
        run = run_tests(cheat, TESTS, timeout=1)
        assert run.passed == [False] * 4, cheat


def test_the_harness_source_file_is_gone_before_the_solution_runs():
    code = "import os\nSEEN = sorted(os.listdir('.'))"
    run = run_tests(code, ["assert SEEN == []"], timeout=1)
    assert run.passed == [True]


# ---------------------------------------------------------------------------------------------
# Registry and shipped data

def test_builtin_names_resolve():
    from lowmem_grpo.rewards import resolve
    from lowmem_grpo.rewards import code as code_module
    from lowmem_grpo.rewards import countdown as countdown_module

    assert resolve("code") is code_module.code_reward
    assert resolve("code_binary") is code_module.code_binary_reward
    assert resolve("countdown") is countdown_module.countdown_reward


def load_problems():
    with open(ROOT / "data" / "code_problems.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_shipped_problems_are_well_formed():
    problems = load_problems()
    assert len(problems) >= 20
    assert len({p["entry_point"] for p in problems}) == len(problems)
    for p in problems:
        assert set(p) >= {"prompt", "tests", "entry_point", "solution"}
        assert 3 <= len(p["tests"]) <= 6 and get_tests(p) == p["tests"]
        assert p["entry_point"] in p["prompt"] and f"def {p['entry_point']}(" in p["solution"]


def test_shipped_reference_solutions_pass_and_stubs_do_not():
    problems = load_problems()
    fenced = ["Here is my solution.\n```python\n" + p["solution"] + "```" for p in problems]
    assert code_binary_reward(fenced, rows=problems, workers=2) == [1.0] * len(problems)
    # The tests must be able to fail: a function that returns a constant passes none of the suites.
    for constant in ("None", "0", "''", "[]"):
        stubs = [f"def {p['entry_point']}(*args, **kwargs):\n    return {constant}" for p in problems]
        assert all(s < 1.0 for s in code_reward(stubs, rows=problems, workers=2)), constant


def test_threads_left_running_do_not_hold_up_the_result():
    code = "import threading, time\nthreading.Thread(target=lambda: time.sleep(60)).start()\n" + RIGHT
    run = run_tests(code, TESTS, timeout=1, total_timeout=30)
    assert run.passed == [True] * 4 and run.sandbox.killed_reason is None and run.sandbox.returncode == 0
