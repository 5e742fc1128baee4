"""TRL's `tools=` and `environment_factory=` as an environment of this project (docs/algorithm.md §20.1).

TRL's GRPOTrainer takes tools as plain Python functions (type hints and a Google-style docstring: transformers'
`get_json_schema` makes each one's JSON schema), or an `environment_factory` whose instances have `reset(**row)`
and public methods that are the tools. `ToolCalls` runs them on this project's multi-turn machinery
(rollout/turns.py: one instance per completion, its turns, masking, limits and counters, either engine, eval):

  the prompt   rendered by the chat template with the tools' schemas (`tools=`: the recipe's
               data.chat_template_kwargs["tools"], which lowmem_grpo.trl fills in), as TRL renders it
  a model turn ends at EOS (the template's end of turn), as in TRL; its tool calls are parsed from its text:
               the Hermes/Qwen format `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (several a turn),
               or, where the tokenizer has a `response_template`, transformers' `tokenizer.parse_response`
  the answer   each call's result (str(result), as TRL converts it; an error as TRL writes one: {'error': ...}), cut
               at once to what the smaller of `max_result_tokens` and environment.observation_max_tokens (the
               trainer passes it) could keep (neither: UNCAPPED_RESULT_TOKENS's, about 1 MB), in a {"role": "tool"}
               message named for its tool (a name no
               tool has: UNKNOWN_TOOL), rendered by the chat template: the text it adds after the assistant's
               turn for those messages and the next assistant header (TRL's tool suffix), appended as environment
               tokens (`Rendered`: the template's markup, whose special tokens stay tokens, and the results as the
               template writes them, trimmed or escaped, in which text that spells one stays text), cut to
               environment.observation_max_tokens in the results alone, the markup whole
  the end      a turn without a tool call ends the episode (done); so does a tool round past `max_rounds` (TRL's
               max_tool_calling_iterations), and a turn cut at max_new_tokens (truncated; its calls are not run)

The model's call is untrusted input: malformed JSON, NaN or Infinity in the arguments, an unknown tool, missing,
unexpected or wrongly typed arguments (checked against the tool's schema; a whole number such as 2.0 for an integer
is passed as the int), a tool that raises (SystemExit too) or whose result cannot be made text, a tool that runs
past `timeout_s`, and a call left unrun because the turn's earlier calls used up that time (all the calls of one
turn share it) each become that call's error result, told to the model, and counted (counters(): tool_calls,
tool_errors; tool_timeouts: those past timeout_s), never a crashed run. The tool functions themselves are the
user's own code and run in the trainer's process, as in TRL (a hung call's thread is left behind; once MAX_HUNG of
them still run, the run stops with an EnvError naming the tools): model-written code belongs in the sandboxed
`python` environment. An `async def` tool runs to completion on its call's thread (asyncio.run).

An `environment_factory` is called once per completion (TRL keeps a pool and resets it): `reset(**row)` may return
text, appended to the prompt's last message (the episode's prompt is then those messages, rendered as the dataset's
would be); its public methods (not reset, get_reward, or names starting with _) are its tools, beside `tools`;
a `get_reward()` it defines is the episode's environment reward (final_reward: environment.reward_weight, logged as
reward/environment), read once the episode ends, as TRL scores with it; TRL-shaped reward functions get the
instance as environments[i] (for_rewards). Several environments (TRL's dict {name: factory}): each row's
`environment` names its own, reset without that field; the episode's prompt is then always its own, rendered with
that environment's tools alone (template_kwargs, over the union of all environments' tools the dataset's prompt
shows), as TRL renders each example with its environment's tools.

Reward functions see the exchange as TRL gives it to them: each observation carries its messages
(Rendered.messages), the assistant turn with its text less the calls and its tool_calls, then one tool message
per call with the tool's name and its result (rollout/turns.completion_messages).

Refused at load, naming the model and what is supported: a tokenizer without a chat template, a template that
cannot render a tool-calling conversation (user, assistant with tool_calls, tool), one whose calls are in neither
format above, and one that is not prefix-preserving (its assistant tool-call turn renders differently once a tool
message follows: the answer's text could not be told apart, TRL's own check) unless TRL has a training template for
it, which the TRL drop-in then takes, as TRL does (_with_training_template: Qwen3's and the others TRL knows). A
tool without the hints and
docstring get_json_schema needs, with a parameter a call by name cannot give (positional-only, *args), or two tools of
one name, is refused naming it.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import json
import math
import re
import sys
import time
import types
from typing import Callable, Optional, Union

from .environment import EnvError, EnvOutputError, Environment, Rendered
from .rollout.turns import cut_to_ends
from .user_code import HungCalls, import_named, importable_name

NAME = "lowmem_grpo.tool_calls:ToolCalls"   # the recipe's environment.name for it
ENVIRONMENT_FIELD = "environment"   # with several environments (TRL's dict environment_factory): a row's choice
Factories = Union[str, dict]   # environment_factory: 'module:attr', or {name: 'module:attr'} for several
DEFAULT_TIMEOUT_S = 30.0
MAX_HUNG = 16   # tool calls past their timeout whose threads still run: past this, the run stops (EnvError)
# A result's cut where no token cap is known (ToolCalls built outside the trainer without max_result_tokens: the
# trainer always passes environment.observation_max_tokens): what 8192 tokens could keep at either end, about 1 MB
# (2 x data.chars_within(8192) characters). Past any observation a completion on one gaming GPU holds, so a driver
# with a larger cap of its own is rare, yet bounded: a 20 MB result was held and rendered whole (found by a red team)
UNCAPPED_RESULT_TOKENS = 8192
UNKNOWN_TOOL = "unknown"   # the name on the answer to a call of a tool that does not exist
OPEN, CLOSE = "<tool_call>", "</tool_call>"
FORMATS = ("hermes", "response_template")
SUPPORTED = ("the Hermes/Qwen format (<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>, as the Qwen2.5, "
             "Qwen3 and Hermes templates render a call), or any format the tokenizer's response_template parses "
             "(transformers' tokenizer.parse_response: save the tokenizer with a response_template, e.g. from TRL's "
             "add_response_schema, into a copy of the model folder)")
# The probes of a template (as TRL's: distinct words, so each part of the exchange can be looked for)
_PROBE_NAME, _PROBE_KEY, _PROBE_VALUE, _PROBE_RESULT = ("probe_tool_q7x", "probe_key_k3v", "probe_value_z9w",
                                                        "probe_result_m2p")


class ToolCallError(ValueError):
    """Tools, an environment factory or a chat template that cannot be run as TRL's tools here."""


class NotPrefixPreserving(ToolCallError):
    """A chat template whose assistant tool-call turn renders differently once a tool message follows it."""


# ----------------------------------------------------------------------------------------------------
# Tools: importable names, JSON schemas
# ----------------------------------------------------------------------------------------------------

def register(objects: list, stem: str) -> list[str]:
    """Each object as 'module:attr' for a recipe: its own module and name where it is importable so (not a
    script's __main__), else an attribute of a module made for this run (as lowmem_grpo.trl registers reward
    functions)."""
    module = types.ModuleType(f"lowmem_grpo_trl_{stem}_{id(objects):x}")
    names = []
    for i, obj in enumerate(objects):
        importable = importable_name(obj)
        if importable:
            names.append(importable)
            continue
        attr = f"{stem}_{i}"
        setattr(module, attr, obj)
        names.append(f"{module.__name__}:{attr}")
    if any(n.startswith(module.__name__ + ":") for n in names):
        sys.modules[module.__name__] = module
    return names


def _load(name: str, what: str):
    _, _, obj = import_named(name, what, ToolCallError)
    if obj is None:
        raise ToolCallError(f"{what}: {name!r} names nothing (the module has no such attribute)")
    return obj


_SCHEMAS: dict = {}   # (function, bound) -> its schema: an environment's methods are described once, not per episode


def schema(fn: Callable, what: str) -> dict:
    """The tool's JSON schema, as transformers' apply_chat_template(tools=[fn]) makes it, or a ToolCallError."""
    from transformers.utils import get_json_schema

    if not callable(fn):
        raise ToolCallError(f"{what}: {fn!r} is not callable; a tool is a function with type hints and a "
                            "Google-style docstring")
    key = (getattr(fn, "__func__", fn), hasattr(fn, "__self__"))
    try:
        return copy.deepcopy(_SCHEMAS[key])
    except (KeyError, TypeError):   # (TypeError: a callable that cannot be a key)
        pass
    if problem := _unnamed_parameters(fn):
        raise ToolCallError(f"{what}: {getattr(fn, '__name__', fn)!r} {problem}")
    try:
        found = get_json_schema(fn)
        try:
            _SCHEMAS[key] = copy.deepcopy(found)
        except TypeError:
            pass
        return found
    except Exception as exc:   # DocstringParsingException, TypeHintParsingException, ...: the user's function
        raise ToolCallError(f"{what}: {getattr(fn, '__name__', fn)!r} cannot be described to the model "
                            f"({type(exc).__name__}: {exc}); a tool needs a type hint on each argument and a "
                            "Google-style docstring with an Args: line for each, as TRL (and transformers' "
                            "get_json_schema) require") from None


def _unnamed_parameters(fn: Callable) -> Optional[str]:
    """Why the model could not give `fn` an argument, or None: a call passes the arguments by name, fn(**arguments),
    as TRL calls a tool, so a positional-only parameter or *args never gets one, though the schema lists it (found by
    a red team: every call of def f(a: int, /) failed with a TypeError the model could do nothing about)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):   # no signature to read: get_json_schema says what it can
        return None
    unnamed = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL)]
    if not unnamed:
        return None
    shown = ", ".join(("*" if p.kind is p.VAR_POSITIONAL else "") + p.name for p in unnamed)
    return (f"takes {shown} by position only; a tool's arguments are passed by name (fn(**arguments)), so the model "
            "could never give them: make them ordinary (or keyword-only) parameters")


def environment_tools(instance) -> list:
    """An environment instance's tools, as TRL takes them: its class's public functions (not reset or
    get_reward), bound to it."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def _by_name(tools: list, what: str) -> dict:
    out = {}
    for fn in tools:
        name = schema(fn, what)["function"]["name"]
        if name in out:
            raise ToolCallError(f"{what}: two tools are named {name!r}; the model calls a tool by its name")
        out[name] = fn
    return out


# ----------------------------------------------------------------------------------------------------
# The chat template: which format, the tool answer's markup
# ----------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=8)
def _tokenizer(model: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception as exc:   # a folder without tokenizer files, an id not cached offline, ...
        raise ToolCallError(f"model {model!r}: cannot load its tokenizer ({type(exc).__name__}: {exc})") from None


def _end_texts(tokenizer, model: str) -> list[str]:
    """The texts of the tokens that end a model turn: EOS and the model's generation_config eos ids (as
    model.stop_token_ids)."""
    ids = [tokenizer.eos_token_id]
    try:
        from transformers import GenerationConfig

        listed = GenerationConfig.from_pretrained(model).eos_token_id
        ids += [listed] if isinstance(listed, int) else list(listed or [])
    except Exception:   # no generation_config.json: the tokenizer's EOS alone
        pass
    texts = [tokenizer.convert_ids_to_tokens(i) for i in ids if isinstance(i, int) and i >= 0]
    return [t for t in dict.fromkeys(texts) if isinstance(t, str) and t]


class ChatFormat:
    """A tokenizer's chat template as the tool calls need it: the call format, and the tool answers' markup."""

    def __init__(self, model: str, trust_remote_code: bool = False, chat_template_kwargs: Optional[dict] = None):
        self.model, self.kwargs = model, dict(chat_template_kwargs or {})
        self.tokenizer = tok = _tokenizer(model, trust_remote_code)
        self.ends = _end_texts(tok, model)
        self._prefixes: dict = {}
        where = f"model {model!r}"
        if not getattr(tok, "chat_template", None):
            raise ToolCallError(f"{where}: its tokenizer has no chat template, so tools cannot be described to it nor "
                                f"its calls read; tools need a chat model whose template renders tool calls: {SUPPORTED}")
        probe = [{"role": "user", "content": "hi"},
                 {"role": "assistant", "content": "",
                  "tool_calls": [{"type": "function", "function": {"name": _PROBE_NAME,
                                                                   "arguments": {_PROBE_KEY: _PROBE_VALUE}}}]},
                 {"role": "tool", "name": _PROBE_NAME, "content": _PROBE_RESULT}]
        try:
            rendered = self.render(probe)
        except Exception as exc:   # jinja's TemplateError: the template refuses the roles
            raise ToolCallError(f"{where}: its chat template cannot render a tool-calling conversation (user, "
                                f"assistant with tool_calls, tool): {type(exc).__name__}: {exc}; supported: a "
                                f"template that renders tool calls in {SUPPORTED}") from None
        dropped = [w for w, s in (("the call's name", _PROBE_NAME), ("its arguments", _PROBE_VALUE),
                                  ("the tool's result", _PROBE_RESULT)) if s not in rendered]
        if dropped:
            raise ToolCallError(f"{where}: its chat template does not support tool calling (it drops "
                                f"{' and '.join(dropped)} of a tool-calling conversation); supported: a template "
                                f"that renders tool calls in {SUPPORTED}")
        self.format = self._format(probe[:2], where)
        # TRL's check: the assistant's tool-call turn renders the same whether or not a tool message follows
        # (trimmed after its end of turn), so that the answer's markup is what the template adds after it
        dummy, head = self._head(_PROBE_NAME)
        full = self.render(dummy + [{"role": "tool", "name": _PROBE_NAME, "content": _PROBE_RESULT}],
                           add_generation_prompt=True)
        if not full.startswith(head):
            raise NotPrefixPreserving(
                f"{where}: its chat template is not prefix-preserving (the assistant's tool-call turn renders "
                "differently once a tool message follows it), so a tool's answer cannot be appended to the model's "
                "turn as the template would write it, and TRL has no training template for it (that of Qwen3 and "
                "others is taken, as TRL does): save a prefix-preserving template into a copy of the model folder "
                "and pass that folder, or give it as chat_template_kwargs={\"chat_template\": ...}")

    def render(self, messages: list, add_generation_prompt: bool = False, tools: Optional[list] = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  tools=tools, **{k: v for k, v in self.kwargs.items() if k != "tools"})

    def _format(self, exchange: list, where: str) -> str:
        """'response_template' where the tokenizer has one that reads the probe's call; else 'hermes' where the
        template writes the call so; else a ToolCallError naming what it writes."""
        opened = self.render(exchange[:1], add_generation_prompt=True)
        turn = self.render(exchange)
        answer = turn[len(opened):] if turn.startswith(opened) else None
        want = (_PROBE_NAME, {_PROBE_KEY: _PROBE_VALUE}, None)
        if getattr(self.tokenizer, "response_template", None) is not None and callable(
                getattr(self.tokenizer, "parse_response", None)) and answer is not None:
            if want in self._parsed_by_template(answer, opened, None):
                return "response_template"
        if want in parse_hermes(turn):
            return "hermes"
        shown = (answer if answer is not None else turn)[-200:]
        raise ToolCallError(f"{where}: its chat template writes a tool call as {shown!r}, which is not a format "
                            f"read here; supported: {SUPPORTED}")

    def generation_prefix(self) -> str:
        """The text before a first model turn, as a parser's prefix (the assistant header and what the template
        pre-writes after it)."""
        return self.render([{"role": "user", "content": "x"}], add_generation_prompt=True)

    def _head(self, name: str) -> tuple[list, str]:
        """(a dummy conversation whose assistant turn calls `name`, its text up to the end of that turn: cut after
        its last end-of-turn token, as the model's turn ends there, TRL's trimming). Kept for the first names only:
        the model names what it likes."""
        if name in self._prefixes:
            return self._prefixes[name]
        dummy = [{"role": "user", "content": "dummy"},
                 {"role": "assistant", "content": "",
                  "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}]}]
        text = self.render(dummy)
        cut = max((text.rfind(t) + len(t) for t in self.ends if t in text), default=len(text))
        if len(self._prefixes) < 64:
            self._prefixes[name] = (dummy, text[:cut])
        return dummy, text[:cut]

    def answer(self, results: list[tuple[str, str]]) -> Rendered:
        """The tool messages (name, content) as the template writes them after the assistant's turn, with the next
        assistant header: TRL's tool suffix, its contents marked as such. Only the template's markup holds special
        tokens: whatever the template does to a content, the content stays content (text)."""
        dummy, head = self._head(results[0][0])
        marks = _marks(len(results))
        markup = _markup(self._suffix(dummy, head, [(n, m) for (n, _), m in zip(results, marks)]), marks)
        real = self._suffix(dummy, head, results)
        if markup is None:   # the template drops or rewrites the marks: no markup to tell apart; all of it text
            return Rendered(["", real, ""])
        given = _interleaved(markup, [c for _, c in results])
        if given == real:
            return given
        # A template that changes the content it writes (trims it, escapes it): each content as the template writes
        # it, found by rendering it alone (found by a red team: read as markup, a trimmed tool output's <|im_end|>
        # became the real token)
        written = [self._written(n, c) for n, c in results]
        if None not in written and (shown := _interleaved(markup, written)) == real:
            return shown
        # Content that changes the markup around it: the template's markup around the contents as the tools gave them
        return given

    def _suffix(self, dummy: list, head: str, results: list) -> str:
        """What the template writes after the assistant's turn for these tool messages, with the next header."""
        text = self.render(dummy + [{"role": "tool", "name": n, "content": c} for n, c in results],
                           add_generation_prompt=True)
        if not text.startswith(head):
            raise EnvOutputError("the chat template rendered the assistant's turn differently before these tool "
                                 "results (it is not prefix-preserving for them)")
        return text[len(head):]

    def _written(self, name: str, content: str) -> Optional[str]:
        """`content` as the template writes it in a tool message of its own (trimmed, escaped), or None where the
        markup around it is not the same as around a mark."""
        dummy, head = self._head(name)
        [mark] = _marks(1)
        markup = _markup(self._suffix(dummy, head, [(name, mark)]), [mark])
        real = self._suffix(dummy, head, [(name, content)])
        if markup is None or len(real) < len(markup[0]) + len(markup[1]) \
                or not (real.startswith(markup[0]) and real.endswith(markup[1])):
            return None
        return real[len(markup[0]): len(real) - len(markup[1])]

    # -- reading a model turn's calls ----------------------------------------------------------------------

    def content(self, text: str, prefix: str) -> str:
        """A turn's text without its tool calls, as TRL's parse_response gives an assistant message's content."""
        if self.format == "response_template":
            try:
                message = self.tokenizer.parse_response(text, prefix=prefix)
                said = message.get("content") if isinstance(message, dict) else None
                return said.strip() if isinstance(said, str) else ""
            except Exception:   # the model's text; its calls' problems are told to it already
                pass
        return re.sub(re.escape(OPEN) + r".*?(" + re.escape(CLOSE) + r"|$)", "", text, flags=re.S).strip()

    def calls(self, text: str, prefix: str, schemas: list) -> list[tuple]:
        """The turn's calls as (name or None, arguments or None, problem or None), in order; [] without any."""
        if self.format == "response_template":
            return self._parsed_by_template(text, prefix, schemas)
        return parse_hermes(text)

    def _parsed_by_template(self, text: str, prefix: str, schemas: Optional[list]) -> list[tuple]:
        tok = self.tokenizer
        if self.ends and not any(text.rstrip().endswith(t) for t in self.ends):
            text += self.ends[0]   # the turn's end token, which the turn's text leaves out
        try:
            message = tok.parse_response(text, prefix=prefix, tools=schemas)
        except Exception as exc:   # the model's text: whatever the parser raises on it is that turn's call error
            return [(None, None, f"the tool calls cannot be parsed: {type(exc).__name__}: {exc}")]
        found = message.get("tool_calls") if isinstance(message, dict) else None
        if not found:
            return []
        if not isinstance(found, list):
            return [(None, None, "the tool calls cannot be parsed: the parser gave no list of calls")]
        return [_checked_call(c.get("function", c) if isinstance(c, dict) else c) for c in found]


def _marks(n: int) -> list[str]:
    """Stand-ins for n tool results, to find the template's markup around them (no tool's name: names are the
    known tools' or UNKNOWN_TOOL)."""
    return [f"@@lowmem-tool-result-{i}@@" for i in range(n)]


def _markup(rendered: str, marks: list[str]) -> Optional[list[str]]:
    """The text around the marks, in order (len(marks) + 1 pieces), or None where one is missing."""
    pieces, rest = [], rendered
    for mark in marks:
        before, found, rest = rest.partition(mark)
        if not found:
            return None
        pieces.append(before)
    return pieces + [rest]


def _interleaved(markup: list[str], contents: list[str]) -> Rendered:
    return Rendered([p for pair in zip(markup, contents) for p in pair] + [markup[-1]])


def parse_hermes(text: str) -> list[tuple]:
    """The `<tool_call>JSON</tool_call>` blocks of a turn as (name or None, arguments or None, problem or None):
    a block that is not {"name": str, "arguments": object} JSON, or one left open, is a call with its problem."""
    calls, pos = [], 0
    while (start := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            body = text[start + len(OPEN):]
            calls.append((_name_in(body), None, f"the tool call is not closed with {CLOSE}"))
            break
        body = text[start + len(OPEN): end]
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError) as exc:   # deeply nested brackets: RecursionError
            calls.append((_name_in(body), None, f"the tool call is not valid JSON ({exc}); write "
                                                '{"name": <function-name>, "arguments": <args-json-object>}'))
        else:
            calls.append(_checked_call(parsed))
        pos = end + len(CLOSE)
    return calls


def _name_in(body: str) -> Optional[str]:
    match = re.search(r'"name"\s*:\s*"([^"\\]{1,100})"', body)
    return match.group(1) if match else None


def _checked_call(call) -> tuple:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return (None, None, 'a tool call is {"name": <function-name>, "arguments": <args-json-object>}')
    args = call.get("arguments")
    if args is None:   # a call without arguments (some templates leave them out)
        args = {}
    if isinstance(args, str):   # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            pass
    if not isinstance(args, dict):
        return (call["name"], None, f"the arguments must be a JSON object, got {type(args).__name__}")
    if _non_finite(args):
        # Python's json reads NaN and Infinity (JSON has neither), and a 'number' check passes them: a NaN guess
        # made get_reward() NaN, the episode an environment error, skipped, not scored (found by a red team)
        return (call["name"], None, "the arguments hold NaN or Infinity, which are not JSON numbers")
    return (call["name"], args, None)


def _non_finite(value) -> bool:
    """Whether a NaN or an infinity is anywhere in `value` (nested lists and objects too; a loop, not recursion:
    the nesting is the model's)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return False


# ----------------------------------------------------------------------------------------------------
# Checking a call's arguments against the tool's schema
# ----------------------------------------------------------------------------------------------------

_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
               "object": dict, "null": type(None)}


def _type_problem(value, spec: dict, where: str) -> Optional[str]:
    if not isinstance(spec, dict):
        return None
    if "enum" in spec and value not in spec["enum"]:
        return f"{where} must be one of {spec['enum']}, got {json.dumps(value)[:80]}"
    kinds = _kinds(spec)
    if kinds and not any(_is(value, k) for k in kinds):
        return f"{where} must be {' or '.join(kinds)}, got {_json_kind(value)} {json.dumps(value)[:80]}"
    if isinstance(value, list) and isinstance(spec.get("items"), dict):
        for i, item in enumerate(value):
            if problem := _type_problem(item, spec["items"], f"{where}[{i}]"):
                return problem
    return None


def _kinds(spec: dict) -> list[str]:
    """The JSON types a parameter's schema allows ([]: any)."""
    kinds = spec.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    return kinds + ["null"] if spec.get("nullable") else kinds


def _is(value, kind: str) -> bool:
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return kind not in _JSON_TYPES or isinstance(value, _JSON_TYPES[kind])


def _json_kind(value) -> str:
    for name, kind in (("boolean", bool), ("integer", int), ("number", float), ("string", str), ("array", list),
                       ("object", dict)):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


def arguments_problem(fn: Callable, spec: dict, args: dict) -> Optional[str]:
    """Why fn(**args) is not a call its schema allows (a missing, unexpected or wrongly typed argument), or None."""
    params = spec.get("function", {}).get("parameters", {}) or {}
    properties, required = params.get("properties", {}) or {}, params.get("required", []) or []
    missing = [k for k in required if k not in args]
    if missing:
        return f"missing argument{'s' * (len(missing) > 1)} {', '.join(missing)}"
    try:
        takes_any = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        takes_any = False
    extra = [k for k in args if k not in properties]
    if extra and not takes_any:
        return (f"unexpected argument{'s' * (len(extra) > 1)} {', '.join(map(str, extra))[:200]} (it takes: "
                f"{', '.join(properties) or 'none'})")
    for key, value in args.items():
        if key in properties and (problem := _type_problem(value, properties[key], f"argument {key}")):
            return problem
    return None


def as_declared(spec: dict, args: dict) -> dict:
    """Arguments arguments_problem passed, each whole float given for an integer parameter (2.0, 1e300) the int it
    is: JSON's numbers have one kind, and a tool hinted `int` got a float (found by a red team: add(2.0, 1e300)
    returned 1e+300)."""
    properties = (spec.get("function", {}).get("parameters", {}) or {}).get("properties", {}) or {}
    return {k: _as_int(v, properties.get(k)) for k, v in args.items()}


def _as_int(value, spec):
    if not isinstance(spec, dict):
        return value
    kinds = _kinds(spec)
    if isinstance(value, float) and "integer" in kinds and "number" not in kinds:   # (whole: _is checked it)
        return int(value)
    if isinstance(value, list) and isinstance(spec.get("items"), dict):
        return [_as_int(v, spec["items"]) for v in value]
    return value


# ----------------------------------------------------------------------------------------------------
# Running a call: bounded, its failure the model's to read
# ----------------------------------------------------------------------------------------------------

_HUNG = HungCalls()   # the tool calls that ran past their timeout, by tool name


def _run_bounded(fn: Callable, args: dict, timeout_s: float, name: str,
                 shorten: Callable[[str], str]) -> tuple[str, Optional[str]]:
    """('ok', the result's text), ('failed', what went wrong, as text) or ('timeout', None), each text shortened
    by `shorten`. The text is made on the call's thread too (a __str__ is user code, bounded as the call is); a
    call past timeout_s leaves its (daemon) thread behind."""
    def run():
        try:
            out = fn(**args)
            if inspect.isawaitable(out):   # an async def tool: run to completion here, on its own loop
                out = asyncio.run(_awaited(out))
        except BaseException as exc:   # user code (SystemExit too): the call's error, never the run's
            return "failed", shorten(_raised(exc))
        return _text(out, shorten)

    done, out = _HUNG.run(run, timeout_s, name, "lowmem-grpo-tool")
    return out if done else ("timeout", None)


async def _awaited(awaitable):
    return await awaitable


def _raised(exc: BaseException) -> str:
    """What a tool raised, as TRL writes it (str(exc), else its type's name); one that is no Exception by its repr:
    SystemExit(3), not a bare 3. A __str__ that raises is no crash (found by a red team: it ended the episode)."""
    try:
        text = str(exc) if isinstance(exc, Exception) else repr(exc)
    except BaseException:   # user code
        text = ""
    return text or type(exc).__name__


def _text(value, shorten: Callable[[str], str]) -> tuple[str, str]:
    """('ok', the result as the tool message's content: str(), as TRL converts it, shortened, as plain valid UTF-8
    (a lone surrogate replaced)), or ('failed', why it cannot be text: a __str__ that raises or returns no str, an
    int past Python's 4300 digits)."""
    try:
        text = str.__str__(value) if isinstance(value, str) else str(value)
    except BaseException as exc:   # user code
        return "failed", shorten(f"the result cannot be converted to text: {type(exc).__name__}: {_raised(exc)}")
    return "ok", shorten(text).encode("utf-8", "replace").decode("utf-8")


def _error(message: str) -> str:
    return str({"error": message})   # as TRL writes a failed call's result


# ----------------------------------------------------------------------------------------------------
# The environment
# ----------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=32)
def _loaded_tools(names: tuple) -> tuple:
    return tuple(_load(n, f"tools[{i}]") for i, n in enumerate(names))


@functools.lru_cache(maxsize=8)
def _format(model: str, trust_remote_code: bool, kwargs_json: str) -> ChatFormat:
    return ChatFormat(model, trust_remote_code, json.loads(kwargs_json))


def kept_result_tokens(max_result_tokens: Optional[int], observation_max_tokens: Optional[int]) -> int:
    """The tokens a result is cut to what could keep (cut_to_ends), as soon as it is text: the smaller of the two
    caps given, UNCAPPED_RESULT_TOKENS without either. observation_max_tokens is the trainer's (EnvironmentFactory
    passes it: trainer_settings), whose cut of the observation comes later and keeps no more."""
    caps = [int(t) for t in (max_result_tokens, observation_max_tokens) if t is not None]
    return min(caps) if caps else UNCAPPED_RESULT_TOKENS


def _schemas(tools: dict) -> dict:
    return {name: schema(fn, f"tool {name!r}") for name, fn in tools.items()}


class ToolCalls(Environment):
    """TRL's tools (and environment_factory) as an environment; see the module's docstring."""

    stop = ()   # a turn ends at EOS: it may hold several calls, as in TRL
    parallel_steps = False   # the user's functions may share state: one call at a time, as TRL calls them
    # A turn cut at max_new_tokens is no finished turn: inference would never run its calls, nor write the tools'
    # answer after it without the turn's end (found by a red team); its episode ends there, truncated
    ends_at_cut_turn = True
    # The trainer passes environment.observation_max_tokens (EnvironmentFactory): each result is cut to it at once,
    # not held whole until the observation's cut (found by a red team: 20 MB results with max_result_tokens unset)
    trainer_settings = ("observation_max_tokens",)
    # for_rewards is the environment_factory's instance, made for each episode: one shared by episodes is their error
    own_for_rewards = True

    def __init__(self, model: str, tools: Optional[list] = None, environment_factory: Factories = "",
                 trust_remote_code: bool = False, chat_template_kwargs: Optional[dict] = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_rounds: Optional[int] = None,
                 max_result_tokens: Optional[int] = None, observation_max_tokens: Optional[int] = None):
        self.timeout_s, self.max_rounds, self.max_result_tokens = float(timeout_s), max_rounds, max_result_tokens
        self.result_tokens = kept_result_tokens(max_result_tokens, observation_max_tokens)
        self.format = _format(model, bool(trust_remote_code), json.dumps(chat_template_kwargs or {}, sort_keys=True))
        self._standalone = list(_loaded_tools(tuple(tools or ())))
        # several environments (TRL's dict): the row's `environment` picks one at reset(), and with it the tools
        self._factories = ({name: _load(f, _factory_label(name)) for name, f in environment_factory.items()}
                           if isinstance(environment_factory, dict) else None)
        self.env = None
        if environment_factory and self._factories is None:
            self.env = _load(environment_factory, "environment_factory")()
        self._use(self.env)
        self.rounds = self.calls = self.errors = self.timeouts = 0
        self._prefix: Optional[str] = None

    def _use(self, env) -> None:
        self.env = env
        self.tools = _by_name(self._standalone + (environment_tools(env) if env is not None else []), "tools")
        self.schemas = _schemas(self.tools)

    @classmethod
    def startup(cls, model: str, tools: Optional[list] = None, environment_factory: Factories = "",
                trust_remote_code: bool = False, chat_template_kwargs: Optional[dict] = None,
                timeout_s: float = DEFAULT_TIMEOUT_S, max_rounds: Optional[int] = None,
                max_result_tokens: Optional[int] = None, observation_max_tokens: Optional[int] = None) -> list[str]:
        """The tools importable and describable, the chat template one whose calls are read here."""
        if not (timeout_s > 0 and timeout_s < float("inf")):
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s}")
        if max_rounds is not None and max_rounds < 0:
            raise ValueError(f"max_rounds must be >= 0 or null (no limit), got {max_rounds}")
        if max_result_tokens is not None and max_result_tokens < 1:
            raise ValueError(f"max_result_tokens must be >= 1 or null (no cut of its own), got {max_result_tokens}")
        if observation_max_tokens is not None and observation_max_tokens < 1:
            raise ValueError(f"observation_max_tokens must be >= 1 or null, got {observation_max_tokens}")
        names = _by_name(list(_loaded_tools(tuple(tools or ()))), "tools")
        several = isinstance(environment_factory, dict)
        for name, target in named_factories(environment_factory or None).items():
            what = _factory_label(name)
            if not callable(_load(target, what)):
                raise ValueError(f"{what}: {target!r} is not callable")
        fmt = _format(model, bool(trust_remote_code), json.dumps(chat_template_kwargs or {}, sort_keys=True))
        what = f"{len(names)} tools ({', '.join(names)})" if names else "no standalone tools"
        envs = (f" and {len(environment_factory)} environments chosen by each row's 'environment' "
                f"({', '.join(map(str, environment_factory))})" if several else
                " and an environment_factory" if environment_factory else "")
        return [f"environment tools: {what}{envs}, calls "
                f"read in the {fmt.format} format of {model!r}'s chat template, each turn's calls bounded by "
                f"{timeout_s:g} s"]

    @classmethod
    def longest_step_s(cls, timeout_s: float = DEFAULT_TIMEOUT_S, **_) -> float:
        """The turn's calls share timeout_s; then the answer's rendering."""
        return float(timeout_s) + 5.0

    def reset(self, row: dict):
        self._prefix = None
        if self._factories is not None:
            return self._reset_chosen(row)
        if self.env is None:
            return None
        observation = self.env.reset(**row)   # (what it raises: the episode's error, counted by the driver)
        if observation is None:
            return None
        return self._with_observation(row, observation)

    def _reset_chosen(self, row: dict):
        """Several environments: the one the row's `environment` names, reset on the row less that field (TRL's
        control field); the prompt is the episode's own, rendered with that environment's tools alone
        (template_kwargs), as TRL renders each example with its environment's tools."""
        name = row.get(ENVIRONMENT_FIELD)
        if name not in self._factories:
            raise ValueError(f"the row's {ENVIRONMENT_FIELD!r} is {name!r}; allowed: "
                             f"{', '.join(map(repr, self._factories))} (environment_factory's names)")
        self._use(self._factories[name]())
        self.template_kwargs = {"tools": list(self.schemas.values()) or None}   # (None: as TRL, no tool boilerplate)
        observation = self.env.reset(**{k: v for k, v in row.items() if k != ENVIRONMENT_FIELD})
        return row.get("prompt") if observation is None else self._with_observation(row, observation)

    @staticmethod
    def _with_observation(row: dict, observation):
        """The row's prompt with reset()'s text appended to its last message, as TRL appends it."""
        if not isinstance(observation, str):
            raise TypeError(f"the environment's reset() returned {type(observation).__name__}; allowed here: a str "
                            "(appended to the prompt's last message) or None")
        prompt = row.get("prompt")
        if isinstance(prompt, str):
            return prompt + observation
        if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict) \
                and isinstance(prompt[-1].get("content"), str):
            return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + observation}]
        raise TypeError("the environment's reset() returned text, and the row's prompt is neither text nor chat "
                        "messages to append it to")

    @property
    def for_rewards(self):
        """TRL's environments[i] for reward functions: the environment_factory's instance (None: tools alone)."""
        return self.env

    def counters(self) -> dict:
        return {"tool_calls": self.calls, "tool_errors": self.errors, "tool_timeouts": self.timeouts}

    def final_reward(self) -> Optional[float]:
        """The environment's get_reward() (TRL's reward of the whole rollout), when it has one."""
        get_reward = getattr(self.env, "get_reward", None) if self.env is not None else None
        if get_reward is None:
            return None
        out = get_reward()
        return asyncio.run(_awaited(out)) if inspect.isawaitable(out) else out

    def step(self, model_text: str):
        if self._prefix is None:
            self._prefix = self.format.generation_prefix() if self.format.format == "response_template" else ""
        calls = self.format.calls(model_text, self._prefix, list(self.schemas.values()))
        if not calls:
            return None, None, True                     # no tool call: the model answered
        self.rounds += 1
        if self.max_rounds is not None and self.rounds > self.max_rounds:
            return None, None, True                     # TRL's max_tool_calling_iterations: no more tool rounds
        deadline = time.monotonic() + self.timeout_s
        results = []
        for name, args, problem in calls:
            self.calls += 1
            content = None
            if problem is None:
                problem, content = self._call(name, args, deadline)
            if problem is not None:
                self.errors += 1
                content = _error(problem)
            results.append((self._shown_name(name), content))
        observation = self.format.answer(results)
        exchange = self._exchange(model_text, self._prefix, calls, results)
        self._prefix = str(observation)
        return Rendered(observation.parts, exchange), None, False

    def _exchange(self, model_text: str, prefix: str, calls: list, results: list) -> tuple:
        """The turn and its answers as TRL gives them to reward functions: the assistant message (its text without
        the calls, and its tool_calls) and one tool message per call, named for its tool, holding its result."""
        tool_calls = [{"type": "function", "function": {"name": shown, "arguments": args if args is not None else {}}}
                      for (_, args, _), (shown, _) in zip(calls, results)]
        said = self.format.content(model_text, prefix)
        return ({"role": "assistant", "content": said, "tool_calls": tool_calls},
                *({"role": "tool", "name": name, "content": content} for name, content in results))

    def _shown_name(self, name) -> str:
        """The name a result's tool message carries: the tool's, or UNKNOWN_TOOL for a name no tool has. The
        model's own would reach the template's markup, where a template prints it (found by a red team: a name
        spelling <|im_start|> became the token, a lone surrogate the episode's error)."""
        return name if isinstance(name, str) and name in self.tools else UNKNOWN_TOOL

    def _shorten(self, text: str) -> str:
        """A result (or what a tool raised) cut to what result_tokens could ever keep of it, as soon as it is text
        (found by a red team: 30 results of 10 MB, each kept and rendered twice, took 1.2 GB for an observation of
        100 tokens; and without max_result_tokens, three of 20 MB took 300 MB). The driver's own cut of the
        observation (rollout/turns.py: cut_to_ends, then tokens) keeps the same tokens of it as of the whole."""
        return cut_to_ends(text, self.result_tokens)

    def _call(self, name: str, args: dict, deadline: float) -> tuple[Optional[str], Optional[str]]:
        """(problem, None) or (None, the result's text)."""
        fn = self.tools.get(name)
        if fn is None:
            return f"Tool {name} not found (tools: {', '.join(self.tools) or 'none'})", None
        if problem := arguments_problem(fn, self.schemas[name], args):
            return f"{name}: {problem}", None
        left = deadline - time.monotonic()
        if left <= 0:   # (an error, not a timeout: this call never ran)
            return f"{name} was not run: this turn's calls used up their {self.timeout_s:g} s", None
        self._stop_if_tools_hang()
        outcome, text = _run_bounded(fn, as_declared(self.schemas[name], args), left, name, self._shorten)
        if outcome == "timeout":
            self.timeouts += 1
            return f"{name} did not return within {self.timeout_s:g} s and was abandoned", None
        return (None, text) if outcome == "ok" else (text, None)

    def _stop_if_tools_hang(self) -> None:
        """An EnvError (the run stops, rollout/turns.py) once MAX_HUNG calls ran past their timeout and still run:
        each holds a thread, and refusing every later call instead trained on broken tools, silently (found by a
        red team), as rollout/turns.py's MAX_HUNG_CALLS stops a run whose environment hangs."""
        hung = _HUNG.running()   # the tools whose calls still run, one name per call
        if len(hung) >= MAX_HUNG:
            counts = ", ".join(f"{n} ({hung.count(n)})" for n in dict.fromkeys(hung))
            raise EnvError(f"{len(hung)} tool calls ran past timeout_s={self.timeout_s:g} s and still run: {counts}; "
                           "a tool hangs (each such call holds a thread Python cannot stop): fix it, or raise "
                           "environment.kwargs.timeout_s")


# ----------------------------------------------------------------------------------------------------
# lowmem_grpo.trl: GRPOTrainer(tools=..., environment_factory=...) as a recipe's environment section
# ----------------------------------------------------------------------------------------------------

def _with_training_template(model: str, trust_remote_code: bool, chat_template_kwargs: Optional[dict]) -> dict:
    """chat_template_kwargs, with TRL's training template as `chat_template` where the model's own is not
    prefix-preserving and TRL has one for it (Qwen3's drops its empty think block once a tool message follows), as
    TRL's GRPOTrainer swaps it in for tools: through TRL's public trl.chat_template_utils.get_training_chat_template
    (checked against TRL 1.16; tests/test_trl_tools.py). Unchanged otherwise: ChatFormat then says what is wrong."""
    kwargs = dict(chat_template_kwargs or {})
    if "chat_template" in kwargs:   # the user's own choice
        return kwargs
    try:
        _format(model, trust_remote_code, json.dumps(kwargs, sort_keys=True))
        return kwargs
    except NotPrefixPreserving:
        pass
    try:
        from trl.chat_template_utils import get_training_chat_template
    except ImportError:   # (TRL-shaped code without TRL installed)
        return kwargs
    try:
        template = get_training_chat_template(_tokenizer(model, trust_remote_code))
    except ValueError:   # a template TRL has no training version of: refused as it is
        return kwargs
    return {**kwargs, "chat_template": template} if isinstance(template, str) else kwargs


def named_factories(environment_factory) -> dict:
    """TRL's environment_factory as {name: factory}: a dict's own (several environments, each row's 'environment'
    names one), {None: it} for one factory, {} for none; a ToolCallError for a dict no row could name."""
    if not isinstance(environment_factory, dict):
        return {None: environment_factory} if environment_factory is not None else {}
    if not environment_factory:
        raise ToolCallError("environment_factory: an empty dict; map each name a row's 'environment' holds to a factory")
    for name in environment_factory:
        if not isinstance(name, str):
            raise ToolCallError(f"environment_factory: the name {name!r} is not text, as a row's 'environment' holds it")
    return dict(environment_factory)


def _factory_label(name: Optional[str]) -> str:
    """How errors name a factory of named_factories: environment_factory, or environment_factory['name']."""
    return "environment_factory" if name is None else f"environment_factory[{name!r}]"


def _probe(factory, what: str):
    """An instance of the factory, as TRL makes one at construction (its tools are described in the prompt); a
    ToolCallError for what TRL would refuse."""
    if not callable(factory):
        raise ToolCallError(f"{what}: {factory!r} is not callable (a class, or a function that returns an environment)")
    try:
        probe = factory()
    except Exception as exc:   # the user's constructor
        raise ToolCallError(f"{what}() raised {type(exc).__name__}: {exc}") from None
    if not callable(getattr(probe, "reset", None)):
        raise ToolCallError(f"{what}: its {type(probe).__name__} has no reset method; TRL's environments have "
                            "reset(**row) -> str or None")
    if inspect.iscoroutinefunction(getattr(probe, "reset")):
        raise ToolCallError(f"{what}: {type(probe).__name__}.reset is async def; write it with def")
    return probe


def trl_environment(tools, environment_factory, *, model: str, trust_remote_code: bool,
                    chat_template_kwargs: Optional[dict], max_tool_calling_iterations: Optional[int],
                    max_completion_length: int) -> tuple[dict, dict]:
    """(the recipe's environment section, data.chat_template_kwargs with the tools' schemas) for TRL's tools and
    environment_factory; a ToolCallError naming what cannot be run."""
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise ToolCallError(f"tools: expected a list of functions, got {type(tools).__name__}")
    tools = list(tools or [])
    for i, fn in enumerate(tools):
        if not callable(fn) or isinstance(fn, type):
            raise ToolCallError(f"tools[{i}]: {fn!r} is not a function; a tool is a function with type hints and a "
                                "Google-style docstring")
    if chat_template_kwargs and "tools" in chat_template_kwargs:
        raise ToolCallError("chat_template_kwargs: sets tools, which GRPOTrainer's tools= (or environment_factory) "
                            "fills in")
    if max_tool_calling_iterations is not None and (isinstance(max_tool_calling_iterations, bool) or not isinstance(
            max_tool_calling_iterations, int) or max_tool_calling_iterations < 0):
        raise ToolCallError(f"max_tool_calling_iterations: expected a whole number >= 0 or None, got "
                            f"{max_tool_calling_iterations!r}")
    factories = named_factories(environment_factory)
    several = isinstance(environment_factory, dict)
    by_name: dict = {}   # every environment's tools (TRL's union): what the prompt shows before a row picks one
    for name, factory in factories.items():
        what = _factory_label(name)
        for tool_name, fn in _by_name(tools + environment_tools(_probe(factory, what)), "tools").items():
            by_name.setdefault(tool_name, fn)
    if not factories:
        by_name = _by_name(tools, "tools")
    if not by_name:
        raise ToolCallError("environment_factory: its environment has no public methods to call as tools (and "
                            "tools= gives none)")
    chat_template_kwargs = _with_training_template(model, bool(trust_remote_code), chat_template_kwargs)
    _format(model, bool(trust_remote_code), json.dumps(chat_template_kwargs or {}, sort_keys=True))   # its checks
    if several:
        registered = dict(zip(factories, register(list(factories.values()), "environment")))
    else:
        registered = register([environment_factory], "environment")[0] if environment_factory else ""
    kwargs = {"model": model, "tools": register(tools, "tool") if tools else [],
              "environment_factory": registered,
              "trust_remote_code": bool(trust_remote_code),
              "chat_template_kwargs": dict(chat_template_kwargs or {}),
              "timeout_s": DEFAULT_TIMEOUT_S, "max_rounds": max_tool_calling_iterations,
              "max_result_tokens": max_completion_length}   # (the observation_max_tokens below: no result kept longer)
    # TRL: no limit on the rounds without max_tool_calling_iterations; the completion's length ends them
    turns = max_tool_calling_iterations + 1 if max_tool_calling_iterations is not None else max_completion_length
    environment = {"name": NAME, "kwargs": kwargs, "max_turns": max(1, turns),
                   "max_total_tokens": max_completion_length, "observation_max_tokens": max_completion_length,
                   "step_timeout_s": max(60.0, ToolCalls.longest_step_s(DEFAULT_TIMEOUT_S))}
    schemas = [schema(fn, f"tool {name!r}") for name, fn in by_name.items()]
    return environment, {**(chat_template_kwargs or {}), "tools": schemas}
