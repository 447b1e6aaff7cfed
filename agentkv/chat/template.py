"""A model's chat template, called safely and probed once for what it does with systems, tools and calls.

::

    template = ChatTemplate(engine.tokenizer)
    text = template.apply([{"role": "user", "content": "hi"}], generation=True)   # None if it raised
    template.prefix_stable(tools=False), template.native_tools, template.native_tool_calls

The probes decide how ``ChatRenderer`` renders: message by message (a prefix-stable template),
or the whole conversation at once (Qwen3, Phi-3.5, Mistral Nemo, Gemma 2, and any template with
tools that only renders them next to a user turn, as Llama 3.1's does); whether tool schemas go
through the template's ``tools=`` (it shows them) or into the system prompt as text; whether an
assistant's tool calls go to the template as ``tool_calls`` (it renders them in its own format)
or as text; whether tool results keep role ``tool`` (it shows their content verbatim).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from cachetools import LRUCache

from agentkv.engine.base import Tokenizer

logger = logging.getLogger(__name__)

PROBE_SYSTEM: dict[str, Any] = {"role": "system", "content": "You are a test."}
PROBE_TOOL_NAME = "agentkv_probe_tool"
PROBE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": PROBE_TOOL_NAME,
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}
PROBE_CALL_ID = "a1b2c3d4e"
"""Nine alphanumerics: the shape Mistral's templates require of a call id."""
PROBE_TOOL_CONTENT = 'tool "result"\nline 2'
PROBE_USER_CONTENT = "AGENTKV_FIRST_USER_CONTENT_7F3C"


def probe_call_payload(name: str = PROBE_TOOL_NAME) -> dict[str, Any]:
    """An assistant message calling ``name``, as an OpenAI-style dict."""
    call = {"id": PROBE_CALL_ID, "type": "function", "function": {"name": name, "arguments": {"q": "x"}}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


class ChatTemplate:
    """A tokenizer's chat template: ``apply`` never raises, the probes run once each."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.source = str(getattr(tokenizer, "chat_template", "") or "")
        self._heads: LRUCache[str, str | None] = LRUCache(maxsize=256)

    def apply(self, dicts: Sequence[dict[str, Any]], *, generation: bool,
              tools: Sequence[dict[str, Any]] | None = None) -> str | None:
        """The template's text, or None when it raises (templates raise anything: jinja errors,
        ``raise_exception``, RuntimeError for an empty result):
        ``template.apply([{"role": "user", "content": "hi"}], generation=True)``."""
        try:
            return self.tokenizer.apply_chat_template(list(dicts), add_generation_prompt=generation,
                                                      tools=list(tools) if tools else None)
        except Exception as error:  # noqa: BLE001 - any failure means "cannot render this"
            logger.debug("chat template raised on %d messages: %s", len(dicts), error)
            return None

    def diff(self, dicts: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> str | None:
        """template(dicts) minus template(dicts[:-1]); None if either raises or the longer text
        does not extend the shorter one."""
        before = self.apply(dicts[:-1], generation=False, tools=tools) if len(dicts) > 1 else ""
        after = self.apply(dicts, generation=False, tools=tools)
        if before is None or after is None or not after.startswith(before):
            return None
        return after[len(before):]

    def before_first_user_content(self, system: dict[str, Any], tools: Sequence[dict[str, Any]] | None) -> str | None:
        """The template's text for ``system`` followed by a user turn, up to that turn's content
        (None if it raises or hides the content); what every conversation starting with this
        system prompt shares. Cached per system prompt and tools:
        ``template.before_first_user_content({"role": "system", "content": "Be brief."}, None)``."""
        key = json.dumps([system, tools], sort_keys=True, default=str)
        if key not in self._heads:
            probe = self.apply([system, {"role": "user", "content": PROBE_USER_CONTENT}], generation=False, tools=tools)
            before, found, _ = (probe or "").partition(PROBE_USER_CONTENT)
            self._heads[key] = before if found else None
        return self._heads[key]

    # -- probes --------------------------------------------------------------------------------

    def prefix_stable(self, *, tools: bool) -> bool:
        """Rendering more messages never changes the text of earlier ones (probed with and
        without a system message, with the probe tool when ``tools``)."""
        return self._stable_with_tools if tools else self._stable_without_tools

    @cached_property
    def _stable_without_tools(self) -> bool:
        return self._probe_prefix_stability(None)

    @cached_property
    def _stable_with_tools(self) -> bool:
        return self._probe_prefix_stability([PROBE_TOOL])

    def _probe_prefix_stability(self, tools: list[dict[str, Any]] | None) -> bool:
        turns = [{"role": role, "content": content}
                 for role, content in (("user", "Hi"), ("assistant", "Hello"), ("user", "Bye"))]
        probes = [[PROBE_SYSTEM, *turns, {"role": "assistant", "content": "Bye"}], turns]
        for probe in probes:
            texts = [self.apply(probe[:k], generation=False, tools=tools) for k in range(1, len(probe) + 1)]
            texts.append(self.apply(probe, generation=True, tools=tools))
            rendered = [t for t in texts if t is not None]
            if len(rendered) < len(texts) or any(not b.startswith(a) for a, b in zip(rendered, rendered[1:])):
                return False
        return True

    @cached_property
    def native_tools(self) -> bool:
        """The template shows the schemas passed as ``tools=``: its source reads ``tools`` and the
        probe tool's name appears (openvino-genai polyfills templates that have no tool support
        with its own JSON text; that text is not what the model was trained on)."""
        if not re.search(r"\btools\b", self.source):
            return False
        for context in ([PROBE_SYSTEM, {"role": "user", "content": "Hi"}], [{"role": "user", "content": "Hi"}]):
            text = self.apply(context, generation=True, tools=[PROBE_TOOL])
            if text is not None:
                return PROBE_TOOL_NAME in text
        return False

    @cached_property
    def native_tool_calls(self) -> bool:
        """The template renders an assistant's ``tool_calls`` itself, in its own format (its
        source reads ``tool_calls``: see ``native_tools`` on openvino-genai's polyfill)."""
        if not re.search(r"\btool_calls\b", self.source):
            return False
        text = self.apply([{"role": "user", "content": "Hi"}, probe_call_payload()], generation=False,
                          tools=[PROBE_TOOL] if self.native_tools else None)
        return text is not None and PROBE_TOOL_NAME in text

    @cached_property
    def native_tool_role(self) -> bool:
        """The template renders role ``tool`` with its content, without raising: verbatim, or
        as a JSON string when its own source handles the tool role (Llama 3.1's ``ipython``
        turns ``tojson`` the result). openvino-genai's polyfill, which rewrites a tool result into
        a JSON user turn for a template with no tool role, does not count."""
        tool = {"role": "tool", "content": PROBE_TOOL_CONTENT, "tool_call_id": PROBE_CALL_ID,
                "name": PROBE_TOOL_NAME}
        user = {"role": "user", "content": "Hi"}
        contexts: list[list[dict[str, Any]]] = [[PROBE_SYSTEM, user]]
        if self.native_tool_calls:
            contexts.insert(0, [PROBE_SYSTEM, user, probe_call_payload()])
        for context in contexts:
            tools = [PROBE_TOOL] if self.native_tools else None
            text = self.apply([*context, tool], generation=False, tools=tools)
            if text is not None:
                before = self.apply(context, generation=False, tools=tools) or ""
                shown = text[common_prefix(before, text):]
                own_role = bool(re.search(r"""["']tool["']|ipython""", self.source))
                return PROBE_TOOL_CONTENT in shown or (own_role and json.dumps(PROBE_TOOL_CONTENT) in shown)
        return False


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings (a binary search over slice
    comparisons, which run in C): ``common_prefix("abc", "abd") == 2``."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
