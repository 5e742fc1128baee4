"""Math reward: a hand-written table of verdicts, extraction order, skips, and the bounded math-verify pool."""

from __future__ import annotations

import importlib.util
import json
import threading
from pathlib import Path

import psutil
import pytest

from lowmem_grpo.rewards import math as mr
from lowmem_grpo.rewards.math import VerifyPool, as_number, extract_answer, judge, math_reward

ROOT = Path(__file__).resolve().parent.parent

# (completion, gold answer, expected score). Written by hand; each row is judged exactly as stated.
TABLE = [
    # integers, wrong answers
    ("The answer is \\boxed{42}.", "42", 1.0),
    ("\\boxed{41}", "42", 0.0),
    ("I think it is 7, but checking again: \\boxed{8}", "8", 1.0),
    ("No idea.", "12", 0.0),
    ("\\boxed{}", "12", 0.0),
    # fractions and decimals
    ("So x = \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("\\boxed{0.75}", "\\frac{3}{4}", 1.0),
    ("\\boxed{0.7}", "\\frac{3}{4}", 0.0),
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\tfrac12}", "0.5", 1.0),
    ("Answer: 1/3", "\\frac{1}{3}", 1.0),
    ("Answer: 0.333", "\\frac{1}{3}", 0.0),
    ("\\boxed{3.0}", "3", 1.0),
    ("\\boxed{3.01}", "3", 0.0),
    ("<answer>\\frac{7}{2}</answer>", "3.5", 1.0),
    # negative numbers
    ("\\boxed{-7}", "-7", 1.0),
    ("\\boxed{7}", "-7", 0.0),
    ("The temperature fell to -3 degrees.", "-3", 1.0),
    ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
    # thousands separators
    ("#### 1,234", "1234", 1.0),
    ("The total is 1,234,567 dollars.", "1234567", 1.0),
    ("#### 1,235", "1234", 0.0),
    ("\\boxed{1{,}000}", "1000", 1.0),
    # percentages
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{50\\%}", "0.5", 1.0),
    ("The discount is 25%.", "25\\%", 1.0),
    ("\\boxed{0.25}", "25\\%", 1.0),
    ("\\boxed{25}", "0.25", 0.0),
    # units and currency
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),
    ("\\boxed{10 \\text{ dollars}}", "10", 1.0),
    ("It costs \\$12.50 in total.\n#### \\$12.50", "12.5", 1.0),
    ("\\boxed{\\$5}", "5", 1.0),
    ("\\boxed{12 cm}", "13", 0.0),
    ("\\boxed{45^\\circ}", "45", 1.0),
    ("The answer is 5 apples.", "5", 1.0),
    ("<answer>The answer is 12.</answer>", "12", 1.0),
    # LaTeX: radicals, pi, powers, expressions, equations
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{8}", 0.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("\\boxed{5\\sqrt{3}}", "\\sqrt{75}", 1.0),
    ("\\boxed{\\frac{\\pi}{2}}", "\\pi/2", 1.0),
    ("\\boxed{\\pi}", "\\pi/2", 0.0),
    ("\\boxed{2^{10}}", "1024", 1.0),
    ("\\boxed{1.5 \\times 10^{3}}", "1500", 1.0),
    ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
    ("\\boxed{x^2 + 1}", "(x+1)^2", 0.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{y = 2x + 3}", "2x+3", 1.0),
    ("\\boxed{\\frac{1}{0}}", "2", 0.0),
    # sets, intervals, tuples
    ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}", 1.0),
    ("\\boxed{\\{1, 3\\}}", "\\{1, 2\\}", 0.0),
    ("\\boxed{3, 5}", "5, 3", 1.0),
    ("\\boxed{(0, 1]}", "(0,1]", 1.0),
    ("\\boxed{[0, 1]}", "(0, 1]", 0.0),
    ("\\boxed{x \\in [2, 5)}", "[2,5)", 1.0),
    ("\\boxed{(1, 2)}", "(2, 1)", 0.0),
    # multiple choice, full solutions as gold
    ("\\boxed{\\text{B}}", "B", 1.0),
    ("Adding up, she has 18 eggs left.\n#### 18", "She lays 16, eats 3 and bakes 4: 16 - 3 - 4 = 9... no: 18.\n#### 18", 1.0),
    ("\\boxed{5/6}", "so the answer is $\\boxed{\\frac{5}{6}}$.", 1.0),
    # GSM8K's own answer field: calculator annotations, then '#### N' (the gold is N, not the last number seen)
    ("So she sold \\boxed{72} clips.", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
     "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72", 1.0),
    ("She sold \\boxed{24} clips.", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", 0.0),
    ("The total is 1,080 dollars.", "He pays 12 * 90 = <<12*90=1080>>1080 dollars.\n#### 1080", 1.0),
    # the last number read as LaTeX: a fraction is one number; exponents, bases, denominators, radicands are none
    ("Final Answer: The final answer is $\\frac{1}{2}$. I hope it is correct.", "2", 0.0),
    ("Final Answer: The final answer is $\\frac{1}{2}$. I hope it is correct.", "\\frac{1}{2}", 1.0),
    ("<answer>The answer is $\\frac{3}{4}$.</answer>", "0.75", 1.0),
    ("The answer is 2^{10}.", "10", 0.0),
    ("The answer is 3 \\times 10^{5}.", "3", 0.0),
    ("So the angle is 45^\\circ.", "45", 1.0),
    # thin-space thousands separators
    ("\\boxed{5\\,000}", "0", 0.0),
    ("\\boxed{5\\,000}", "5000", 1.0),
    ("\\boxed{10 000}", "10,\\!000", 1.0),
    # words after a number that change its value are no units
    ("\\boxed{5 squared}", "5", 0.0),
    ("\\boxed{5 thousand}", "5", 0.0),
]


def test_table_is_large_and_covers_both_verdicts():
    assert len(TABLE) >= 40
    assert {score for _, _, score in TABLE} == {0.0, 1.0}


@pytest.mark.parametrize("completion,gold,expected", TABLE, ids=[f"{i:02d}" for i in range(len(TABLE))])
def test_table_inline(completion, gold, expected):
    assert math_reward([completion], prompts=[""], rows=[{"answer": gold}], workers=0) == [expected]


def test_table_through_the_worker_pool():
    """The same verdicts when the whole table is one batch scored by the process pool."""
    completions = [c for c, _, _ in TABLE]
    rows = [{"answer": g} for _, g, _ in TABLE]
    assert math_reward(completions, rows=rows, workers=2) == [s for _, _, s in TABLE]


# ---------------------------------------------------------------------------------------------
# Extraction

def test_extraction_order_is_configurable():
    text = "First \\boxed{3}, then #### 4\nand finally 5"
    assert extract_answer(text) == "3"
    assert extract_answer(text, ("hashes", "boxed")) == "4"
    assert extract_answer(text, "last_number") == "5"
    rows = [{"answer": "4"}]
    assert math_reward([text], rows=rows) == [0.0]
    assert math_reward([text], rows=rows, extract=["hashes", "boxed"]) == [1.0]
    assert math_reward([text], rows=rows, extract="hashes,last_number") == [1.0]


def test_falls_through_to_the_next_extractor():
    assert extract_answer("no box here, #### 17") == "17"
    assert extract_answer("nothing but 1,250.5 and then 3/4") == "3/4"
    assert extract_answer("<answer>9</answer> and 10") == "9"


def test_unclosed_box_falls_back_to_the_last_complete_one():
    assert extract_answer("\\boxed{3} ... so the final answer is \\boxed{4") == "3"
    assert extract_answer("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_answer("the answer is \\boxed 7.") == "7."


def test_degenerate_completions_are_handled_in_linear_time():
    """Repetitive junk a collapsing policy emits: correct results (these inputs took seconds to hours with
    backtracking regexes or a scan per unclosed brace)."""
    assert extract_answer("\\boxed{" * 20000) is None
    assert extract_answer("\\boxed{7} " + "\\boxed{" * 20000) == "7"
    assert extract_answer("<answer>" * 20000 + "5</answer>") == "5"
    assert as_number("5 " + "a" * 40 + "!") is None
    assert as_number("5 " + " ".join(["cm"] * 60)) == 5


def test_unknown_extractor_is_an_error():
    with pytest.raises(ValueError, match="boxd"):
        math_reward(["\\boxed{1}"], rows=[{"answer": "1"}], extract=["boxd"])


def test_as_number():
    assert as_number("1,234") == 1234
    assert as_number("-0.5") == as_number("-\\frac{1}{2}") == as_number("-1/2")
    assert as_number("12%") == as_number("12 percent") == as_number("0.12")
    assert as_number("$5") == as_number("5 cm") == 5
    assert as_number("3 pi") is None and as_number("5 x") is None and as_number("1/0") is None


# ---------------------------------------------------------------------------------------------
# Skips

@pytest.mark.parametrize("gold", ["garbage{{", "\\frac{1}{", "", "   ", None])
def test_unparseable_gold_is_skipped_not_zero(gold):
    rows = [{"answer": gold}, {"answer": gold}]
    assert math_reward(["\\boxed{5}", "garbage{{"], rows=rows, workers=0) == [None, None]
    assert math_reward(["\\boxed{5}", "garbage{{"], rows=rows, workers=2) == [None, None]
    assert judge("5", gold) is None


def test_missing_answer_field_and_custom_field():
    assert math_reward(["\\boxed{5}"], rows=[{"solution": "5"}]) == [None]
    assert math_reward(["\\boxed{5}"], rows=[{"final": 5}], answer_field="final") == [1.0]


def test_numeric_answers_never_call_math_verify(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("math-verify called on plain numbers")

    monkeypatch.setattr(mr, "_verify_many", forbidden)
    completions = [f"Step by step... #### {i * 7:,}" for i in range(1000)]
    rows = [{"answer": str(i * 7 if i % 2 else i * 7 + 1)} for i in range(1000)]
    scores = math_reward(completions, rows=rows)
    assert scores == [1.0 if i % 2 else 0.0 for i in range(1000)]


# ---------------------------------------------------------------------------------------------
# Bounded time

def test_slow_comparison_is_bounded_and_scores_zero():
    # 10^{10^{10}} parses fine but cannot be compared in time: the prediction gets 0, not a skip
    assert math_reward(["\\boxed{5}"], rows=[{"answer": "10^{10^{10}}"}], timeout=1, workers=0) == [0.0]
    assert math_reward(["\\boxed{5}", "\\boxed{6}"], rows=[{"answer": "10^{10^{10}}"}] * 2, timeout=1) == [0.0, 0.0]


def test_judge_from_another_thread_uses_the_pool():
    got = []
    thread = threading.Thread(target=lambda: got.append(judge("2\\sqrt{2}", "\\sqrt{8}", timeout=2)))
    thread.start()
    thread.join(60)
    assert got == [True]


def test_hung_worker_is_killed_and_replaced():
    def live_workers():
        return [p.pid for p in psutil.Process().children()
                if p.status() != psutil.STATUS_ZOMBIE and "--worker" in " ".join(p.cmdline())]

    pool = VerifyPool(size=1)
    try:
        warm = pool.run([{"op": "verify", "pred": "\\sqrt{4}", "gold": "2", "timeout": 2}], deadline_s=30)
        assert warm[0]["verdict"] is True
        (original,) = [w["proc"].pid for w in pool._workers]
        requests = [{"op": "sleep", "seconds": 300},
                    {"op": "verify", "pred": "\\frac{1}{2}", "gold": "0.5", "timeout": 2}]
        answers = pool.run(requests, deadline_s=1.5)
        assert answers[0] is None                      # the hung item gets no answer ...
        assert answers[1]["verdict"] is True           # ... and the batch goes on with a new worker
        assert pool.killed == 1
        (replacement,) = [w["proc"].pid for w in pool._workers]
        assert replacement != original and original not in live_workers()
        again = pool.run([{"op": "verify", "pred": "x + x", "gold": "2x", "timeout": 2}], deadline_s=30)
        assert again[0]["verdict"] is True
        assert [w["proc"].pid for w in pool._workers] == [replacement]    # reused across calls
    finally:
        pool.close()
    assert replacement not in live_workers()


def test_timed_out_item_with_sound_gold_scores_zero(monkeypatch):
    """A worker killed on the deadline: 0 when the gold parses on its own (the prediction was at fault)."""
    real_run = VerifyPool.run

    def first_batch_hangs(self, requests, deadline_s):
        if requests and requests[0].get("op") == "verify":
            requests = [{"op": "sleep", "seconds": 300} for _ in requests]
            deadline_s = 0.5
        return real_run(self, requests, deadline_s)

    monkeypatch.setattr(VerifyPool, "run", first_batch_hangs)
    rows = [{"answer": "\\sqrt{8}"}, {"answer": "garbage{{"}]
    assert math_reward(["\\boxed{2\\sqrt{2}}", "\\boxed{1}"], rows=rows, workers=2) == [0.0, None]


# ---------------------------------------------------------------------------------------------
# Shipped word problems

def load_make_data():
    spec = importlib.util.spec_from_file_location("make_data", ROOT / "scripts" / "make_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_word_problems_file_matches_its_generator_and_scores():
    make_data = load_make_data()
    text = (ROOT / "data" / "word_problems.jsonl").read_text(encoding="utf-8")
    assert text == make_data.render(make_data.word_problems())
    rows = [json.loads(line) for line in text.splitlines()]
    assert len(rows) >= 200 and len({r["prompt"] for r in rows}) == len(rows)
    assert all(r["answer"].lstrip("-").isdigit() for r in rows)
    # the worked solutions agree with the answers, and an off-by-one answer never does
    assert math_reward([r["solution"] for r in rows], rows=rows) == [1.0] * len(rows)
    assert math_reward([f"#### {int(r['answer']) + 1}" for r in rows], rows=rows) == [0.0] * len(rows)


def test_scientific_notation_missing_golds_one_letter_variables_and_markdown():
    """Found by a red team: math-verify read the e of 1e-07 (str() of a float column) as Euler's number, so 'e-7'
    scored 1.0 and 0.0000001 0.0; a NaN gold (pandas' missing answer) read as a*n*n, scored 0 everywhere and 1
    for 'n^2 a'; a one-letter word after a gold number was taken for a unit, so '2' and '2b' matched gold '2a';
    a Markdown heading '#### Final Answer' was read as GSM8K's marker, and '**42**' failed; an equation whose
    left side is no name ('6 = 5') passed for 5."""
    def score(completion, gold):
        return math_reward([completion], rows=[{"answer": gold}], workers=0, timeout=2)[0]

    cases = [(r"\boxed{0.0000001}", 1e-07, 1.0), (r"\boxed{e-7}", 1e-07, 0.0), (r"\boxed{1500}", "1.5e3", 1.0),
             (r"\boxed{4.5e}", "1.5e3", 0.0), (r"\boxed{1.5e3}", "1500", 1.0), (r"\boxed{1e-2}", "0.01", 1.0),
             (r"\boxed{42}", float("nan"), None), (r"\boxed{n^2 a}", float("nan"), None), (r"\boxed{nan}", "nan", None),
             (r"\boxed{2}", "2a", 0.0), (r"\boxed{2b}", "2a", 0.0), (r"\boxed{2a}", "2a", 1.0),
             (r"\boxed{5 \text{ cm}}", "5", 1.0),
             ("#### Final Answer\nThe total is 42.", "42", 1.0), ("#### **42**", "42", 1.0),
             ("<answer>**42**</answer>", "42", 1.0),
             # math-verify compared an equation's right side only: '6 = 5' passed for 5
             (r"\boxed{6 = 5}", "5", 0.0), (r"\boxed{x = 6 = 5}", "5", 0.0), (r"\boxed{x = 5}", "5", 1.0),
             (r"\boxed{a_{1} = 5}", "5", 1.0), (r"\boxed{\theta = \frac{\pi}{2}}", r"\frac{\pi}{2}", 1.0),
             (r"\boxed{y = 2x + 1}", "y = 2x + 1", 1.0)]
    got = [score(c, g) for c, g, _ in cases]
    wrong = [(c, g, want, have) for (c, g, want), have in zip(cases, got) if want is not None and have != want]
    assert not wrong, wrong
    assert got[6] is None and got[7] is None and got[8] is None   # no gold: skipped, never 0 or 1
    assert mr._numeric("5 thirds") is None and as_number("1.5e3") == 1500 and as_number("2e") is None


# ---------------------------------------------------------------------------------------------
# Red team, second round: each case scored the other way before its fix

def _score(completion, gold, **kw):
    return math_reward([completion], rows=[{"answer": gold}], workers=0, timeout=3, **kw)[0]


def _wrong(cases, **kw):
    got = [_score(c, g, **kw) for c, g, _ in cases]
    return [(c, g, want, have) for (c, g, want), have in zip(cases, got) if have != want]


def test_words_after_a_number_are_units_or_make_it_another_value():
    """F3: '2p' passed for gold 2 (the p read as a unit), and '3 \\text{ tens}' for 3 (math-verify drops \\text{}).
    The word right after a number is a variable when it is one letter (bar a unit symbol set apart: '2 m') or letters
    glued to it (bar a unit abbreviation: '5cm'); value words are never units; the same rule reads the gold answer."""
    cases = [(r"\boxed{2p}", "2", 0.0), (r"\boxed{2 p}", "2", 0.0), (r"\boxed{2 \text{p}}", "2", 0.0),
             (r"\boxed{3 \text{ tens}}", "3", 0.0), (r"\boxed{5 \text{ thirds}}", "5", 0.0),
             (r"\boxed{5 \text{ squared}}", "5", 0.0), (r"\boxed{5 \text{ thousand}}", "5", 0.0),
             ("<answer>3 tens</answer>", "3", 0.0), (r"\boxed{2ab}", "2", 0.0), (r"\boxed{5m}", "5", 0.0),
             (r"\boxed{5 M}", "5", 0.0), (r"\boxed{2e}", "2", 0.0),
             # past the exact path, math-verify dropped them too: kept in parentheses for it
             (r"\boxed{\frac{1}{2} \text{ tens}}", r"\frac12", 0.0), (r"\boxed{\frac{1}{2}t}", r"\frac12", 0.0),
             (r"\boxed{\sqrt{2}m}", r"\sqrt2", 0.0), (r"\boxed{\frac{1}{2} \text{ hour}}", r"\frac12", 1.0),
             (r"\boxed{4\sqrt{2}\text{ cm}}", r"4\sqrt2", 1.0), (r"\boxed{\frac{t}{2}}", r"\frac12t", 1.0),
             # the gold side: '2ab' and '2t' are products (math-verify read 2 for both: 't' is one of its units)
             (r"\boxed{2}", "2ab", 0.0), (r"\boxed{2}", "2t", 0.0), (r"\boxed{2s}", "2t", 0.0),
             (r"\boxed{2ab}", "2ab", 1.0), (r"\boxed{2ba}", "2ab", 1.0), (r"\boxed{2x}", "2x", 1.0),
             (r"\boxed{2 x}", "2x", 1.0), (r"\boxed{2y}", "2x", 0.0),
             # real units still pass
             (r"\boxed{2 m}", "2", 1.0), (r"\boxed{2 \text{ m}}", "2", 1.0), (r"\boxed{2\,\mathrm{s}}", "2", 1.0),
             (r"\boxed{5 cm}", "5", 1.0), (r"\boxed{5cm}", "5", 1.0), (r"\boxed{5 \text{ m/s}}", "5", 1.0),
             (r"\boxed{\$5}", "5", 1.0), (r"\boxed{5\%}", "5", 1.0), (r"\boxed{3 \text{ apples}}", "3", 1.0),
             (r"\boxed{3rd}", "3", 1.0), ("<answer>12 in total</answer>", "12", 1.0),
             ("<answer>5 apples a day</answer>", "5", 1.0)]
    assert not _wrong(cases)


def test_a_markdown_heading_after_hashes_is_no_answer():
    """F4: '#### Step 1: add the numbers' was read as GSM8K's marker, so 1 was the answer. '####' followed by words
    (or a numbered title, '1. Add') is a heading, passed over; the last '####' that holds an answer counts."""
    text = "#### Step 1: add the numbers\n3 + 4 = 7, so the answer is 7."
    cases = [(text, "7", 1.0), (text, "1", 0.0),
             ("#### 1. Add the numbers\n3 + 4 = 7", "7", 1.0), ("#### **Step 1**\n3 + 4 = 7", "7", 1.0),
             ("##### Step 5\nso 7", "7", 1.0), ("#### 7\n#### Check: 3 + 4 = 7, fine", "7", 1.0),
             ("#### 42", "42", 1.0), ("####42", "42", 1.0), ("#### $1,080", "1080", 1.0), ("#### -5", "-5", 1.0),
             ("#### **42**", "42", 1.0), ("#### 5 apples", "5", 1.0), ("#### x = 5", "5", 1.0), ("#### 3.5", "3.5", 1.0)]
    assert not _wrong(cases)
    both = "#### Step 1: add the numbers\n3 + 4 = 7\n\\boxed{7}"
    assert extract_answer(both, ("hashes", "boxed")) == "7"
    assert _score(both, "7", extract="hashes,boxed") == 1.0 and _score(both, "1", extract="hashes,boxed") == 0.0


def test_an_equation_names_the_answer_on_either_side():
    """F5: against a gold answer that is no equation, 'x = 5' passed and '5 = x' failed. A name on either side of
    the single '=' counts the same; a constant or an operation names nothing ('\\pi = 3', '\\frac{1}{2} = 5')."""
    cases = [(r"\boxed{5 = x}", "5", 1.0), (r"\boxed{x = 5}", "5", 1.0), (r"\boxed{5 = f(2)}", "5", 1.0),
             (r"\boxed{5 = a_{1}}", "5", 1.0), (r"\boxed{5 = AB}", "5", 1.0),
             (r"\boxed{\frac{\pi}{2} = \theta}", r"\frac{\pi}{2}", 1.0), (r"\boxed{2x + 3 = y}", "2x+3", 1.0),
             (r"\boxed{5 = 6}", "5", 0.0), (r"\boxed{6 = 5}", "5", 0.0), (r"\boxed{5 = 5}", "5", 0.0),
             (r"\boxed{x = 5 = 6}", "5", 0.0), (r"\boxed{6 = x}", "5", 0.0), (r"\boxed{x = y}", "5", 0.0),
             (r"\boxed{y = 5x}", "5", 0.0), (r"\boxed{2x+3 = 5}", "5", 0.0), (r"\boxed{\pi = 3}", "3", 0.0),
             (r"\boxed{\frac{1}{2} = 5}", "5", 0.0), (r"\boxed{\sqrt{4} = 5}", "5", 0.0)]
    assert not _wrong(cases)


def test_decimals_are_exact_values():
    """F6: math-verify rounds floats to 6 places, so 0.866025 passed for sqrt(3)/2 while 0.333333 failed for 1/3.
    A decimal is the rational number it writes: its value passes, an approximation does not."""
    cases = [(r"\boxed{0.866025}", r"\frac{\sqrt3}{2}", 0.0), (r"\boxed{0.333333}", r"\frac13", 0.0),
             (r"\boxed{3.141593}", r"\pi", 0.0), (r"\boxed{\approx 0.866025}", r"\frac{\sqrt3}{2}", 0.0),
             (r"\boxed{(0.5, 1.26]}", r"(\frac12, \frac54]", 0.0), (r"\boxed{\frac{\sqrt3}{2}}", "0.866025", 0.0),
             (r"\boxed{0.5}", r"\frac12", 1.0), (r"\boxed{0.25}", "1/4", 1.0), (r"\boxed{2.50}", r"\frac52", 1.0),
             (r"\boxed{0.5\sqrt{3}}", r"\frac{\sqrt3}{2}", 1.0), (r"\boxed{1.5\sqrt{2}}", r"\frac{3\sqrt2}{2}", 1.0),
             (r"\boxed{(0.5, 1.25]}", r"(\frac12, \frac54]", 1.0), (r"\boxed{x^{0.5}}", r"\sqrt{x}", 1.0),
             (r"\boxed{0.5}", r"\sin(\frac{\pi}{6})", 1.0), (r"\boxed{50\%}", r"\frac{1}{2}", 1.0)]
    assert not _wrong(cases)


def test_the_final_answer_after_the_reasoning_wins():
    """F7: a \\boxed{} draft inside <think>...</think> beat the final <answer>. After a closing </think> only what
    follows is read (a boxed answer inside <answer> still counts); without </think> the whole text is."""
    cases = [("<think>try \\boxed{3}</think>\n<answer>4</answer>", "4", 1.0),
             ("<think>try \\boxed{3}</think>\n<answer>4</answer>", "3", 0.0),
             ("<THINK>\\boxed{3}</THINK><answer>4</answer>", "4", 1.0),
             ("<think>\\boxed{3}</think><answer>\\boxed{4}</answer>", "4", 1.0),
             ("<think>so 3</think>\nThe answer is \\boxed{4}.", "4", 1.0),
             ("<think>\\boxed{4}</think>", "4", 0.0),                       # nothing after the reasoning
             ("<think>still thinking... \\boxed{3}", "3", 1.0)]               # no </think>: the whole text
    assert not _wrong(cases)
    assert extract_answer("<think>\\boxed{3}</think>#### 4\n", ("boxed", "hashes")) == "4"


# ---------------------------------------------------------------------------------------------
# Variables set apart from a number; degrees inside trigonometric functions

def test_two_lowercase_letters_set_apart_from_a_number_are_a_product():
    """'2 xy' was read as the number 2 and a unit word: it passed for gold 2, '2' passed for gold '2 xy', and '2xy'
    failed it. Two lowercase letters set apart from a number are variables, unless they are a unit abbreviation or a
    short English word ('5 cm', '12 in total'); longer words stay units."""
    cases = [(r"\boxed{2 xy}", "2", 0.0), (r"\boxed{2}", "2 xy", 0.0), (r"\boxed{2 ab}", "2", 0.0),
             (r"\boxed{2 \text{ xy}}", "2", 0.0), ("#### 2 xy", "2", 0.0), (r"\boxed{3 xy}", "2 xy", 0.0),
             (r"\boxed{\frac{1}{2} xy}", r"\frac12", 0.0),
             (r"\boxed{2xy}", "2 xy", 1.0), (r"\boxed{2 xy}", "2xy", 1.0), (r"\boxed{2 xy}", "2*x*y", 1.0),
             (r"\boxed{2*x*y}", "2 xy", 1.0), (r"\boxed{2 yx}", "2 xy", 1.0),
             # units and short words still go
             (r"\boxed{5 cm}", "5", 1.0), (r"\boxed{3 ft}", "3", 1.0), (r"\boxed{5 \text{ km}}", "5", 1.0),
             (r"\boxed{12 in}", "12", 1.0), ("<answer>12 in total</answer>", "12", 1.0), ("#### 7 pm", "7", 1.0),
             (r"\boxed{12 dollars}", "12", 1.0), (r"\boxed{3 apples}", "3", 1.0), (r"\boxed{2 m}", "2", 1.0)]
    assert not _wrong(cases)
    assert as_number("2 xy") is None and as_number("2 ab") is None and as_number("5 cm") == as_number("5 oz") == 5


def test_more_letters_without_a_vowel_set_apart_from_a_number_are_a_product():
    """'2 xyz' passed for gold 2 (a unit word): letters no vowel makes a word are variables; a word ('3 abc', which
    may count something) and a unit abbreviation without a vowel ('3 hrs', '4 lbs') are still units."""
    cases = [(r"\boxed{2 xyz}", "2", 0.0), (r"\boxed{2}", "2 xyz", 0.0), (r"\boxed{2 xyz}", "2xyz", 1.0),
             (r"\boxed{2xyz}", "2 x y z", 1.0), (r"\boxed{3 hrs}", "3", 1.0), (r"\boxed{4 lbs}", "4", 1.0),
             (r"\boxed{60 mph}", "60", 1.0), (r"\boxed{3 abc}", "3", 1.0), (r"\boxed{5 cats}", "5", 1.0),
             (r"\boxed{10 yrs}", "10", 1.0), (r"\boxed{2 tsp}", "2", 1.0), (r"\boxed{3 wks}", "3", 1.0),
             (r"\boxed{12 pts}", "12", 1.0)]
    assert not _wrong(cases)
    assert as_number("2 xyz") is None and as_number("3 hrs") == 3


BARE_FUNCTIONS = [
    (r"\boxed{sin 30°}", r"\frac{1}{2}", 1.0), (r"\boxed{cos 60^\circ}", "0.5", 1.0), (r"\boxed{sin(30°)}", "0.5", 1.0),
    (r"\boxed{sin x}", r"\sin x", 1.0), (r"\boxed{\cos(x)}", "cos(x)", 1.0), (r"\boxed{ln 1}", "0", 1.0),
    (r"\boxed{sin^2 x + cos^2 x}", "1", 1.0), (r"\boxed{arctan 1}", r"\frac{\pi}{4}", 1.0),
    (r"\boxed{sin 30}", r"\frac12", 0.0), (r"\boxed{sin x}", r"\cos x", 0.0), (r"\boxed{cosine}", "1", 0.0)]


def test_a_function_name_without_its_backslash_is_that_function():
    """'sin 30°' failed for 1/2 and 'sin x' for '\\sin x': without its backslash math-verify read the name as a
    product of variables. Written bare, a function name is the function, on both sides; words that contain one
    ('cosine') are left alone."""
    assert not _wrong(BARE_FUNCTIONS)


TRIG_DEGREES = [
    (r"\boxed{0.5}", r"\sin 30^\circ", 1.0), (r"\boxed{\frac{1}{2}}", r"\sin(30^{\circ})", 1.0),
    (r"\boxed{1/2}", r"\cos 60°", 1.0), (r"\boxed{1}", r"\tan 45^\circ", 1.0),
    (r"\boxed{\sqrt3}", r"\tan 60^\circ", 1.0), (r"\boxed{\sin 30^\circ}", "0.5", 1.0),
    (r"\boxed{\sin 30^\circ}", r"\cos 60^\circ", 1.0), (r"\boxed{\frac14}", r"\sin^{2}(30^{\circ})", 1.0),
    (r"\boxed{\frac12}", r"\cos\left(90^\circ - 30^\circ\right)", 1.0),
    (r"\boxed{-\frac12}", r"\sin(-30^\circ)", 1.0), (r"\boxed{0.5}", r"\sin{30 \degree}", 1.0),
    (r"\boxed{1}", r"\sin^2 30^\circ + \cos^2 30^\circ", 1.0),
    # wrong values, and radians are no degrees
    (r"\boxed{0.6}", r"\sin 30^\circ", 0.0), (r"\boxed{\frac{\sqrt3}{2}}", r"\sin 30^\circ", 0.0),
    (r"\boxed{0.342}", r"\sin 20^\circ", 0.0), (r"\boxed{\sin 30}", r"\sin 30^\circ", 0.0),
    (r"\boxed{0.5}", r"\sin(30)", 0.0),
    # a degree mark outside a trigonometric function is still dropped: an angle is its number
    (r"\boxed{30^\circ}", "30", 1.0), (r"\boxed{30}", r"30^\circ", 1.0), (r"\boxed{31^\circ}", "30", 0.0)]


def test_degrees_inside_a_trigonometric_function_are_radians():
    """math-verify drops the degree mark, so '\\sin 30^\\circ' was sin(30 radians) and 0.5 failed it. Inside a
    trigonometric function's argument a degree is pi/180, on both sides; inline and in the worker pool alike."""
    assert not _wrong(TRIG_DEGREES)
    completions, rows = [c for c, _, _ in TRIG_DEGREES], [{"answer": g} for _, g, _ in TRIG_DEGREES]
    assert math_reward(completions, rows=rows, workers=2, timeout=3) == [s for _, _, s in TRIG_DEGREES]
    # unbalanced or repeated functions: left as they are, in linear time
    junk = "\\sin(" * 20000 + "30^\\circ"
    assert mr._trig_degrees(junk) == junk
    assert mr._trig_degrees("\\sin " * 20000 + "30^\\circ").endswith("\\sin (\\frac{30\\pi}{180})")
