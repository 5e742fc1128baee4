"""The built-in rewards and their options: one typed schema per built-in, declared once.

A recipe's `rewards.functions[].kwargs` for a built-in are checked against its schema when the recipe is
validated (recipe.py calls `option_problems`), again when `Rewards` loads them, and the README's reward
options table is generated from these schemas (scripts/gen_recipe_reference.py).

The reference answer is not an option of any reward: `math` and `exact` read the row field named by
data.answer_field, which `Rewards(..., answer_field=)` passes to them, so a recipe names it once. Likewise
`overlong` is passed each completion's token ids (completion_ids=) and generation.max_new_tokens
(max_new_tokens=), with an environment environment.max_total_tokens too (max_total_tokens=), by the trainer: none
is an option (the Builtin flags below say who gets what).

A new built-in: its function, its options schema here and its BUILTINS entry (a check against the completion budget
is its budget_problem); tests/test_reward_options.py::test_every_builtin_has_a_case then asks for its cases in
MISSPELT and ILL_TYPED; the README's options table is regenerated (scripts/gen_recipe_reference.py --write).

This module stays light (pydantic and the standard library; the reward modules it reads defaults from
import nothing heavier at module level), so validating a recipe does not import torch or math-verify.
"""

from __future__ import annotations

import re
import types
from math import isfinite
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from . import code as _code
from . import code_io as _code_io
from . import math as _math
from . import shaping as _shaping
from .format import DEFAULT_PATTERN
from .sandbox import SandboxLimits


class _Options(BaseModel):
    # extra="forbid": a misspelt option is an error, not a silently ignored default.
    model_config = ConfigDict(extra="forbid", frozen=True)


class MathOptions(_Options):
    extract: Union[list[str], str] = Field(
        list(_math.DEFAULT_EXTRACT), description="Answer extractors, tried in order (a list, or a comma-separated "
        f"string); the first that finds an answer wins. Allowed: {', '.join(_math.EXTRACTORS)}.")
    timeout: float = Field(float(_math.TIMEOUT_S), gt=0, description="Seconds per math-verify parse or comparison (rounded up to whole seconds).")
    workers: int = Field(_math.DEFAULT_WORKERS, ge=0, description="math-verify worker processes; 0: inline in the main thread.")

    @field_validator("extract")
    @classmethod
    def _known_extractors(cls, value):
        try:
            _math._extract_order(value)
        except ValueError as exc:   # it names the unknown extractors and the allowed ones
            raise ValueError(str(exc).removeprefix("math reward: ")) from None
        return value


class FormatOptions(_Options):
    pattern: str = Field(DEFAULT_PATTERN, description="Regular expression (DOTALL) found anywhere in the completion "
                         "for 1.0 (anchor it with ^...$ for a whole match); the default accepts a bare integer. A match "
                         "that runs past 1 s (catastrophic backtracking) skips the completion, with a warning.")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        import regex   # what format_reward matches with (for its timeout); here only: this module stays light

        try:
            re.compile(value, re.DOTALL)
            regex.compile(value, regex.DOTALL)
        except (re.error, regex.error) as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return value


class ExactOptions(_Options):
    """No options: the completion is compared with the row's data.answer_field."""


class CountdownOptions(_Options):
    use_all: bool = Field(False, description="Require every number of the row exactly once (the TinyZero rule); "
                          "false: each at most once.")
    numbers_field: str = Field("numbers", description="Row field holding the list of numbers.")
    target_field: str = Field("target", description="Row field holding the target number.")


class _SandboxedOptions(SandboxLimits):
    """What every reward running model-written code takes, then every sandbox limit (SandboxLimits)."""

    workers: int = Field(_code.DEFAULT_WORKERS, ge=1, description="Completions run in parallel (one sandboxed program each).")
    allow_weak_sandbox: bool = Field(
        False, description="Run model-written code even where the sandbox lacks full isolation (namespaces, minimal "
        "root, uid drop; docs/sandbox.md); false: the reward refuses to start there, naming what is missing.")


class CodeOptions(_SandboxedOptions):
    """The code rewards' own options, then the sandboxed rewards' (workers, allow_weak_sandbox, every limit)."""

    tests_field: str = Field("tests", description="Row field holding the tests: a list of Python statements "
                             "(usually asserts), or a JSON string of one.")
    timeout: float = Field(_code.DEFAULT_TEST_TIMEOUT_S, gt=0, description="Seconds allowed for the solution's top level and for each test: wall-clock time less the time the program waited for a CPU (a loaded machine), up to 3x (code.LOAD_ALLOWANCE).")
    total_timeout: Optional[float] = Field(
        None, gt=0, description="Wall-clock seconds for one completion's whole program; null: 3 * timeout * (tests + 1) + 2 (code.LOAD_ALLOWANCE).")


class CodeIOOptions(_SandboxedOptions):
    """The stdin/stdout code rewards' own options, then the sandboxed rewards'."""

    tests_field: str = Field("tests", description="Row field holding the input/output cases: {inputs, outputs} or "
                             "{input, output} lists, a list of {input, output} mappings, {test_cases: [...]}, or a "
                             "JSON string of one; function-call cases: APPS/TACO's {fn_name, inputs, outputs}, "
                             "LiveCodeBench's functional cases (rewards/code_io.py).")
    timeout: float = Field(_code.DEFAULT_TEST_TIMEOUT_S, gt=0, description="Seconds allowed for one run of the program on one case.")
    float_tolerance: float = Field(_code_io.DEFAULT_FLOAT_TOLERANCE, ge=0, description="Two numbers match within this "
                                   "(relative, or absolute below 1) where the expected one has a decimal point or an "
                                   "exponent; 0: tokens must be equal.")
    max_cases: Optional[int] = Field(None, ge=1, description="Run at most this many of a row's cases (the first "
                                     "ones); null: all.")
    checker_field: Optional[str] = Field(
        None, description="Row field holding the problem's checker (a special judge, Python source; null or empty in "
        "a row: the plain comparison), run in a sandbox of its own on each output that is not the expected one: "
        "`checker.py input.txt correct_output.txt solution_output.txt`, accepting by exit 0 with no output, or a "
        "whole stdout of 'ok' / 'accepted' / 'yes' ... or a score of 1 (rewards/code_io.py); null: no checker.")
    checker_timeout: float = Field(_code_io.DEFAULT_CHECKER_TIMEOUT_S, gt=0,
                                   description="Seconds allowed for one run of the checker.")

    @field_validator("float_tolerance")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not isfinite(value):
            raise ValueError(f"float_tolerance must be a finite number, got {value!r}")
        return value


class OverlongOptions(_Options):
    """DAPO's soft overlong punishment (Yu et al. 2025, §3.4): L_max is max_length, L_cache is buffer."""

    max_length: Optional[int] = Field(
        None, ge=1, description="L_max, in tokens: past it a completion scores -1; null: generation.max_new_tokens "
        "(a completion cut there has exactly L_max tokens, so it gets its -1 from the buffer's last token). With an "
        "environment a completion's length is its whole episode's (model and environment tokens), and null is "
        "environment.max_total_tokens, the limit on those.")
    buffer: Optional[int] = Field(
        None, ge=0, description="L_cache, in tokens: the score falls linearly from 0 to -1 over the last buffer "
        f"tokens before L_max; must be less than max_length; null: L_max // {_shaping.BUFFER_DIVISOR} (DAPO: 4096 of 20480).")

    @field_validator("buffer")
    @classmethod
    def _below_max_length(cls, value: Optional[int], info: ValidationInfo) -> Optional[int]:
        # with a null max_length the bound is generation.max_new_tokens, known only when the reward is called
        max_length = info.data.get("max_length")
        if value is not None and max_length is not None and value >= max_length:
            raise ValueError(f"buffer must be less than max_length ({max_length}), got {value}")
        return value


class ThinkFormatOptions(_Options):
    think_tag: str = Field(_shaping.DEFAULT_THINK_TAG, description="Tag of the reasoning block, which comes first "
                           "(`<think>...</think>` by default); 1.0 needs each tag exactly once. A think block that "
                           "the prompt ends in (a chat template that opens it, or writes it empty) counts as the "
                           "completion's.")
    # validate_default: a think_tag set to 'answer' must clash with the default answer_tag too
    answer_tag: str = Field(_shaping.DEFAULT_ANSWER_TAG, validate_default=True, description="Tag of the answer block "
                            "(`<answer>...</answer>` by default), which must follow the reasoning block with nothing "
                            "but whitespace around and between them.")

    @field_validator("think_tag", "answer_tag")
    @classmethod
    def _tag_name(cls, value: str, info: ValidationInfo) -> str:
        _shaping.check_tag_name(info.field_name, value)
        if info.field_name == "answer_tag" and value == info.data.get("think_tag"):
            raise ValueError(f"answer_tag must differ from think_tag, got {value!r} for both")
        return value


class RepetitionOptions(_Options):
    ngram: int = Field(_shaping.DEFAULT_NGRAM, ge=1, description="n of the word n-grams counted (words split on "
                       "whitespace); a completion of fewer than n words scores 0.")
    max_penalty: float = Field(_shaping.DEFAULT_MAX_PENALTY, gt=0, description="The score is -max_penalty * "
                               "(1 - distinct / total n-grams), in [-max_penalty, 0] (near -max_penalty for one n-gram repeated "
                               "throughout).")

    @field_validator("max_penalty")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not isfinite(value):   # gt=0 already refuses nan; inf would make a completion without repeats nan
            raise ValueError(f"max_penalty must be a finite number, got {value!r}")
        return value


def overlong_reach_problem(kwargs: dict, longest: int, longest_key: str) -> Optional[tuple[str, str]]:
    """(option, message) when `overlong` with these options (valid on their own) cannot punish a completion of at
    most `longest` tokens, which recipe key `longest_key` sets (generation.max_new_tokens, or with an environment
    environment.max_total_tokens): a buffer as long as a null max_length, or a ramp that starts at `longest` or past
    it, so that every completion scores 0 (found by a red team: max_length 4096, buffer 512 and max_new_tokens 1024
    validated, and the reward never moved). None when it can punish some completion."""
    max_length, buffer = kwargs.get("max_length"), kwargs.get("buffer")
    if not isinstance(max_length, (int, type(None))) or not isinstance(buffer, (int, type(None))):
        return None   # (option_problems said so)
    limit = longest if max_length is None else max_length
    if buffer is not None and buffer >= limit:   # (with a null max_length: its own check cannot see the bound)
        return "buffer", f"must be less than max_length, here {longest_key} ({longest}), got {buffer}"
    cache = limit // _shaping.BUFFER_DIVISOR if buffer is None else buffer
    if limit - cache < longest:
        return None
    null = f" (null buffer: max_length // {_shaping.BUFFER_DIVISOR})" if buffer is None else ""
    return ("max_length" if max_length is not None else "buffer",
            f"reward 'overlong' punishes only a completion longer than max_length - buffer = {limit} - {cache} = "
            f"{limit - cache} tokens{null}, and none is longer than {longest_key} ({longest}): it would score 0 every "
            f"time; lower max_length (null: {longest_key}) or raise buffer")


@dataclass(frozen=True)
class Builtin:
    function: str                 # 'module:function' of the implementation
    options: type[BaseModel]      # the schema of its recipe kwargs
    reads_answer: bool = False    # called with answer_field=data.answer_field
    startup: Optional[str] = None  # 'module:function' called with the kwargs when loaded: lines to log; raises to refuse
    reads_completion_ids: bool = False  # called with completion_ids= (each completion's token id list)
    # called with max_new_tokens=generation.max_new_tokens, and with an environment on also with
    # max_total_tokens=environment.max_total_tokens
    reads_max_new_tokens: bool = False
    # (kwargs, longest, longest_key) -> (option, problem) or None: a check against the completion budget, which the
    # recipe runs (Recipe's cross-section checks) with generation.max_new_tokens, or environment.max_total_tokens
    budget_problem: Optional[Callable[[dict, int, str], Optional[tuple[str, str]]]] = None


BUILTINS: dict[str, Builtin] = {
    "math": Builtin("lowmem_grpo.rewards.math:math_reward", MathOptions, reads_answer=True),
    "format": Builtin("lowmem_grpo.rewards.format:format_reward", FormatOptions),
    "exact": Builtin("lowmem_grpo.rewards.format:exact_reward", ExactOptions, reads_answer=True),
    "code": Builtin("lowmem_grpo.rewards.code:code_reward", CodeOptions, startup="lowmem_grpo.rewards.code:startup_report"),
    "code_binary": Builtin("lowmem_grpo.rewards.code:code_binary_reward", CodeOptions,
                           startup="lowmem_grpo.rewards.code:startup_report"),
    "code_io": Builtin("lowmem_grpo.rewards.code_io:code_io_reward", CodeIOOptions,
                       startup="lowmem_grpo.rewards.code_io:startup_report"),
    "code_io_binary": Builtin("lowmem_grpo.rewards.code_io:code_io_binary_reward", CodeIOOptions,
                              startup="lowmem_grpo.rewards.code_io:startup_report"),
    "countdown": Builtin("lowmem_grpo.rewards.countdown:countdown_reward", CountdownOptions),
    # shaping rewards (rewards/shaping.py): to follow a correctness reward, never to be the first function
    "overlong": Builtin("lowmem_grpo.rewards.shaping:overlong_reward", OverlongOptions,
                        reads_completion_ids=True, reads_max_new_tokens=True,
                        budget_problem=overlong_reach_problem),
    "think_format": Builtin("lowmem_grpo.rewards.shaping:think_format_reward", ThinkFormatOptions),
    "repetition": Builtin("lowmem_grpo.rewards.shaping:repetition_reward", RepetitionOptions),
}

# What the trainer passes to the built-ins flagged for it, so never a recipe option:
# keyword -> (Builtin flag, why a reward that gets it refuses it as an option).
PASSED_BY_TRAINER = {
    "answer_field": ("reads_answer", "reads the reference answer from the row field data.answer_field: "
                                     "set it there, not in this reward's kwargs"),
    "completion_ids": ("reads_completion_ids", "is passed completion_ids (each completion's token ids) by the "
                                               "trainer: it is not an option"),
    "max_new_tokens": ("reads_max_new_tokens", "is passed max_new_tokens by the trainer (generation.max_new_tokens): "
                                               "set it there, not in this reward's kwargs"),
    "max_total_tokens": ("reads_max_new_tokens", "is passed max_total_tokens by the trainer with an environment on "
                                                 "(environment.max_total_tokens): set it there, not in this reward's "
                                                 "kwargs"),
}


# Built-ins that judge how a completion is written, not whether it is right. "Solved" (success_rate, eval accuracy,
# pass@k) is read from the first function alone (diagnostics.solved: a score >= 1), so one of these first makes it
# wrong (found by a red team): NEVER_SOLVED never score 1 (nothing would count as solved), FORM_ONLY score 1 for
# the form alone (a well-formatted wrong answer would count). `format` alone can be a task of its own (the answer's
# form is what is trained): so it, and think_format, are refused first only before a built-in that judges answers.
NEVER_SOLVED = ("overlong", "repetition")
FORM_ONLY = ("think_format", "format")


def first_function_problem(functions: list[str], environment: bool = False) -> tuple[Optional[str], Optional[str]]:
    """(error, note) about the recipe's first reward function as the one "solved" is read from (`functions`: the
    recipe's rewards.functions[].function; `environment`: whether an environment gives rewards too, which may be
    the task's): an error for a shaping reward first where the task's reward can be listed first, a note where
    that reward may be a user function or the environment's; (None, None) when the first one can say solved."""
    if not functions or functions[0] not in NEVER_SOLVED + FORM_ONLY:
        return None, None
    first = functions[0]
    why = (f"'{first}' is a shaping reward that never scores 1, and the first function is the one \"solved\" "
           "(success_rate, eval accuracy, pass@k: a score >= 1) is read from, so nothing would count as solved"
           if first in NEVER_SOLVED else
           f"'{first}' judges the form alone, and the first function is the one \"solved\" (success_rate, eval "
           "accuracy, pass@k: a score >= 1) is read from, so a well-formatted wrong answer would count as solved")
    if first in NEVER_SOLVED:
        others = [i for i, f in enumerate(functions) if f not in NEVER_SOLVED + FORM_ONLY]
    else:   # after a form-only reward a user function may be one more shaping reward: a note, below
        others = [i for i, f in enumerate(functions) if f in BUILTINS and f not in NEVER_SOLVED + FORM_ONLY]
    if others:
        i = others[0]
        return f"{why}: list the task's reward ({functions[i]!r}, rewards.functions.{i}) first", None
    users = [i for i, f in enumerate(functions) if f not in BUILTINS]
    if users:
        return None, (f"note: rewards.functions.0: {why}; if rewards.functions.{users[0]} "
                      f"({functions[users[0]]}) is the task's reward, list it first")
    if environment:
        return None, (f"note: rewards.functions.0: {why}, not from the environment's reward (the primary reward "
                      "only with rewards.functions: [])")
    if first in NEVER_SOLVED:
        return f"{why}: list the task's reward first, then the shaping ones", None
    return None, None   # a form-only task (`format` with its pattern, think_format): its form is what "solved" means


def option_names(model: type[BaseModel]) -> list[str]:
    """The model's fields, a class's own before those it inherits (the code rewards' own options, then the
    sandboxed rewards', then the sandbox's limits)."""
    names: list[str] = []
    for cls in model.__mro__:
        names += [n for n in vars(cls).get("__annotations__", {}) if n in model.model_fields and n not in names]
    return names + [n for n in model.model_fields if n not in names]


def type_name(ann: Any) -> str:
    """A field's type as a reader writes it: 'float | None', 'list[str] | str'."""
    if ann is type(None):
        return "None"
    origin, args = get_origin(ann), get_args(ann)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(type_name(a) for a in args)}]"
    return getattr(ann, "__name__", str(ann))


def _key(key: Any) -> str:
    return key if isinstance(key, str) and key.strip() else repr(key)


def option_problems(function: str, kwargs: dict) -> list[tuple[str, str]]:
    """(option, message) for each unknown or invalid option of a built-in reward; [] for a valid set, and
    for anything that is not a built-in (a user function's kwargs are checked against its signature)."""
    spec = BUILTINS.get(function)
    if spec is None or not isinstance(kwargs, dict):
        return []
    model = spec.options
    names = option_names(model)
    allowed = f"allowed: {', '.join(names)}" if names else "it takes no options"
    problems, known = [], {}
    for key, value in kwargs.items():
        if key in PASSED_BY_TRAINER:
            flag, why = PASSED_BY_TRAINER[key]
            if getattr(spec, flag):
                problems.append((key, f"reward {function!r} {why}"))
            elif key == "answer_field":
                problems.append((key, f"unknown option of reward {function!r} (it does not read the reference "
                                      f"answer; {allowed})"))
            else:
                problems.append((key, f"unknown option of reward {function!r} ({allowed})"))
        elif key not in model.model_fields:
            problems.append((_key(key), f"unknown option of reward {function!r} ({allowed})"))
        else:
            known[key] = value
    try:
        # strict: a YAML value of the wrong type is an error, not coerced ('false' is not a bool)
        model.model_validate(known, strict=True)
    except ValidationError as exc:
        problems += _type_problems(function, model, known, exc)
    return problems


def _type_problems(function: str, model: type[BaseModel], given: dict, exc: ValidationError) -> list[tuple[str, str]]:
    errors: dict[str, list[dict]] = {}
    for err in exc.errors():
        errors.setdefault(str(err["loc"][0]), []).append(err)
    out = []
    for name, errs in errors.items():
        value = given.get(name)
        expected = type_name(model.model_fields[name].annotation)
        first = errs[0]
        ctx = first.get("ctx") or {}
        if len(errs) == 1 and first["type"] == "value_error":    # a validator's own message (regex, extractor)
            msg = str(ctx.get("error", first["msg"]))
        elif len(errs) == 1 and {"ge", "gt", "le", "lt"} & set(ctx):
            msg = f"{first['msg'][0].lower()}{first['msg'][1:]} (got {value!r})"
        else:
            msg = f"must be {expected}, got {value!r} ({type(value).__name__})"
        out.append((name, f"reward {function!r}: {msg}"))
    return out


def option_reference() -> list[tuple[str, str, str, str, str]]:
    """(rewards, option, type, default, meaning) for every built-in's options: the README table. Built-ins
    sharing a schema (code, code_binary) share their rows."""
    groups: dict[type[BaseModel], list[str]] = {}
    for name, spec in BUILTINS.items():
        groups.setdefault(spec.options, []).append(name)
    rows = []
    for model, rewards in groups.items():
        label = ", ".join(f"`{r}`" for r in rewards)
        names = option_names(model)
        if not names:
            rows.append((label, "", "", "", (model.__doc__ or "").strip()))
        for n in names:
            field = model.model_fields[n]
            default = field.default
            shown = f"'{default}'" if isinstance(default, str) else repr(default)
            rows.append((label, n, type_name(field.annotation), shown, field.description or ""))
    return rows
