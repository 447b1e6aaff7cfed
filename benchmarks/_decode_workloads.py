"""The decode benchmark's workloads and figures (``benchmarks/decode.py``): the quoting documents,
the chats, and what one decoding mode adds up over its calls."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentkv.engine.generation import GenerationResult


@dataclass
class Mode:
    """One decoding mode's figures summed over its calls."""

    name: str
    tokens: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    call_s: float = 0.0
    steps: int = 0
    forced: int = 0
    saved: int = 0
    drafted: int = 0
    accepted: int = 0
    calls: int = 0
    answers: list[tuple[int, ...]] = field(default_factory=list)

    def add(self, result: GenerationResult, seconds: float) -> None:
        m = result.metrics
        self.tokens += m.generated_tokens
        self.decode_tokens += max(0, m.generated_tokens - 1)
        self.decode_s += m.tpot_s * max(0, m.generated_tokens - 1)
        self.call_s += seconds
        self.steps, self.forced, self.saved = self.steps + m.model_steps, self.forced + m.forced_tokens, \
            self.saved + m.steps_saved
        self.drafted, self.accepted = self.drafted + m.drafted_tokens, self.accepted + m.accepted_tokens
        self.calls += 1
        self.answers.append(result.token_ids)

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def call_tps(self) -> float:
        return self.tokens / self.call_s if self.call_s else 0.0


QUOTE_DOCS = [
    ("Plant report, March: the Willow Creek water treatment plant processed 4.2 million gallons per day, up "
     "from 3.9 million in February. Chlorine residual averaged 1.1 mg/L at the clearwell and 0.6 mg/L at the far "
     "end of the distribution system. Two turbidity exceedances were logged on March 12 and March 19, both "
     "during filter backwash, and both cleared within forty minutes. The north reservoir was drained for "
     "inspection on March 22; inspectors found minor sediment buildup and one cracked access hatch, which was "
     "replaced on March 25. Operator Dana Reyes completed her Grade III certification, and the plant remains one "
     "operator short of its authorised headcount of nine.",
     "Repeat word for word what the report says about the north reservoir."),
    ("Incident 4471, checkout service. At 02:14 UTC the payment gateway began returning HTTP 503 for about 30 "
     "percent of requests. The on-call engineer, Priya Natarajan, paged the payments team at 02:19. The root "
     "cause was a connection pool limit of 64 on the gateway client, set in release 2.31.0, which was too low "
     "for the overnight batch of subscription renewals. The limit was raised to 256 at 02:41 and the error rate "
     "returned to normal by 02:47. Follow-up actions: add an alert on pool saturation above 80 percent, load "
     "test the renewal batch before each release, and document the pool settings in the runbook.",
     "Quote the root cause and the follow-up actions exactly as written."),
    ("def load_config(path: str) -> dict:\n    \"\"\"Read a TOML config file and fill in defaults.\"\"\"\n"
     "    with open(path, 'rb') as handle:\n        data = tomllib.load(handle)\n    data.setdefault('port', "
     "8080)\n    data.setdefault('workers', 4)\n    data.setdefault('log_level', 'info')\n    if data['workers'] < "
     "1:\n        raise ValueError('workers must be at least 1')\n    return data\n\n\ndef save_config(path: str, "
     "data: dict) -> None:\n    \"\"\"Write the config back as TOML.\"\"\"\n    with open(path, 'w') as handle:\n"
     "        handle.write(tomli_w.dumps(data))\n",
     "Show me the load_config function exactly as it is in the file."),
    ("Meeting notes, design review, 14 May. Attendees: Ana, Ben, Chloe, Dev. Decision 1: the mobile app will "
     "keep offline mode, but sync conflicts will be resolved on the server using last-writer-wins per field. "
     "Decision 2: the search index moves from Elasticsearch to OpenSearch in the third quarter, owned by Chloe. "
     "Decision 3: we drop support for Android 9 in the September release. Open question: whether the web client "
     "should share the sync engine with mobile; Dev will write a proposal by 28 May. Next review: 11 June.",
     "Copy decision 2 and the open question verbatim."),
]
"""Quoting: (a tool's ~200-token result, the user's request to repeat part of it)."""
CHATS = [
    ["How does a bicycle's gear system make climbing hills easier?", "Why do some riders prefer a single speed?",
     "What maintenance does a derailleur need?"],
    ["What should I consider when choosing a laptop for programming?", "Is more RAM or a faster CPU better for "
     "compiling code?", "How long does a laptop battery usually last before it needs replacing?"],
    ["Give me some ideas for a relaxing weekend at home.", "Which of those works best on a rainy day?",
     "Suggest a simple recipe to go with it."],
]
"""Free text: conversations of user turns (each mode answers them on its own session)."""


def quote_messages(doc: str, ask: str) -> list[dict[str, str]]:
    """The quoting prompt: a search tool's result in the conversation, then the user's request."""
    return [{"role": "system", "content": "You are a helpful assistant. Answer from the documents you are given."},
            {"role": "user", "content": "Find the document I need."},
            {"role": "assistant", "content": "The search tool returned this document:\n\n" + doc},
            {"role": "user", "content": ask}]
