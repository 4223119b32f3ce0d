"""Tool-call formats (chatd/http/tools/tool_calls.py, read by tool_stream.py): each family's recorded replies
read back as OpenAI tool calls, streamed in any split exactly as read whole, and the call grammars
checked by llguidance itself with a real tokenizer."""

import json

import llguidance
import llguidance.hf
import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from chatd.engine.models.demo import build_tokenizer
from chatd.http.tools.tool_calls import PARSERS, ToolCallDelta, parser_for_template

WEATHER = {"city": "Paris", "unit": "celsius"}
NESTED = {"filter": {"tags": ["a", "b"], "range": {"from": 1, "to": [2, {"deep": None}]}}, "limit": 10}
TRICKY = {"text": 'say "hi" {not json} }}{{ \\ back\\slash', "emoji": "café 😀 日本", "newline": "a\nb"}


def hermes(name, arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def llama(name, parameters):
    return json.dumps({"name": name, "parameters": parameters})


def mistral(*calls):
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def call(name, arguments):
    return name, json.dumps(arguments)


# (family, reply as the model writes it, content, [(name, arguments JSON)])
FIXTURES = {
    "hermes one call": ("hermes", hermes("get_weather", WEATHER), None, [call("get_weather", WEATHER)]),
    "hermes two calls": ("hermes", hermes("get_weather", WEATHER) + "\n" + hermes("get_time", {"tz": "UTC"}), None,
                         [call("get_weather", WEATHER), call("get_time", {"tz": "UTC"})]),
    "hermes content first": ("hermes", "Let me check the weather.\n\n" + hermes("get_weather", WEATHER),
                             "Let me check the weather.", [call("get_weather", WEATHER)]),
    "hermes nested": ("hermes", hermes("search", NESTED), None, [call("search", NESTED)]),
    "hermes tricky strings": ("hermes", hermes("echo", TRICKY), None, [call("echo", TRICKY)]),
    "hermes raw unicode": ("hermes", '<tool_call>\n{"name": "echo", "arguments": {"text": "café 😀 \\"q\\""}}\n</tool_call>',
                           None, [("echo", '{"text": "café 😀 \\"q\\""}')]),
    "hermes arguments as a string": (
        "hermes", '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris \\ud83d\\ude00\\"}"}\n</tool_call>',
        None, [("get_weather", '{"city": "Paris 😀"}')]),
    "hermes compact and no newlines": ("hermes", '<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>', None, [("f", '{"a":1}')]),
    "hermes malformed": ("hermes", '<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call>',
                         '<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call>', []),
    "hermes missing name": ("hermes", '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',
                            '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>', []),
    "hermes marker in prose": ("hermes", "Wrap calls in <tool_call> tags.", "Wrap calls in <tool_call> tags.", []),
    "hermes no call": ("hermes", "The weather in Paris is sunny.\n", "The weather in Paris is sunny.\n", []),
    "hermes cut off": ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
                       None, [("get_weather", '{"city": "Par')]),
    "llama3 one call": ("llama3_json", llama("get_weather", WEATHER), None, [call("get_weather", WEATHER)]),
    "llama3 python tag": ("llama3_json", "<|python_tag|>" + llama("get_weather", WEATHER), None, [call("get_weather", WEATHER)]),
    "llama3 two calls": ("llama3_json", llama("get_weather", WEATHER) + "; " + llama("get_time", {"tz": "UTC"}), None,
                         [call("get_weather", WEATHER), call("get_time", {"tz": "UTC"})]),
    "llama3 leading whitespace": ("llama3_json", "\n\n" + llama("search", NESTED), None, [call("search", NESTED)]),
    "llama3 tricky strings": ("llama3_json", llama("echo", TRICKY), None, [call("echo", TRICKY)]),
    "llama3 content first": ("llama3_json", "I will call " + llama("get_weather", WEATHER),
                             "I will call " + llama("get_weather", WEATHER), []),
    "llama3 content then tag": ("llama3_json", "Checking.<|python_tag|>" + llama("get_weather", WEATHER),
                                "Checking.", [call("get_weather", WEATHER)]),
    "llama3 other json": ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    "llama3 malformed": ("llama3_json", '{"name": "get_weather", "parameters": [1]}', '{"name": "get_weather", "parameters": [1]}', []),
    "llama3 no call": ("llama3_json", "It is sunny in Paris.", "It is sunny in Paris.", []),
    "mistral one call": ("mistral", mistral(("get_weather", WEATHER)), None, [call("get_weather", WEATHER)]),
    "mistral two calls": ("mistral", mistral(("get_weather", WEATHER), ("get_time", {"tz": "UTC"})), None,
                          [call("get_weather", WEATHER), call("get_time", {"tz": "UTC"})]),
    "mistral content first": ("mistral", "Sure, checking. " + mistral(("search", NESTED)), "Sure, checking.",
                              [call("search", NESTED)]),
    "mistral tricky strings": ("mistral", mistral(("echo", TRICKY)), None, [call("echo", TRICKY)]),
    "mistral args format": ("mistral", f"[TOOL_CALLS]get_weather[ARGS]{json.dumps(WEATHER)}", None, [call("get_weather", WEATHER)]),
    "mistral args format twice": ("mistral", f"[TOOL_CALLS]echo[ARGS]{json.dumps(TRICKY)}[TOOL_CALLS]search[ARGS]{json.dumps(NESTED)}",
                                  None, [call("echo", TRICKY), call("search", NESTED)]),
    "mistral malformed": ("mistral", '[TOOL_CALLS][{"name": 5, "arguments": {}}]', '[TOOL_CALLS][{"name": 5, "arguments": {}}]', []),
    "mistral no call": ("mistral", "[INST] is how prompts look.", "[INST] is how prompts look.", []),
}


def stream_all(parser, chunks, cut=False):
    """Feed chunks, then finish (`cut`: by max_tokens): (content, deltas, the stream)."""
    stream = parser.stream()
    outputs = [stream.feed(chunk) for chunk in chunks] + [stream.finish(cut)]
    return "".join(content for content, _ in outputs), [d for _, deltas in outputs for d in deltas], stream


def calls_from_deltas(deltas: list[ToolCallDelta]) -> list[tuple[str, str, str]]:
    """What a client assembles from streamed deltas: (id, name, arguments) per call."""
    calls: dict[int, list] = {}
    for delta in deltas:
        if delta.id is not None:
            assert delta.index not in calls, "a call's id and name come once"
            calls[delta.index] = [delta.id, delta.name, ""]
        calls[delta.index][2] += delta.arguments
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("fixture", FIXTURES)
def test_recorded_replies_parse_into_content_and_calls(fixture):
    family, text, content, calls = FIXTURES[fixture]
    parsed_content, parsed = PARSERS[family].parse(text)
    assert parsed_content == content
    assert [(c.name, c.arguments) for c in parsed] == calls
    for c in parsed:
        assert c.id.startswith("call_") and len(c.id) == 29
    assert len({c.id for c in parsed}) == len(parsed)


@pytest.mark.parametrize("fixture", FIXTURES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_split_streams_what_parse_reads(fixture, data):
    family, text, _, _ = FIXTURES[fixture]
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=len(text) // 2)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    content, calls = PARSERS[family].parse(text)
    streamed_content, deltas, stream = stream_all(PARSERS[family], chunks)
    assert streamed_content == (content or "")
    streamed = calls_from_deltas(deltas)
    assert [(name, args) for _, name, args in streamed] == [(c.name, c.arguments) for c in calls]
    assert [(c.id, c.name, c.arguments) for c in stream.calls] == streamed


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", '{"name": "f", ',
             '"arguments": ', '"parameters": ', "{", "}", "[", "]", '"', "\\", "\\u00e9", "\\ud83d", ", ", "; ", " ", "\n", "x", "é"]


@settings(max_examples=300, deadline=None)
@given(family=st.sampled_from(sorted(PARSERS)), pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=25), data=st.data())
def test_any_text_is_read_without_error_and_streams_alike(family, pieces, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=8)))
    content, calls = PARSERS[family].parse(text)
    streamed_content, deltas, _ = stream_all(PARSERS[family], [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    assert streamed_content == (content or "")
    assert [(n, a) for _, n, a in calls_from_deltas(deltas)] == [(c.name, c.arguments) for c in calls]
    if not calls:
        assert (content or "") == text  # nothing that is not a call is lost


@pytest.mark.parametrize("fixture", FIXTURES)
def test_a_reply_cut_anywhere_keeps_its_finished_calls_and_shows_no_half_call(fixture):
    """Cut by max_tokens at any character, a recorded reply's content is a start of its whole content
    (no marker's start, half head or half close in it) and its calls are the finished ones."""
    family, text, content, calls = FIXTURES[fixture]
    for end in range(len(text) + 1):
        cut_content, cut_calls = PARSERS[family].parse(text[:end], cut=True)
        assert (content or "").startswith((cut_content or "").rstrip()), text[:end]
        assert [(c.name, c.arguments) for c in cut_calls] == calls[:len(cut_calls)], text[:end]
        for c in cut_calls:
            json.loads(c.arguments)


@settings(max_examples=300, deadline=None)
@given(family=st.sampled_from(sorted(PARSERS)), pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=25), data=st.data())
def test_a_cut_reply_streams_alike_and_loses_only_its_unfinished_tail(family, pieces, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=8)))
    content, calls = PARSERS[family].parse(text, cut=True)
    streamed_content, deltas, stream = stream_all(PARSERS[family], [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])],
                                                  cut=True)
    read = [(c.name, c.arguments) for c in calls]
    assert streamed_content == (content or "") and [(c.name, c.arguments) for c in stream.calls] == read
    sent = [(n, a) for _, n, a in calls_from_deltas(deltas)]
    assert sent[:len(read)] == read and len(sent) <= len(read) + 1  # a cut call's pieces, once sent, stay sent
    whole_content, whole_calls = PARSERS[family].parse(text)
    assert (whole_content or "").startswith((content or "").rstrip())
    assert [(c.name, c.arguments) for c in whole_calls][:len(read)] == read


def test_a_repeated_call_is_never_sent_and_one_that_differs_streams_once_it_does():
    stream = PARSERS["hermes"].stream()
    paris = hermes("get_weather", {"city": "Paris"})
    assert [(d.index, d.name, d.arguments) for d in stream.feed(paris + "\n")[1]] == [(0, "get_weather", '{"city": "Paris"}')]
    assert stream.feed(paris[:paris.index("ris")]) == ("", [])  # the same call so far: it waits
    assert stream.feed(paris[paris.index("ris"):] + "\n") == ("", [])  # the same call: dropped
    oslo = hermes("get_weather", {"city": "Oslo"})
    assert stream.feed(oslo[:oslo.index("Oslo")]) == ("", [])
    content, deltas = stream.feed("Os")  # it differs: sent, and the rest streams as it comes
    assert (content, [(d.index, d.name, d.arguments) for d in deltas]) == ("", [(1, "get_weather", '{"city": "Os')])
    assert stream.feed(oslo[oslo.index("Oslo") + 2:]) == ("", [ToolCallDelta(1, arguments='lo"}')])
    assert stream.finish() == ("", [])
    assert [c.arguments for c in stream.calls] == ['{"city": "Paris"}', '{"city": "Oslo"}']


def test_a_parser_bound_to_one_call_reads_only_the_first():
    for family in sorted(PARSERS):
        parser = PARSERS[family].for_tools({"get_weather", "now"}, parallel=False)
        text = render(family, [("get_weather", {"city": "Paris"}), ("now", {})])
        for split in (None, *range(1, len(text))):
            chunks = [text] if split is None else [text[:split], text[split:]]
            content, deltas, stream = stream_all(parser, chunks)
            assert content == "" and [(n, a) for _, n, a in calls_from_deltas(deltas)] == [("get_weather", '{"city": "Paris"}')]
        assert [c.name for c in parser.parse(text)[1]] == ["get_weather"]


def test_content_is_sent_at_once_and_only_a_possible_marker_is_held_back():
    stream = PARSERS["hermes"].stream()
    assert stream.feed("Checking the weather") == ("Checking the weather", [])
    assert stream.feed(" now <tool") == (" now", [])  # the space waits: it may only separate text from a call
    assert stream.feed("s>") == (" <tools>", [])  # not a marker after all
    assert stream.finish() == ("", [])


def test_a_call_is_named_before_its_arguments_finish_and_they_arrive_in_pieces():
    stream = PARSERS["hermes"].stream()
    assert stream.feed('<tool_call>\n{"name": "get_weather", "argu') == ("", [])
    content, deltas = stream.feed('ments": {"city": "Pa')
    assert content == "" and len(deltas) == 1
    first = deltas[0]
    assert (first.index, first.name, first.arguments) == (0, "get_weather", '{"city": "Pa')
    assert first.id == stream.calls[0].id
    assert stream.feed('ris"}}\n</tool_call>') == ("", [ToolCallDelta(0, arguments='ris"}')])
    assert stream.finish() == ("", [])
    assert stream.calls[0].arguments == '{"city": "Paris"}'


def test_text_after_the_calls_is_content():
    content, calls = PARSERS["hermes"].parse(hermes("f", {}) + "\n\nDone, see above.")
    assert content == "Done, see above." and [c.name for c in calls] == ["f"]


@pytest.mark.parametrize("template, family", [
    ("{% for m in messages %}<|im_start|>{{ m.role }}{% if m.tool_calls %}<tool_call>\n{{ m }}{% endif %}{% endfor %}", "hermes"),
    ("{{- bos_token }}{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
    ("<|start_header_id|>{{ m.role }}<|end_header_id|>{%- if m.role == 'ipython' %}{{ m.content }}{% endif %}", "llama3_json"),
    ("<|start_header_id|>assistant<|end_header_id|>{{ '<|python_tag|>' + call }}", "llama3_json"),
    ("<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}<|eot_id|>", "hermes"),
    ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}", "hermes"),
])
def test_a_template_names_its_family_and_hermes_is_the_default(template, family):
    assert parser_for_template(template) == family


def test_families_whose_markers_are_special_tokens_ask_to_keep_them():
    assert not PARSERS["hermes"].needs_special_tokens
    assert PARSERS["mistral"].needs_special_tokens and PARSERS["llama3_json"].needs_special_tokens


# Grammars, checked by llguidance with the demo model's tokenizer.

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather {today} in a \"city\"", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 7}},
                   "required": ["city"], "additionalProperties": False}}}
NOW_TOOL = {"type": "function", "function": {"name": "now"}}  # no parameters: any object
REF_TOOL = {"type": "function", "function": {"name": "place", "parameters": {
    "type": "object", "properties": {"at": {"$ref": "#/$defs/point"}}, "required": ["at"],
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}}}}
TOOLS = [WEATHER_TOOL, NOW_TOOL, REF_TOOL]
MARKERS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"]


def render(family: str, calls: list[tuple[str, dict]], args_format: bool = False) -> str:
    """Calls written as each family's model writes them."""
    if family == "hermes":
        return "\n".join(hermes(n, a) for n, a in calls)
    if family == "llama3_json":
        return "; ".join(llama(n, a) for n, a in calls)
    if args_format:
        return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)
    return mistral(*calls)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The demo tokenizer as llguidance sees it: as built (the markers are plain text), and with the
    markers added as special tokens, with their ids."""
    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(folder)
    plain = transformers.AutoTokenizer.from_pretrained(folder)
    special = transformers.AutoTokenizer.from_pretrained(folder)
    special.add_special_tokens({"additional_special_tokens": MARKERS})
    ids = {marker: special.convert_tokens_to_ids(marker) for marker in MARKERS}
    special_tok = llguidance.hf.from_tokenizer(special, n_vocab=len(special))
    assert all(special_tok.is_special_token(i) for i in ids.values())
    return llguidance.hf.from_tokenizer(plain, n_vocab=len(plain)), special_tok, ids


def accepts(tok, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tok, grammar)
    return matcher.consume_tokens(tok.tokenize_str(text)) and matcher.is_accepting()


GOOD = [("get_weather", {"city": "Paris", "days": 3})]
TWO = [("get_weather", {"city": "Paris"}), ("now", {})]
REFUSED = {
    "unknown function": [("get_wether", {"city": "Paris"})],
    "wrong type": [("get_weather", {"city": 5})],
    "over the maximum": [("get_weather", {"city": "Paris", "days": 8})],
    "missing required": [("get_weather", {"days": 1})],
    "unknown argument": [("get_weather", {"city": "Paris", "country": "FR"})],
    "bad $ref target": [("place", {"at": {"x": "far"}})],
}


@pytest.mark.parametrize("family", sorted(PARSERS))
@pytest.mark.parametrize("special", [False, True], ids=["text markers", "special-token markers"])
def test_the_call_grammar_forces_one_valid_call_in_the_family_format(tokenizers, family, special):
    plain_tok, special_tok, ids = tokenizers
    tok, token_ids = (special_tok, ids) if special else (plain_tok, {})
    parser = PARSERS[family]
    args_format = family == "mistral" and special  # a tokenizer with [ARGS] gets the newer format
    single = parser.call_grammar(TOOLS, False, token_ids)
    parallel = parser.call_grammar(TOOLS, True, token_ids)
    if special and family != "llama3_json":
        assert f"<[{ids[next(iter(parser.markers))]}]>" in single
    for grammar in (single, parallel):
        assert llguidance.LLMatcher.validate_grammar(grammar, tok) == ""
        assert accepts(tok, grammar, render(family, GOOD, args_format))
        assert accepts(tok, grammar, render(family, [("now", {"any": [1]})], args_format))
        assert accepts(tok, grammar, render(family, [("place", {"at": {"x": 1.5}})], args_format))
        for case, calls in REFUSED.items():
            assert not accepts(tok, grammar, render(family, calls, args_format)), case
        assert not accepts(tok, grammar, "The weather is fine.")
    assert accepts(tok, parallel, render(family, TWO, args_format))
    assert not accepts(tok, single, render(family, TWO, args_format))
    # What the grammar lets through, the parser reads back as the same calls.
    _, calls = parser.parse(render(family, TWO, args_format))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == TWO


def test_the_grammar_wants_natural_json_spacing(tokenizers):
    tok = tokenizers[0]
    grammar = PARSERS["hermes"].call_grammar([WEATHER_TOOL], False, {})
    assert not accepts(tok, grammar, '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>')


@settings(max_examples=200, deadline=None)
@given(family=st.sampled_from(sorted(PARSERS)), pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=25), data=st.data())
def test_a_parser_bound_to_other_functions_reads_any_text_as_content(family, pieces, data):
    text = "".join(pieces)  # every call in FRAGMENTS names f
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=8)))
    parser = PARSERS[family].for_tools({"g"})
    assert parser.parse(text) == ((text or None), [])
    streamed_content, deltas, _ = stream_all(parser, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    assert (streamed_content, deltas) == (text, [])


def test_a_bound_parser_reads_calls_only_to_the_offered_functions():
    """A call to a function nobody offered stays content, whole or streamed in any split; the
    offered calls beside it are read as before."""
    text = "Sure. " + hermes("transfer_money", {"to": "mallory", "amount": 10 ** 6})
    parser = PARSERS["hermes"].for_tools({"get_weather"})
    assert parser.parse(text) == (text, [])
    assert PARSERS["hermes"].parse(text)[1][0].name == "transfer_money"  # unbound: any name, as before
    for cut in range(1, len(text)):
        content, deltas, _ = stream_all(parser, [text[:cut], text[cut:]])
        assert (content, deltas) == (text, [])
    llama_two = llama("get_weather", WEATHER) + "; " + llama("transfer_money", {"to": "mallory"})
    content, calls = PARSERS["llama3_json"].for_tools({"get_weather"}).parse(llama_two)
    assert [c.name for c in calls] == ["get_weather"] and "transfer_money" in content
    content, calls = PARSERS["mistral"].for_tools({"get_weather"}).parse(mistral(("transfer_money", {}), ("get_weather", WEATHER)))
    assert calls == [] and "transfer_money" in content


def test_only_json_whitespace_separates_a_call_from_what_comes_before():
    # The grammars can exclude these exactly; str.isspace() knows dozens more.
    assert PARSERS["llama3_json"].parse(" \n\t" + llama("f", {}))[1]
    assert not PARSERS["llama3_json"].parse("\xa0" + llama("f", {}))[1]


@pytest.mark.parametrize("family", sorted(PARSERS))
@pytest.mark.parametrize("special", [False, True], ids=["text markers", "special-token markers"])
def test_the_auto_grammar_allows_text_or_valid_calls_and_no_stray_marker(tokenizers, family, special):
    plain_tok, special_tok, ids = tokenizers
    tok, token_ids = (special_tok, ids) if special else (plain_tok, {})
    parser = PARSERS[family]
    args_format = family == "mistral" and special
    before = "" if family == "llama3_json" else "Let me check that. "  # llama3's calls open the reply
    single, parallel = parser.auto_grammar(TOOLS, False, token_ids), parser.auto_grammar(TOOLS, True, token_ids)
    for grammar in (single, parallel):
        assert llguidance.LLMatcher.validate_grammar(grammar, tok) == ""
        for text in ("The weather is fine.", "", "Tags look like <b> or [INST]; braces {like} this.", "a < b", "x {"):
            assert accepts(tok, grammar, text), text
        assert accepts(tok, grammar, before + render(family, GOOD, args_format))
        for case, calls in REFUSED.items():
            assert not accepts(tok, grammar, before + render(family, calls, args_format)), case
        for marker in parser.markers:  # a marker in text is the start of a real call, or is not written
            assert not accepts(tok, grammar, f"Wrap calls in {marker} tags.")
    assert accepts(tok, parallel, before + render(family, TWO, args_format))
    assert not accepts(tok, single, before + render(family, TWO, args_format))
    content, calls = parser.parse(before + render(family, TWO, args_format))
    assert (content or "") == before.strip() and [(c.name, json.loads(c.arguments)) for c in calls] == TWO
    if family == "llama3_json":  # a reply that starts with a JSON object is a call
        for text in ('{"answer": 42}', ' \n {"answer": 42}'):
            assert not accepts(tok, single, text)


def test_beside_a_json_format_the_auto_grammar_allows_that_format_or_calls(tokenizers):
    tok = tokenizers[0]
    reply_format = '%json {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    grammar = PARSERS["hermes"].auto_grammar(TOOLS, False, {}, reply_format)
    assert accepts(tok, grammar, '{"a": 1}') and accepts(tok, grammar, render("hermes", GOOD))
    assert not accepts(tok, grammar, "Free text.") and not accepts(tok, grammar, '{"b": 1}')
    assert not accepts(tok, grammar, render("hermes", REFUSED["unknown function"]))
