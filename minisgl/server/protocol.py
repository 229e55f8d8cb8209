"""OpenAI request bodies, and how their fields map onto SamplingParams.

Bodies are parsed with orjson, which refuses what no JSON encoder should write (NaN, Infinity,
lone surrogates, invalid UTF-8, nesting deeper than 1,024); field types are checked strictly (a
string is not a number) and every integer must fit int64. Value rules (ranges, non-empty stop
strings, ...) are SamplingParams' own. Fields left out keep SamplingParams' defaults, which match
OpenAI's (temperature 1, top_p 1, max_tokens 16 for completions), except chat's max_tokens, which
defaults to the rest of the context (as in vLLM): the request runs until the context is full. A
max_tokens that cannot fit with the prompt is a 400 with the numbers, as vLLM says it.

Chat's tools go to the chat template; a `required` or named tool_choice becomes a structured
output, the JSON schema of its calls, as in vLLM (responses.py reads the calls out of the reply).
"""

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import cache
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    FailFast,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from typing_extensions import TypeAliasType

from minisgl.core import (
    INT64_MAX,
    INT64_MIN,
    MAX_SCHEMA_DEPTH,
    InvalidSamplingParam,
    PromptOptions,
    SamplingParams,
    StructuredOutput,
    schema_depth,
)

from .errors import ApiError
from .tool_parser import loads_exact

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
Float = Annotated[float, Field(allow_inf_nan=False)]
_T = TypeVar("_T")
# a list's first bad item is its error, not every one: a 2 MB body of a million bad messages held
# the API server's event loop 6.3 s and came back as an 80 MB error (1.8 GB at the peak)
List = TypeAliasType("List", Annotated[list[_T], FailFast()], type_params=(_T,))


# A body's fields that change nothing in the output (bookkeeping for OpenAI's own services):
# accepted and dropped. Any other field that no schema below declares, in the body or an object
# inside it, is refused with a 400 that names it, so that no field is accepted and ignored.
IGNORED_FIELDS = frozenset(
    {
        "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
        "prompt_cache_retention", "prompt_cache_options",
    }
)  # fmt: skip


class UnknownFields(ValueError):
    """Fields no schema declares, in the object where the validation error stands."""

    def __init__(self, names: list[str]) -> None:
        # a few, each cut short: 300,000 unknown keys (a 4.4 MB body) gave a 3.5 MB error
        shown = [_cut(name) for name in names[:_SHOWN_FIELDS]]
        more = f" and {len(names) - len(shown)} more" if len(names) > len(shown) else ""
        super().__init__(f"unsupported field(s): {', '.join(shown)}{more}")
        self.names = shown


_SHOWN_FIELDS, _SHOWN_CHARS = 8, 64


def _cut(name: str) -> str:
    return name if len(name) <= _SHOWN_CHARS else name[:_SHOWN_CHARS] + "..."


class _Strict(BaseModel):
    """An object of a request body: a field sent as null counts as not sent, as OpenAI takes it
    (clients send back their replies' nulls)."""

    model_config = ConfigDict(strict=True, extra="allow")  # the extra fields are checked below
    _ignored: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _refuse_unknown_fields(self) -> "_Strict":
        unknown = sorted(set(self.model_extra or {}) - self._ignored)
        if unknown:
            raise UnknownFields(unknown)
        return self


class _Body(_Strict):
    """A request's body; it may name the model it is for."""

    _ignored = IGNORED_FIELDS
    model: str | None = None  # None: the served model


Body = TypeVar("Body", bound=_Body)


def parse_body(data: bytes | bytearray, schema: type[Body]) -> Body:
    """The request body as `schema`; raises ApiError(400) saying what is wrong with it."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    try:
        return schema.model_validate(obj)
    except ValidationError as e:
        param, details = _explain(e)
        raise ApiError(400, details, param=param) from None


def _explain(e: ValidationError) -> tuple[str | None, str]:
    """Where the first error is (None: the whole; an unknown field's name), and what each error
    is, where: a validator's own message without pydantic's "Value error, " before it."""
    errors = [(_place(err["loc"]), err, err.get("ctx", {}).get("error")) for err in e.errors()]
    details = "; ".join(
        f"{place or 'body'}: {raised if isinstance(raised, ValueError) else err['msg']}"
        for place, err, raised in errors
    )
    place, _, raised = errors[0]
    if isinstance(raised, UnknownFields):  # the field at fault, as OpenAI names one
        return ".".join(filter(None, (place, raised.names[0]))), details
    return place or None, details


def _place(loc: tuple[int | str, ...]) -> str:
    """Where in the body a validation error is, as the request names it: its fields and list
    indexes, without the tags of the union members pydantic tried (`str`, `list[TextPart]`)."""
    return ".".join(str(part) for part in loc if isinstance(part, int) or part in _field_names())


@cache
def _field_names() -> frozenset[str]:
    """Every field name (and alias) of every request schema."""
    names: set[str] = set()
    schemas: list[type[BaseModel]] = [_Strict]
    while schemas:
        schema = schemas.pop()
        schemas += schema.__subclasses__()
        for name, info in schema.model_fields.items():
            names.update(n for n in (name, info.alias) if n is not None)
    return frozenset(names)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchema(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema: strict or not


class ResponseFormat(_Strict):
    """OpenAI's response_format."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_only_for_its_type(self) -> "ResponseFormat":
        if self.json_schema is not None and self.type != "json_schema":
            raise ValueError(f"response_format of type {self.type} takes no json_schema")
        return self


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs (older: guided_json, guided_regex, ...): one of them."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: List[str] | None = None
    grammar: str | None = None


def _structured_output(kind: str, value: Any, field: str) -> StructuredOutput:
    """StructuredOutput(kind=value), from the request's `field`; what it refuses is a 400."""
    try:
        return StructuredOutput(**{kind: value})
    except ValueError as e:
        raise ApiError(400, str(e), param=field) from None


# the request fields that are SamplingParams' fields of the same name and meaning
# the SamplingParams fields a request may call otherwise (request_field), as whole words
_FIELD_NAME = re.compile(r"\b(max_tokens|logprobs)\b")
_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
    "include_stop_str_in_output", "prompt_logprobs",
)  # fmt: skip


class _GenerateRequest(_Body):
    """The fields completions and chat share."""

    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[Int64, Field(ge=1)] = 1
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int64 | None = None
    min_p: Float | None = None
    seed: Int64 | None = None
    stop: str | List[str] | None = None
    stop_token_ids: List[TokenId] | None = None
    ignore_eos: bool | None = None
    frequency_penalty: Float | None = None
    presence_penalty: Float | None = None
    repetition_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None  # token id (as a string) -> bias
    min_tokens: Int64 | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: Int64 | None = None  # vLLM's
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: List[str] | None = None
    guided_grammar: str | None = None
    # SGLang's own fields, which vllm-router writes into every request it forwards (--dp):
    # accepted with the value that is what minisgl does, refused with any other
    no_stop_trim: Literal[False] = False
    skip_special_tokens: Literal[True] = True
    return_hidden_states: Literal[False] = False

    @model_validator(mode="after")
    def _stream_options_only_when_streaming(self) -> "_GenerateRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _structured(self) -> StructuredOutput | None:
        """The one output constraint given by response_format, structured_outputs or guided_*."""
        given = self._constraints()
        if len(given) > 1:
            fields = ", ".join(field for field, _ in given)
            raise ApiError(400, f"give one output constraint, not {len(given)} ({fields})",
                           param=given[1][0])  # fmt: skip
        return given[0][1] if given else None

    def _constraints(self) -> list[tuple[str, StructuredOutput]]:
        """Each output constraint the request gives, with the field that gives it."""
        given: list[tuple[str, StructuredOutput]] = []
        if self.response_format is not None and self.response_format.type == "json_object":
            given.append(("response_format", StructuredOutput(json_object=True)))
        elif self.response_format is not None and self.response_format.type == "json_schema":
            field = "response_format.json_schema.schema"
            schema = self.response_format.json_schema
            if schema is None or schema.schema_ is None:
                raise ApiError(
                    400, "response_format json_schema needs json_schema.schema", param=field
                )
            given.append((field, _structured_output("json_schema", schema.schema_, field)))
        so = self.structured_outputs or StructuredOutputs()
        if so.json_object:
            given.append(("structured_outputs.json_object", StructuredOutput(json_object=True)))
        sources = [
            ("structured_outputs.json", "json_schema", so.json_),
            ("structured_outputs.regex", "regex", so.regex),
            ("structured_outputs.choice", "choice", so.choice),
            ("structured_outputs.grammar", "grammar", so.grammar),
            ("guided_json", "json_schema", self.guided_json),
            ("guided_regex", "regex", self.guided_regex),
            ("guided_choice", "choice", self.guided_choice),
            ("guided_grammar", "grammar", self.guided_grammar),
        ]
        return given + [
            (field, _structured_output(kind, value, field))
            for field, kind, value in sources
            if value is not None
        ]

    def _params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        defaults: Mapping[str, Any],
        rest_of_context: bool = False,
    ) -> SamplingParams:
        """Raises ApiError(400) for values SamplingParams rejects. A field the request leaves out
        takes its value from `defaults` (the model's, `sampling_defaults`), else SamplingParams'
        default; max_tokens None: SamplingParams' default, or the rest of the context where
        rest_of_context."""
        bias = None
        if self.logit_bias is not None:
            # int() would also take " 5", "+5", "5_0" and other scripts' digits
            if not all(token.isascii() and token.isdigit() for token in self.logit_bias):
                raise ApiError(400, "logit_bias keys must be token ids", param="logit_bias")
            bias = {int(token): value for token, value in self.logit_bias.items()}
            if len(bias) < len(self.logit_bias):
                raise ApiError(400, "logit_bias names a token id twice", param="logit_bias")
        given: dict[str, Any] = {name: getattr(self, name) for name in _SAMPLING_FIELDS}
        given.update(
            max_tokens=max_tokens, logprobs=logprobs, logit_bias=bias, structured=self._structured()
        )
        values = {**defaults, **{k: v for k, v in given.items() if v is not None}}
        if max_tokens is None and rest_of_context:
            values["max_tokens"] = None
        try:
            return SamplingParams(**values)
        except InvalidSamplingParam as e:
            name = self.request_field(e.name)
            # a requirement may name another field (min_tokens: "at most max_tokens")
            requirement = _FIELD_NAME.sub(lambda m: self.request_field(m[0]), e.requirement)
            raise ApiError(400, f"{name} {requirement}", param=name) from None

    def request_field(self, name: str) -> str:
        """The request's name for a SamplingParams field (`structured`: the field that gave the
        constraint, which the scheduler refused)."""
        return self._constraints()[0][0] if name == "structured" else name

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _first_bad_bias(cls, value: Any) -> Any:
        """The first bias that is no number is the error, as a List's first bad item is."""
        if isinstance(value, dict):
            for token, bias in value.items():
                if isinstance(bias, bool) or not isinstance(bias, int | float):
                    raise ValueError(f"the bias of {token!r} is no number")
        return value


class CompletionRequest(_GenerateRequest):
    prompt: str | List[str] | List[TokenId] | List[List[TokenId]]
    max_tokens: Int64 | None = None
    logprobs: Int64 | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's BOS

    def prompt_options(self) -> PromptOptions:
        return PromptOptions(add_special_tokens=self.add_special_tokens)

    def prompts(self) -> list[str | list[int]]:
        """One prompt per entry: a text, or token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]  # type: ignore[list-item]
        if not self.prompt:
            raise ApiError(400, "prompt must not be empty")
        return list(self.prompt)  # type: ignore[arg-type]

    @property
    def echo_only(self) -> bool:
        """vLLM's and OpenAI's: echo with max_tokens 0 answers the prompt alone (with its
        logprobs where asked), a prompt scored. The engine still computes one token, with which
        the prompt's logprobs come; the reply leaves it out."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """With echo, logprobs are the prompt's too (OpenAI's; lm-evaluation-harness scores
        with them)."""
        if self.echo_only and self.min_tokens:
            raise ApiError(400, "min_tokens must be at most max_tokens (0)", param="min_tokens")
        params = self._params(1 if self.echo_only else self.max_tokens, self.logprobs, defaults)
        if self.echo and self.logprobs is not None and params.prompt_logprobs is None:
            params = replace(params, prompt_logprobs=params.logprobs)
        return params


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as the model wrote it (not always valid)

    def template_arguments(self) -> Any:
        """As an object, as vLLM passes them (templates write them with tojson; none written is
        an empty one); text that is no JSON object stays text, as does one that no message can
        carry exactly (an integer past 64 bits, a lone surrogate: orjson cannot write them)."""
        if not self.arguments.strip():
            return {}
        try:
            arguments = loads_exact(self.arguments)
            orjson.dumps(arguments)
        except (ValueError, RecursionError, orjson.JSONEncodeError):
            return self.arguments
        return arguments if isinstance(arguments, dict) else self.arguments


class ToolCall(_Strict):
    """A call an assistant message made earlier in the conversation."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    """One message of a conversation. An assistant's may be the server's own reply sent back:
    its reasoning (vLLM's `reasoning_content`, or `reasoning`) goes to the template, which
    decides whether to show it, and a refusal stands for its content."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | List[TextPart] | None = None  # None only for an assistant's calls
    name: str | None = None  # the participant's, for the templates that write it
    tool_calls: List[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's result: the call it answers
    reasoning_content: str | None = None  # an assistant's
    reasoning: str | None = None  # an assistant's: reasoning_content's newer name in vLLM
    refusal: str | None = None  # an assistant's, instead of content

    @model_validator(mode="after")
    def _fields_fit_the_role(self) -> "ChatMessage":
        reply = self.tool_calls or self.refusal or self.reasoning_content or self.reasoning
        if self.content is None and not reply:
            raise ValueError(
                "content is required, unless an assistant message has tool_calls, a refusal or "
                "reasoning (a reply cut short while thinking)"
            )
        assistants = {
            "tool_calls": self.tool_calls, "reasoning_content": self.reasoning_content,
            "reasoning": self.reasoning, "refusal": self.refusal,
        }  # fmt: skip
        for field, value in assistants.items():
            if value is not None and self.role != "assistant":
                raise ValueError(f"{field} is an assistant message's")
        if self.reasoning is not None and self.reasoning_content is not None:
            raise ValueError("give reasoning_content or reasoning, not both")
        if self.refusal is not None and self.content is not None:
            raise ValueError("give content or refusal, not both")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("tool_call_id is required in a tool message, and only there")
        return self

    def as_template_input(self) -> dict[str, Any]:
        content = self.content or self.refusal or ""
        # text parts are joined by newlines, as vLLM joins them
        text = content if isinstance(content, str) else "\n".join(p.text for p in content)
        # "developer" is OpenAI's newer name for the system role, which chat templates know
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": text,
        }
        if self.name is not None:
            message["name"] = self.name
        reasoning = self.reasoning_content or self.reasoning
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": c.function.template_arguments(),
                    },
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


_MESSAGES = TypeAdapter(List[ChatMessage])


def template_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """OpenAI-format messages (the offline LLM.chat's) as the chat template takes them, as the
    server's chat route passes them; raises ValueError naming what is wrong."""
    try:
        parsed = _MESSAGES.validate_python(list(messages))
    except ValidationError as e:
        raise ValueError(f"messages.{_explain(e)[1]}") from None
    return [m.as_template_input() for m in parsed]


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        """As OpenAI's: a call's arguments are an object (`required` gave none for another)."""
        if parameters is not None and parameters.get("type", "object") != "object":
            raise ValueError(f'must be a schema of type "object", not {parameters["type"]!r}')
        return parameters

    def schema(self) -> dict[str, Any]:
        """The parameters a constraint holds a call to; a 400 where they nest past the bound a
        structured output's schema has (1,000 levels were a RecursionError: a 500)."""
        schema = self.parameters or {"type": "object", "properties": {}}
        if schema_depth(schema) > MAX_SCHEMA_DEPTH:
            raise ApiError(
                400,
                f"tool {self.name!r}: its parameters schema nests deeper than "
                f"{MAX_SCHEMA_DEPTH} levels",
                param="tools",
            )
        return schema


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """Tools as the chat template takes them."""
    return None if tools is None else [t.model_dump(exclude_none=True) for t in tools]


# a JSON schema's keywords whose values are values, not schemas (a "$ref" there is data), and
# those whose values map names to schemas (any name, "enum" too)
_VALUE_KEYWORDS = frozenset(("enum", "const", "default", "examples"))
_NAMED_SCHEMAS = frozenset(
    ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
)


def _rebased(schema: Any, base: str) -> Any:
    """A JSON schema whose references into itself (`#`, `#/...`) point into it where it stands at
    the JSON pointer `base` of a larger schema."""
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            rebased[key] = base + value[1:]
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            rebased[key] = {name: _rebased(sub, base) for name, sub in value.items()}
        elif key in _VALUE_KEYWORDS:
            rebased[key] = value
        else:
            rebased[key] = _rebased(value, base)
    return rebased


class _Rendering(_Strict):
    """vLLM's fields on how a prompt becomes ids (PromptOptions); add_special_tokens unset: BOS
    for a text, none for a chat (its template writes its own)."""

    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def prompt_options(self) -> PromptOptions:
        if self.continue_final_message and self.add_generation_prompt:  # transformers' rule
            raise ApiError(400, "continue_final_message and add_generation_prompt are not "
                           "compatible: continuing the final message needs "
                           "add_generation_prompt false", param="continue_final_message")  # fmt: skip
        return PromptOptions(
            self.add_special_tokens, self.add_generation_prompt, self.continue_final_message
        )


class TokenizeBody(_Body, _Rendering):
    """POST /tokenize, as vLLM's: a prompt, or messages rendered with the chat template, with the
    tools and the template's own variables a chat request would give it (its prompt's count);
    return_token_strs adds each id's token string."""

    prompt: str | None = None
    messages: List[ChatMessage] | None = None
    tools: List[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _a_prompt_or_a_chat(self) -> "TokenizeBody":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give a prompt or messages")
        chat_only = {
            "tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"
        } & self.model_fields_set  # fmt: skip
        if self.prompt is not None and chat_only:
            raise ValueError(f"{', '.join(sorted(chat_only))}: a chat's; give messages")
        return self


class DetokenizeBody(_Body):
    tokens: List[TokenId]


class ChatCompletionRequest(_GenerateRequest, _Rendering):
    messages: List[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: List[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: True, as OpenAI's
    chat_template_kwargs: dict[str, Any] | None = None  # the template's own variables
    # SGLang's, as in _GenerateRequest: any reasoning is streamed apart from the content (by
    # --reasoning-parser)
    separate_reasoning: Literal[True] = True
    stream_reasoning: Literal[True] = True
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out of the reply

    def sampling_params(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """An omitted max_tokens means the rest of the context; a given one must fit in it (the
        tokenizer process checks, with the prompt's length). A `required` or named tool_choice
        constrains the reply to its calls' JSON."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens differ: give "
                           "max_completion_tokens alone (max_tokens is deprecated)",
                           param="max_tokens")  # fmt: skip
        given = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        if self.stream and self.prompt_logprobs is not None:
            raise ApiError(400, "prompt_logprobs are not streamed in a chat (as vLLM's)",
                           param="prompt_logprobs")  # fmt: skip
        params = self._params(given, logprobs, defaults, rest_of_context=True)
        schema = self._tool_schema()
        if schema is None:
            return params
        if params.structured is not None:
            raise ApiError(400, "tool_choice required or a named function cannot be combined "
                           "with another structured output", param="tool_choice")  # fmt: skip
        structured = _structured_output("json_schema", schema, "tools")
        return replace(params, structured=structured)

    def request_field(self, name: str) -> str:
        if name == "logprobs":
            return "top_logprobs"
        if name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        if name == "structured" and not self._constraints():  # tool_choice's or strict tools'
            return "tools"
        return super().request_field(name)

    def tool_use(self) -> tuple[Literal["none", "auto", "required", "named"], str | None]:
        """How the reply is read for calls, and the named choice's function; raises ApiError(400)
        for a choice that does not fit the tools."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        if choice != "none" and not self.tools:
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        mode, name = (choice, None) if isinstance(choice, str) else ("named", choice.function.name)
        tools = self.tools or []
        if name is not None and name not in [t.function.name for t in tools]:
            raise ApiError(
                400, f"tool_choice names the function `{name}`, which tools lack",
                param="tool_choice",
            )  # fmt: skip
        return mode, name  # type: ignore[return-value]

    def strict_calls(self) -> list[tuple[str, dict[str, Any]]] | None:
        """With tool_choice auto and a tool that is strict: each tool's name and the schema its
        calls are held to (a strict tool's parameters, any object for the others)."""
        mode, _ = self.tool_use()
        tools = self.tools or []
        if mode != "auto" or not any(t.function.strict for t in tools):
            return None
        return [
            (t.function.name, t.function.schema() if t.function.strict else {"type": "object"})
            for t in tools
        ]

    @property
    def parallel(self) -> bool:
        return self.parallel_tool_calls is not False

    def _tool_schema(self) -> dict[str, Any] | None:
        """The JSON schema a required or named choice holds the reply to, as vLLM's: the named
        function's parameters, or an array of {name, parameters} objects, one tool's each."""
        mode, name = self.tool_use()
        tools = self.tools or []
        if mode == "named":
            return next(t.function.schema() for t in tools if t.function.name == name)
        if mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    # its references into itself point where it now stands
                    "parameters": _rebased(
                        t.function.schema(), f"#/items/anyOf/{i}/properties/parameters"
                    ),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for i, t in enumerate(tools)
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return schema if self.parallel else {**schema, "maxItems": 1}
