"""Reward functions used by the tests, loaded the way users' are: 'user_rewards:<name>'."""


def digit_count(completions, *, prompts, rows, per_digit=0.25, **_):
    """Graded, so that even a random model's groups have contrast (a gradient)."""
    return [per_digit * sum(ch.isdigit() for ch in c) for c in completions]


def raises(completions, **_):
    raise ZeroDivisionError("boom")


def wrong_count(completions, **_):
    return [0.0] * (len(completions) + 1)


def not_numbers(completions, **_):
    return ["high"] * len(completions)


def nan_scores(completions, *, rows, **_):
    """lowmem-grpo's convention (it names rows): NaN is an error. A TRL-shaped function's NaN means "does not apply"."""
    return [float("nan")] * len(completions)


def skip_all(completions, **_):
    return [None] * len(completions)


def has_digit(completions, **_):
    """Binary (1 if the completion holds a digit): a random tiny model's groups are mixed, so the
    binary-reward diagnostics (docs/algorithm.md §3, §4) have something to measure."""
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


def even_code_sum(completions, **_):
    """Binary and about even odds whatever the model: 1 if the completion's character codes sum to an even
    number. Any change of a greedy token can flip it, so two agreeing accuracies mean the same completions."""
    return [float(sum(map(ord, c)) % 2 == 0) for c in completions]


def raises_in_process_1(completions, **_):
    """Scores like digit_count, except in process 1 of a torchrun job, where it raises."""
    import os

    if os.environ.get("RANK") == "1":
        raise ZeroDivisionError("boom in process 1")
    return [0.25 * sum(ch.isdigit() for ch in c) for c in completions]


def hangs_in_process_1(completions, **_):
    """Scores like digit_count, except in process 1 of a torchrun job, where it never returns."""
    import os
    import time

    if os.environ.get("RANK") == "1":
        time.sleep(3600)
    return [0.25 * sum(ch.isdigit() for ch in c) for c in completions]


def answer_digits(completions, *, prompts, rows, **_):
    """Graded and tied to the row: 0.25 per completion character that is a digit of the row's answer, plus
    0.1 per character the prompt also holds (a reward that scores against the wrong row or prompt differs)."""
    return [0.25 * sum(ch in str(r["answer"]) for ch in c) + 0.1 * sum(ch in p for ch in c)
            for c, p, r in zip(completions, prompts, rows)]


def marks_its_calls(completions, **_):
    """has_digit, and each call adds a line to the file $LOWMEM_TEST_MARK.$RANK: a test's count of the completions
    a process (RANK, as torchrun numbers them) has scored (eval scores its greedy ones first, in one or more calls)."""
    import os

    with open(f"{os.environ['LOWMEM_TEST_MARK']}.{os.environ.get('RANK', '0')}", "a") as f:
        f.write(f"{len(completions)}\n")
    return has_digit(completions)


def a_dict(completions, **_):
    return {"score": 1.0, "other": 0.0, "third": 1.0}


def exits(completions, **_):
    import sys

    sys.exit(3)


def needs_alpha(completions, *, prompts, rows, alpha):
    return [alpha] * len(completions)


def huge(completions, **_):
    return [1e200 if i % 2 else 0.0 for i in range(len(completions))]
