"""Text as clients rebuild it: a completion's text, streamed or whole, and a chat message's content as its template
expects it.

A completion's text is what decoding the prompt and the completion together adds after the prompt's text, as
OpenAI's and vLLM's servers give it: a client that appends the text to its prompt gets the decoded whole. Decoding
the new tokens alone drops what a tokenizer puts between tokens: for the embedded GPT-2 (a WordPiece decoder, which
joins words with spaces) "five hundred" + ["and", "and"] came back "and and", so the client had "five hundredand and";
SentencePiece's metaspace and byte-level BPE lose a first token's leading space the same way. The prompt's last
CONTEXT_TOKENS tokens stand for it (decoders join neighbouring tokens only; `tests/test_serve_units.py` checks the
window against the whole prompt on byte-level BPE, metaspace and WordPiece tokenizers); an encoder-decoder's
completion has no decoder prompt before it, and is decoded alone (as run_translation.py writes it)."""

from __future__ import annotations

import os

CONTEXT_TOKENS = 8


def completion_text(tokenizer, context: list[int], tokens: list[int], skip_special: bool = True,
                    head: str | None = None) -> str:
    """What `tokens` add to the text of `context` (the prompt's last tokens; empty for an encoder-decoder); special
    tokens (EOS, a chat model's turn markers) are dropped unless `skip_special` is false (vLLM's
    `skip_special_tokens`). `head`: the context's own text, where the caller kept it."""
    if not context:
        return tokenizer.decode(tokens, skip_special_tokens=skip_special)
    if head is None:
        head = tokenizer.decode(context, skip_special_tokens=skip_special)
    whole = tokenizer.decode(context + tokens, skip_special_tokens=skip_special)
    if whole.startswith(head):
        return whole[len(head):]
    # the prompt ended inside a character (token ids cut through a byte sequence): the completion completes it
    return whole[len(os.path.commonprefix([head, whole])):]


class Texts:
    """A row's text as its tokens arrive: what may be sent now (held back while it could still become a stop string,
    or ends in half a character), and the final text, cut at the first stop string (after it with `keep_stop`:
    vLLM's `include_stop_str_in_output`)."""

    def __init__(self, tokenizer, stops: tuple[str, ...], context: list[int] | None = None, skip_special: bool = True,
                 keep_stop: bool = False):
        self.tokenizer, self.stops, self.context = tokenizer, stops, list(context or ())
        self.skip_special, self.keep_stop = skip_special, keep_stop
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = 0
        # the context's text, decoded once: every token's delta decoded it again (half the front's decoding, which
        # was a third of its time a streamed token: 33524 decodes for 16762 deltas, `bench serve` on gpt2-256 at
        # concurrency 16, 2026-12-05)
        self.head = tokenizer.decode(self.context, skip_special_tokens=skip_special) if self.context else None
        # what `decode` has read: the context and the tokens seen (`ids`), the text the first `read` of them add after
        # the context (`text`; tokens after `read` end inside a character, not yet text), and the window the next
        # tokens are decoded with: ids[prefix:read] and its text (`last`)
        self.ids, self.read, self.text = list(self.context), len(self.context), ""
        self.prefix = max(0, len(self.context) - CONTEXT_TOKENS)
        self.last = self.head if self.prefix == 0 and self.head is not None else self._text(self.ids[self.prefix:])

    def decode(self, tokens: list[int]) -> str:
        """What `tokens` (the row's new tokens so far) add after the context, read incrementally where each call's
        tokens extend the last's, as a stream gives them (vLLM's and TGI's incremental detokenizers' window): the new
        tokens are decoded with at least CONTEXT_TOKENS tokens before them (decoders join neighbouring tokens only,
        the rule the prompt's window rests on), and what they add to that window's text is the text's new end: one
        decode of at most 2 x CONTEXT_TOKENS tokens and the new ones a call, where decoding the whole completion again
        for every token cost the front a third of its time at 8-128 tokens a row (`Texts.decode`: 31.8% of the
        front's samples, py-spy, `bench serve --models gpt2-256 --tp_size 1`, concurrency 16, 2026-12-07). Anything
        else (tokens that do not extend the last call's, new tokens that change their window's text before its end)
        is decoded whole."""
        seen = len(self.ids) - len(self.context)
        if len(tokens) < seen or self.ids[len(self.context):] != list(tokens[:seen]):
            return completion_text(self.tokenizer, self.context, tokens, self.skip_special, self.head)
        return self.extend(tokens[seen:])

    def extend(self, new) -> str:
        """`decode` of the tokens read before and `new` after them: the text they add after the context."""
        self.ids.extend(new)
        if self.read == len(self.ids):
            return self.text
        if self.read - self.prefix > 2 * CONTEXT_TOKENS:  # the window moves up, to the last CONTEXT_TOKENS read
            self.prefix = self.read - CONTEXT_TOKENS
            self.last = self._text(self.ids[self.prefix:self.read])
        after = self._text(self.ids[self.prefix:])
        if not after.startswith(self.last):
            text = completion_text(self.tokenizer, self.context, self.ids[len(self.context):], self.skip_special,
                                   self.head)
            if not text.endswith("\ufffd"):
                self.text, self.read = text, len(self.ids)
                self.prefix = max(0, self.read - CONTEXT_TOKENS)
                self.last = self._text(self.ids[self.prefix:])
            return text
        added = after[len(self.last):]
        if added.endswith("\ufffd"):  # the last token ends inside a character: read again with the next
            return self.text + added
        self.text, self.read, self.last = self.text + added, len(self.ids), after
        return self.text

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special) if ids else ""

    def cut(self, text: str) -> int | None:
        """Where `text` ends at its first stop string (the one that starts first): before it, or after it with
        `keep_stop`; None where none is in it."""
        found = [(text.find(s), text.find(s) + len(s)) for s in self.stops if s in text]
        if not found:
            return None
        start, end = min(found)
        return end if self.keep_stop else start

    def final(self, tokens: list[int]) -> tuple[str, bool]:
        text = self.decode(tokens)
        cut = self.cut(text)
        return (text[:cut], True) if cut is not None else (text, False)

    def delta(self, tokens: list[int]) -> str:
        text = self.decode(tokens)
        if text.endswith("\ufffd"):
            return ""
        end = len(text) - self.hold  # a stop string may still complete over the last `hold` characters
        cut = self.cut(text)
        if cut is not None:  # one has completed: nothing past the cut is ever sent
            end = min(end, cut)
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent:end], end
        return out

    def rest(self, tokens: list[int]) -> str:
        text, _ = self.final(tokens)
        out = text[self.sent:]
        self.sent = len(text)
        return out


class Offsets:
    """Where each token's text starts in the text its tokens decode to (OpenAI's `text_offset`: character offsets
    into the returned text), token by token as they come: each token's text is what decoding it adds after the tokens
    before it (`Texts`' incremental read: the window before it, as vLLM's incremental detokenizer reads it), so that a
    tokenizer whose decoder puts spaces between tokens (the embedded GPT-2's WordPiece), or a metaspace one, gives
    each token the place its text has in the answer; a token that ends inside a character adds nothing until the
    character is whole. Counting each token's own decoded text instead (what vLLM's server does) places
    the tokens in the texts joined, which only byte-level BPE's equal the answer: for "five hundred" -> " and and"
    on the embedded GPT-2 it gave 0, 3 (text[0:3] " an"), where the tokens start at 0 and 4. `context`: the tokens
    the text follows (a prompt's last tokens: a completion's first token takes its leading space); `start`: the
    offset of the first token."""

    def __init__(self, tokenizer, context: list[int] | None = None, skip_special: bool = True, start: int = 0):
        # the text so far, read incrementally (`Texts.extend`): a token's offset is that text's length before it
        self.texts = Texts(tokenizer, (), context, skip_special)
        self.start = start

    def extend(self, tokens) -> list[int]:
        """The offsets of `tokens`, which follow those given before."""
        out = []
        for token in tokens:
            out.append(self.start + len(self.texts.text))
            self.texts.extend([token])
        return out


def context_of(row, encoder_decoder: bool) -> list[int]:
    """The prompt tokens a row's completion text is decoded after (see the module's docstring)."""
    return [] if encoder_decoder else row.prompt_ids[-CONTEXT_TOKENS:]


def template_reads_parts(template: str | None) -> bool:
    """Whether a chat template loops over a message's content (OpenAI's list of parts: a multimodal template), as
    vLLM tells its two content formats apart; otherwise it reads the content as one string."""
    if not template:
        return False
    import jinja2
    import jinja2.nodes as nodes

    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateError:
        return False

    def names_content(node) -> bool:
        return ((isinstance(node, nodes.Getattr) and node.attr == "content")
                or (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content"))

    return any(any(names_content(n) for n in loop.iter.find_all((nodes.Getattr, nodes.Getitem))) or
               names_content(loop.iter) for loop in tree.find_all(nodes.For))


def join_parts(messages: list[dict], template_reads_parts_: bool) -> list[dict]:
    """Messages with list content as the template expects them: for a template that reads strings, the text parts
    joined with newlines (vLLM's "string" content format; before, the template printed the list's Python repr, a
    silently different prompt); for one that loops over parts, as they are. A part that is not text is refused
    before this (`app.Api.chat`)."""
    if template_reads_parts_:
        return messages
    return [{**m, "content": "\n".join(part.get("text", "") for part in m["content"])}
            if isinstance(m.get("content"), list) else m for m in messages]
