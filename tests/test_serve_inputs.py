"""What a client can send the server, in this process: bodies decoded and checked (finite numbers, UTF-8, whole
characters, bounded nesting), the limits every float and length meets before a row reaches a rank, the per-row rules
that end a row with nothing left to sample, a completion's text as clients rebuild it on three tokenizer families,
chat content parts, and a model directory the server cannot serve."""

import json
import random

import pytest
import torch
from serving import admit
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from conftest import EXAMPLES
from ds_inference_integration import InferenceSetupError
from ds_inference_integration.serve import bodies
from ds_inference_integration.serve.batching import Job, Queue
from ds_inference_integration.serve.engine import keepalive_seconds, run_batch
from ds_inference_integration.serve.protocol import (
    Asked,
    BatchKey,
    ModelLimits,
    Row,
    ServeError,
    check_count,
    completion_prompts,
    plan_rows,
)
from ds_inference_integration.serve.rules import Refused, sample, unusable
from ds_inference_integration.serve.settings import ServeArguments, model_limits, read_model_dir
from ds_inference_integration.serve.text import (
    CONTEXT_TOKENS,
    Offsets,
    Texts,
    completion_text,
    join_parts,
    template_reads_parts,
)
from ds_inference_integration.serve.wire import RowSpec

GPT2 = EXAMPLES / "models" / "gpt2-num2words-en-ro"
T5 = EXAMPLES / "models" / "t5-num2words-en-ro"
LIMITS = ModelLimits(encoder_decoder=False, max_positions=64, max_source_positions=None, max_n=4, max_batch_size=8,
                     default_max_tokens=16, vocab_size=72)


def _refused(raw: bytes, *words: str) -> ServeError:
    with pytest.raises(ServeError) as e:
        bodies.decode(raw)
    assert e.value.status == 400 and "\n" not in e.value.message, e.value.message
    assert all(w in e.value.message for w in words), e.value.message
    return e.value


def test_a_body_holds_json_with_finite_numbers_whole_characters_and_bounded_nesting():
    """Python's parser reads NaN, Infinity and 1e999, which JSON has not: a NaN temperature passed every range check
    (a short garbage answer on one run, the server ended on another). A lone surrogate reached the tokenizer (500);
    a body that is not UTF-8 or nests deeply got FastAPI's {"detail": ...}."""
    for raw, word in ((b'{"temperature": NaN}', "NaN"), (b'{"top_p": Infinity}', "Infinity"),
                      (b'{"length_penalty": -Infinity}', "-Infinity"), (b'{"temperature": 1e999}', "1e999"),
                      (b'{"seed": ' + b"9" * 5000 + b"}", "digits")):
        _refused(raw, word, "valid: a JSON object")
    _refused(b'{"prompt": "se\xffven"}', "not UTF-8", "0xff", "offset 14")
    _refused(b"[" * 65 + b"]" * 65, "64 levels")
    _refused(b'{"prompt": [' + b",".join([b"[]"] * 100_001) + b"]}", "100003 arrays, objects or brackets")  # counted
    _refused(b"[" * 90_000 + b"]" * 90_000, "levels")  # the parser's own recursion limit, not a crash
    error = _refused(b'{"prompt": ["ok", "a\\ud800b"]}', "prompt.1", "lone surrogate", "U+D800")
    assert error.param == "prompt.1"
    _refused(b"", "empty")
    assert bodies.decode(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001F600"}  # a pair is one character
    assert bodies.decode("\ufeff{\"a\": 1}".encode()) == {"a": 1}  # a byte-order mark, as JSON parsers may accept
    big = {"prompt": [[i % 70 for i in range(50)] for _ in range(2000)], "temperature": 0.5, "x": [{"y": None}]}
    raw = json.dumps(big).encode()
    assert len(raw) > bodies.C_PARSER_BYTES and bodies.decode(raw) == big  # the pure-Python scanner: the same value
    _refused(raw.replace(b"0.5", b"NaN"), "NaN")  # and the same checks


def test_a_big_body_is_decoded_by_the_scanner_that_lets_the_event_loop_in(monkeypatch):
    """A body over C_PARSER_BYTES goes to the standard library's pure-Python scanner (its longest hold of Python's
    lock was 6-15 ms; the C parser held it 36 ms per MB of integers in one call, the event loop waiting throughout:
    bodies.py's docstring), a small one to the C parser."""
    import inspect

    seen = []
    for name in ("_C_DECODER", "_PY_DECODER"):
        decoder = getattr(bodies, name)
        monkeypatch.setattr(decoder, "decode", lambda text, name=name, decode=decoder.decode: seen.append(name) or
                            decode(text))
    numbers = b'{"prompt": [' + b",".join([b"5"] * 40_000) + b'], "max_tokens": 2}'
    assert len(numbers) > bodies.C_PARSER_BYTES
    assert bodies.decode(b'{"prompt": [5, 5]}') == {"prompt": [5, 5]} and len(bodies.decode(numbers)["prompt"]) == 40_000
    assert seen == ["_C_DECODER", "_PY_DECODER"]
    assert inspect.isfunction(bodies._PY_DECODER.scan_once) and not inspect.isfunction(bodies._C_DECODER.scan_once)


def test_a_refused_body_is_emptied_slice_by_slice():
    """bodies.release empties a refused body's containers a slice at a time (a million lists freed in one go held the
    event loop 176 ms under load: the launched /live test measures the lock), the request model's fields and the
    unknown ones it kept included, so nothing of it is left for one long free or the collector."""
    from ds_inference_integration.serve.protocol import CompletionRequest

    value = bodies.decode(('{"prompt": [' + ",".join(["[[1], {}]"] * 30_000) + '], "extra": [[2]]}').encode())
    body = CompletionRequest.model_validate(value)
    inner = body.prompt[0]
    bodies.release(body)
    assert body.prompt == [] and body.model_extra["extra"] == [] and value == {"prompt": [], "extra": []}
    assert inner == []  # emptied too, not only dropped from its parent


def test_prompts_are_counted_before_they_are_tokenized():
    """400,000 prompts in one request took the front 18.6 s and 2.4 GB to tokenize before the count refused them;
    the count comes first now. A prompt's forms are checked in Python (a bool is not a token id)."""
    assert completion_prompts("a") == ["a"] and completion_prompts([1, 2]) == [[1, 2]]
    assert completion_prompts(["a", "b"]) == ["a", "b"] and completion_prompts([[1], [2, 3]]) == [[1], [2, 3]]
    for bad, where in (([True, 2], "prompt.0"), ([[1], ["a"]], "prompt.1"), ({"a": 1}, "prompt {"), ([], "prompt []"),
                       ([1.5], "prompt.0"), ([[]], "prompt.0")):
        with pytest.raises(ServeError, match=r"valid: a string, a list of strings") as e:
            completion_prompts(bad)
        assert e.value.message.startswith(where), e.value.message
    with pytest.raises(ServeError, match=r"400000 prompt\(s\) x n 1 = 400000 sequences; valid: at most 8"):
        check_count(400_000, 1, False, LIMITS)
    check_count(400, 1, True, ModelLimits(**{**LIMITS.__dict__, "max_batch_size": 400}))
    # a request a batch of its own would take past --max_batch_tokens was run past it (a batch takes its first job
    # whatever its size): refused, naming the budget
    budget = ModelLimits(**{**LIMITS.__dict__, "max_batch_tokens": 40})
    with pytest.raises(ServeError, match=r"4 sequence\(s\) x \(3 prompt \+ 8 new tokens\) = 44 padded tokens; valid: "
                                         r"at most 40 \(--max_batch_tokens\)"):
        _plan(limits=budget, n=4, temperature=1.0)
    _plan(limits=budget, n=3, temperature=1.0)


def _plan(limits=LIMITS, **kw):
    return plan_rows([[5, 6, 7]], Asked(**{"max_tokens": 8, **kw}), limits)


def test_presence_and_frequency_penalties_are_checked_and_reach_the_rows():
    """OpenAI's range (-2 to 2), refused with beams (generate's beam scores have no such rule), else on every row."""
    key, rows = _plan(sampling={"presence_penalty": 0.5, "frequency_penalty": -2}, n=2, temperature=1.0)
    assert [(r.presence_penalty, r.frequency_penalty) for r in rows] == [(0.5, -2.0)] * 2
    assert (rows[0].spec(7).presence_penalty, rows[0].spec(7).frequency_penalty) == (0.5, -2.0)
    for name in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(ServeError, match=rf"^{name} 2.5 is out of range; valid: -2 to 2 \(0: none\)$"):
            _plan(sampling={name: 2.5})
        with pytest.raises(ServeError, match=rf"^{name} 'x' is out of range; valid: -2 to 2 \(0: none\)$"):
            _plan(sampling={name: "x"})
        with pytest.raises(ServeError, match=rf"^{name} 1.0 with beam search: .* valid: 0, or num_beams 1"):
            _plan(sampling={name: 1}, num_beams=2)
    _plan(num_beams=2, sampling={"presence_penalty": 0.0, "frequency_penalty": 0})


def test_min_p_is_checked_and_reaches_the_rows():
    """vLLM's range (0 to 1), refused with beams at any other value than 0; on every row of the request."""
    key, rows = _plan(sampling={"min_p": 0.25}, n=2, temperature=1.0)
    assert [r.spec(3).min_p for r in rows] == [0.25, 0.25]
    for bad in (1.5, -0.1, "x", True):
        with pytest.raises(ServeError, match=r"^min_p .* is out of range; valid: 0 to 1 \(0: none\)$"):
            _plan(sampling={"min_p": bad})
    with pytest.raises(ServeError, match=r"^min_p 0.1 with beam search: .* valid: 0, or num_beams 1"):
        _plan(sampling={"min_p": 0.1}, num_beams=2)
    _plan(sampling={"min_p": 0}, num_beams=2)


def test_powers_a_beam_score_cannot_survive_are_refused_with_the_range_that_can():
    """length_penalty 1000 made transformers' beam search raise OverflowError ((length) ** 1000) in every rank, which
    ended the server; the range that float32 scores survive at the request's max_tokens is the valid one."""
    for penalty in (1000, -1000, 1e308, -1e308):
        with pytest.raises(ServeError, match=r"length_penalty is too large .* valid: -31\.4 to 31\.4 with max_tokens 8"):
            _plan(num_beams=2, length_penalty=penalty)
    _plan(num_beams=2, length_penalty=31.0)
    _plan(length_penalty=1000)  # greedy rows do not use it
    with pytest.raises(ServeError, match="factor up to 5.623 with max_tokens 40") as e:
        _plan(max_tokens=40, generate={"exponential_decay_length_penalty": [1, 1e10]})
    assert e.value.param == "parameters.exponential_decay_length_penalty"
    _plan(max_tokens=40, generate={"exponential_decay_length_penalty": [1, 1.5]})


def test_sampling_at_a_vanishing_temperature_is_the_limit_not_a_nan():
    """temperature 1e-40 is inside the documented range; scores / temperature overflowed float32 and the draw failed
    on NaN. Where it overflows the draw is the limit (the top token); elsewhere generate's own arithmetic."""
    scores = torch.tensor([1.0, 3.0, -2.0, 2.9])

    def row(temperature):
        return RowSpec(id=0, prompt_ids=(1,), max_new_tokens=1, temperature=temperature)

    for temperature in (1e-40, 1e-300, 5e-324, 1e-38):
        g = torch.Generator().manual_seed(0)
        assert sample(scores, row(temperature), g) == 1, temperature
    negative = torch.tensor([-5.0, -1.0, -3.0])  # every score / 1e-40 is -inf: the limit again
    assert sample(negative, row(1e-40), torch.Generator().manual_seed(0)) == 1
    draws = {sample(scores, row(5.0), torch.Generator().manual_seed(s)) for s in range(40)}
    assert len(draws) > 1  # an ordinary temperature still samples


def test_a_row_with_nothing_left_to_take_ends_alone_and_a_beam_batch_is_refused():
    """Scores that are NaN are the model's (500), every token masked the request's (400). In a batch, the row whose
    rules mask every token (stop_token_ids covering the vocabulary, held back by min_tokens) ends with that error at
    its first step, and the row beside it generates exactly what it generates alone; a beam batch whose request has
    nothing left is refused on every rank alike."""
    scores = torch.tensor([[0.0, 1.0], [float("nan"), 1.0], [-float("inf"), -float("inf")], [float("inf"), 0.0]])
    verdicts = unusable(scores, 2)
    assert verdicts[0] is None and verdicts[1][0] == 500 and verdicts[2][0] == 400 and verdicts[3][0] == 500
    assert "at new token 3" in verdicts[2][1]
    tokenizer = AutoTokenizer.from_pretrained(GPT2)
    model = AutoModelForCausalLM.from_pretrained(GPT2).eval()
    ids = tokenizer("five hundred")["input_ids"]
    vocab = list(range(model.config.vocab_size))
    masked = Row(prompt_ids=ids, max_new_tokens=6, temperature=1.0, seed=3, min_tokens=2, stop_token_ids=tuple(vocab))
    good = Row(prompt_ids=ids, max_new_tokens=6, temperature=0.8, seed=4)
    both = run_batch(model, tokenizer, admit([masked, good]), "cpu")
    alone = run_batch(model, tokenizer, admit([good]), "cpu")
    assert both["finish"][0] == ["error"] and both["failed"][0][0] == 400 and "every token is masked" in both["failed"][0][1]
    assert both["sequences"][0] == [[]]
    assert both["sequences"][1] == alone["sequences"][0] and len(alone["sequences"][0][0]) == 6
    beams = admit([Row(prompt_ids=ids, max_new_tokens=6)], num_beams=2,
                  generate=(("suppress_tokens", json.dumps(vocab)),))
    with pytest.raises(Refused, match="prompt 0: every token is masked") as e:
        run_batch(model, tokenizer, beams, "cpu")
    assert e.value.status == 400


def test_a_replica_says_it_is_alive_well_within_the_timeout():
    """The front takes a replica silent for --inference_timeout for a stopped one: at 1 s, the leader's one message a
    second arrived just past it, and an idle server ended (exit 3) within seconds of starting."""
    assert keepalive_seconds(120) == 1.0 and keepalive_seconds(1) == 0.25 and keepalive_seconds(3) == 0.75


def test_a_failed_batch_runs_each_request_again_alone_first():
    q = Queue(max_batch_size=8, max_batch_tokens=None, max_wait_ms=20, max_queue=10, adaptive_wait=False)
    jobs = [Job(key=BatchKey(), rows=[Row(prompt_ids=[1], max_new_tokens=2)], arrived=0.0) for _ in range(3)]
    later = Job(key=BatchKey(), rows=[Row(prompt_ids=[1], max_new_tokens=2)], arrived=0.5)
    for job in jobs:
        q.add(job)
    assert q.take(now=1.0).jobs == jobs
    q.add(later)
    q.retry_alone(jobs[:2])  # the third was answered before the batch failed
    assert [q.take(now=1.0).jobs for _ in range(2)] == [[jobs[0]], [jobs[1]]]  # each alone, at once, in order
    assert q.take(now=1.0).jobs == [later]


# Text as clients rebuild it ------------------------------------------------------------------------------------

def _sentences() -> list[str]:
    data = (EXAMPLES / "data" / "num2words" / "train.json").read_text(encoding="utf-8").splitlines()[:300]
    pairs = [json.loads(line)["translation"] for line in data]
    return [p["en"] for p in pairs] + [p["ro"] for p in pairs] + ["naïve café — ünïcödé 😀 ok.", "a , b . c ! d"]


@pytest.fixture(scope="module")
def tokenizer_families():
    """A byte-level BPE (GPT-2's kind), a SentencePiece BPE with the metaspace (T5's, Llama's kind) and a WordPiece
    (BERT's), trained here on the embedded data, and the embedded models' own (word-level, WordPiece's decoder)."""
    from tokenizers import BertWordPieceTokenizer, ByteLevelBPETokenizer, SentencePieceBPETokenizer

    texts = _sentences()
    families = {}
    for name, trained in (("byte_level_bpe", ByteLevelBPETokenizer()), ("metaspace", SentencePieceBPETokenizer()),
                          ("wordpiece", BertWordPieceTokenizer())):
        trained.train_from_iterator(texts, vocab_size=400, min_frequency=1)
        families[name] = PreTrainedTokenizerFast(tokenizer_object=trained._tokenizer)
    families["embedded"] = AutoTokenizer.from_pretrained(GPT2)
    return families


def _completions(tokenizer, rng, n: int, prompt_texts: int, words: int, lengths: tuple, random_lengths: tuple):
    """`n` (prompt ids, completion ids): a prompt of `prompt_texts` of the sentences, a completion of their first
    `lengths` tokens (a range) of `words` sentences, or (3 in 10) random ids as a model may make them, not as text
    tokenizes (`random_lengths` of them: some cut characters)."""
    texts = _sentences()
    for _ in range(n):
        prompt = tokenizer(" ".join(rng.choice(texts) for _ in range(prompt_texts)),
                           add_special_tokens=False)["input_ids"]
        completion = tokenizer(" " + " ".join(rng.choice(texts) for _ in range(words)),
                               add_special_tokens=False)["input_ids"][:rng.randint(*lengths)]
        if rng.random() < 0.3:
            completion = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(*random_lengths))]
        yield prompt, completion


@pytest.mark.parametrize("family", ["byte_level_bpe", "metaspace", "wordpiece", "embedded"])
def test_completion_text_is_what_the_completion_adds_to_the_prompts_text(tokenizer_families, family):
    """The rule OpenAI's and vLLM's servers follow: prompt text + completion text = the decoded prompt + completion
    (streamed deltas likewise, joined); the prompt's last CONTEXT_TOKENS tokens stand for the whole prompt. Decoding
    the completion alone, as this did, dropped the space between them: "five hundred" + "and and" came back "and
    and"."""
    tokenizer = tokenizer_families[family]
    lost_space = 0
    for prompt, completion in _completions(tokenizer, random.Random(0), 150, 2, 1, (1, 12), (1, 6)):
        head = tokenizer.decode(prompt, skip_special_tokens=True)
        whole = tokenizer.decode(prompt + completion, skip_special_tokens=True)
        text = completion_text(tokenizer, prompt[-CONTEXT_TOKENS:], completion)
        if whole.startswith(head):
            assert head + text == whole, (head, text, whole)
        assert text == completion_text(tokenizer, prompt, completion)  # the window stands for the whole prompt
        streamed = Texts(tokenizer, (), prompt[-CONTEXT_TOKENS:])
        joined = "".join(streamed.delta(completion[:i]) for i in range(1, len(completion) + 1))
        assert joined + streamed.rest(completion) == text
        decodes = []
        counted = Texts(type("Counted", (), {"decode": lambda self, ids, **kw: decodes.append(ids) or tokenizer.decode(
            ids, **kw)})(), (), prompt[-CONTEXT_TOKENS:])
        decodes.clear()
        counted.delta(completion)
        assert len(decodes) == 1  # the prompt's text is decoded once per row, not again for every delta
        lost_space += text != tokenizer.decode(completion, skip_special_tokens=True)
    if family != "byte_level_bpe":  # byte-level tokens carry their own leading space ("Ġand")
        assert lost_space > 0  # decoding alone differs: the rule matters for this family


@pytest.mark.parametrize("family", ["byte_level_bpe", "metaspace", "wordpiece", "embedded"])
def test_a_streamed_completions_text_is_read_incrementally_and_equals_its_whole_decode(tokenizer_families, family):
    """`Texts.decode` reads a stream's tokens incrementally (each token decoded with the window before it): after
    every token of completions of up to 60 tokens (text, and random ids that cut characters) its text equals what
    decoding the prompt and the completion so far adds after the prompt, unless that ends inside a character; a
    token costs one decode of at most 2 x CONTEXT_TOKENS + 1 tokens (and a window's move; with the tokens before it
    that end inside a character), not a decode of the whole completion (which cost the front a third of its time at
    128 tokens a row)."""
    tokenizer = tokenizer_families[family]
    longest = 0
    for prompt, completion in _completions(tokenizer, random.Random(2), 40, 1, 6, (20, 60), (20, 40)):
        prompt = prompt[-CONTEXT_TOKENS:]
        decodes = []
        streamed = Texts(type("Counted", (), {"decode": lambda self, ids, **kw: decodes.append(len(ids)) or
                                              tokenizer.decode(ids, **kw)})(), (), prompt)
        for i in range(1, len(completion) + 1):
            decodes.clear()
            got = streamed.decode(completion[:i])
            want = completion_text(tokenizer, prompt, completion[:i])
            if not want.endswith("\ufffd"):
                assert got == want, (i, got, want)
            # (and up to 3 tokens before it that ended inside a character: 4 bytes at most)
            assert len(decodes) <= 2 and max(decodes, default=0) <= 2 * CONTEXT_TOKENS + 4, decodes
        longest = max(longest, len(completion))
        assert streamed.final(completion)[0] == completion_text(tokenizer, prompt, completion)
    assert longest > 3 * CONTEXT_TOKENS  # the window moved up, more than once


@pytest.mark.parametrize("family", ["byte_level_bpe", "metaspace", "wordpiece", "embedded"])
def test_each_tokens_text_offset_is_where_its_text_starts_in_the_answer(tokenizer_families, family):
    """OpenAI's `text_offset`: character offsets into the returned text. Each token's offset is the length of the
    text its tokens before it decode to (after the prompt), given token by token as a stream gives them; a token cut
    in the middle of a character (emoji and accented letters: byte-level BPE's ids, or random ids) sits where its
    character starts. The offsets counted before (each token's own decoded text, added up: what vLLM counts) did
    not point into the answer where a decoder puts spaces between tokens: " and and" on the embedded GPT-2 gave
    0, 3 (text[3:] "d and")."""
    tokenizer = tokenizer_families[family]
    rng = random.Random(1)
    joined_differs = 0
    for prompt, completion in _completions(tokenizer, rng, 150, 1, 1, (1, 14), (1, 6)):
        prompt = prompt[-CONTEXT_TOKENS:]
        text = completion_text(tokenizer, prompt, completion)
        whole = Offsets(tokenizer, prompt).extend(completion)
        streamed = Offsets(tokenizer, prompt)
        split = rng.randint(0, len(completion))
        assert streamed.extend(completion[:split]) + streamed.extend(completion[split:]) == whole
        assert whole[0] == 0 and whole == sorted(whole) and whole[-1] <= len(text)
        for i, at in enumerate(whole):
            before = completion_text(tokenizer, prompt, completion[:i])
            if not before.endswith("\ufffd") and text.startswith(before):
                assert at == len(before), (i, at, before, text)  # the text before the token is text[:at]
        own = [len(tokenizer.decode([t])) for t in completion]
        joined_differs += whole != [sum(own[:i]) for i in range(len(completion))]
    if family in ("wordpiece", "embedded"):
        assert joined_differs > 0  # the decoder's spaces: counting tokens' own texts goes wrong here
    shifted = Offsets(tokenizer, prompt, start=7).extend(completion)  # after an echoed prompt of 7 characters
    assert shifted == [7 + at for at in Offsets(tokenizer, prompt).extend(completion)]


def test_the_embedded_models_completion_keeps_its_leading_space():
    tokenizer = AutoTokenizer.from_pretrained(GPT2)
    prompt = tokenizer("five hundred")["input_ids"]
    completion = tokenizer("and and", add_special_tokens=False)["input_ids"]
    assert completion_text(tokenizer, prompt, completion) == " and and"
    assert completion_text(tokenizer, [], completion) == "and and"  # an encoder-decoder's: no decoder prompt
    assert Offsets(tokenizer, prompt).extend(completion) == [0, 4]  # " and and": each "and" after its space


def test_chat_content_parts_are_joined_for_a_template_that_reads_strings():
    """A list of text parts reached a string-only template as a Python list repr (a silently different prompt);
    joined with newlines as vLLM joins them; a template that loops over parts gets them as they are."""
    string = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    parts = "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}"
    dotted = "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}"
    assert not template_reads_parts(string) and template_reads_parts(parts) and template_reads_parts(dotted)
    assert not template_reads_parts(None) and not template_reads_parts("{% broken")
    messages = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
                {"role": "assistant", "content": "three"}]
    assert join_parts(messages, False) == [{"role": "user", "content": "one\ntwo"}, messages[1]]
    assert join_parts(messages, True) == messages


# The model directory and its limits ------------------------------------------------------------------------------

def test_a_model_directory_without_a_tokenizer_or_with_a_broken_file_is_one_line(tmp_path):
    """transformers 5 builds an empty tokenizer for a directory without its files: the server reported ready and
    answered every request "prompt 0 is empty"; a malformed config.json printed 40 lines of tracebacks."""
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(GPT2 / name, bare / name)
    with pytest.raises(InferenceSetupError, match=r"has no tokenizer: AutoTokenizer made a \w+ of 1 token"):
        read_model_dir(str(bare))
    for name, text in (("config.json", '{"model_type": "gpt2", "n_embd": '),
                       ("generation_config.json", "{not json")):
        broken = tmp_path / name.split(".")[0]
        shutil.copytree(GPT2, broken)
        (broken / name).write_text(text)
        with pytest.raises(InferenceSetupError, match=rf"{name.split('.')[0].split('_')[0]}.* cannot be read") as e:
            read_model_dir(str(broken))
        assert "\n" not in str(e.value)
    config, tokenizer, generation = read_model_dir(str(GPT2))
    assert len(tokenizer) == 72


def test_max_model_len_is_the_models_positions_or_a_stated_default():
    """T5 has no position limit of its own: a 500 KB prompt made each rank ask for 80 GB, and max_tokens 100000 ran
    past --inference_timeout. The default for such a model is 2048 (vLLM's), or its tokenizer's model_max_length, and
    the startup line says which; a model with positions keeps them, and --max_model_len may lower them, not raise."""
    for path, want, says in ((GPT2, 64, "the model's positions"), (T5, 2048, "no absolute positions")):
        config, tokenizer, generation = read_model_dir(str(path))
        limits, line = model_limits(config, generation, ServeArguments(), tokenizer)
        assert limits.max_positions == want and line.startswith(f"max_model_len {want} (") and says in line, line
    t5_config, t5_tokenizer, t5_generation = read_model_dir(str(T5))
    limits, _ = model_limits(t5_config, t5_generation, ServeArguments(), t5_tokenizer)
    assert limits.max_source_positions == 2048
    t5_tokenizer.model_max_length = 512
    limits, line = model_limits(t5_config, t5_generation, ServeArguments(), t5_tokenizer)
    assert limits.max_source_positions == 512 and "model_max_length" in line
    limits, _ = model_limits(t5_config, t5_generation, ServeArguments(max_model_len=100), t5_tokenizer)
    with pytest.raises(ServeError, match=r"prompt 0 has 101 tokens; valid: at most 100 \(--max_model_len\)"):
        plan_rows([[5] * 101], Asked(max_tokens=8), limits)
    config, tokenizer, generation = read_model_dir(str(GPT2))
    with pytest.raises(InferenceSetupError, match=r"--max_model_len 65 is past the model's 64 positions; valid: 2 to 64"):
        model_limits(config, generation, ServeArguments(max_model_len=65), tokenizer)


def test_stop_strings_end_beams_on_a_word_level_tokenizer():
    """transformers' StopStringCriteria fails on the embedded models' tokenizers before the first token ("ValueError:
    substring not found", found by the serve fuzz: a 500 for any beam request with `stop`); the beams' own criterion
    ends a hypothesis once its text holds the stop string, and the text is cut there."""
    tokenizer = AutoTokenizer.from_pretrained(GPT2)
    model = AutoModelForCausalLM.from_pretrained(GPT2).eval()
    ids = tokenizer("thirty-eight thousand, eight hundred and ninety-six =")["input_ids"]
    rows = [Row(prompt_ids=ids, max_new_tokens=20)]
    free = tokenizer.decode(run_batch(model, tokenizer, admit(rows, num_beams=3), "cpu")["sequences"][0][0])
    assert free.startswith("treizeci și opt de mii ") and len(free.split()) > 5, free
    stopped = run_batch(model, tokenizer, admit(rows, num_beams=3, stop=("de mii",)), "cpu")["sequences"][0][0]
    assert tokenizer.decode(stopped) == "treizeci și opt de mii"
