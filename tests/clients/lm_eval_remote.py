"""lm-evaluation-harness's `local-completions` against `ds-inference serve`, with its remote tokenizer (no local copy
of the tokenizer: it reads GET /tokenizer_info, POST /tokenize and /detokenize): loglikelihoods, compared with the
unsharded model in this process, and a greedy generation. Run by hand (lm-eval is no dependency of the project):

    ds-inference serve examples/models/gpt2-num2words-en-ro --tp_size 2 --port 8000 &
    pip install --target /tmp/lmpkg --no-deps lm_eval==0.4.13 tenacity
    PYTHONPATH=/tmp/lmpkg python tests/clients/lm_eval_remote.py http://127.0.0.1:8000 examples/models/gpt2-num2words-en-ro
"""
import sys

import torch
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI
from transformers import AutoModelForCausalLM, AutoTokenizer

url, model_dir = sys.argv[1], sys.argv[2]
lm = LocalCompletionsAPI(base_url=url + "/v1/completions", model="gpt2-num2words-en-ro", tokenizer_backend="remote",
                         num_concurrent=1, max_retries=1, tokenized_requests=True)
print("tokenizer:", type(lm.tokenizer).__name__, "eos id", lm.eot_token_id)
pairs = [("five hundred", " and and"), ("one thousand, four hundred", " and eighteen"), ("seven", " hundred")]
reqs = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
got = lm.loglikelihood(reqs)
tok, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir).eval()
worst = 0.0
for (ctx, cont), (ll, greedy) in zip(pairs, got):
    c, w = tok(ctx, add_special_tokens=False)["input_ids"], tok(cont, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([c + w])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    want = sum(float(logp[len(c) - 1 + j, t]) for j, t in enumerate(w))
    worst = max(worst, abs(want - ll))
    print(f"{ctx!r} + {cont!r}: served {ll:.6f}, one process {want:.6f}, greedy {greedy}")
print(f"largest difference {worst:.2g}")
gen = lm.generate_until([Instance("generate_until", {}, ("five hundred", {"until": ["\n"], "max_gen_toks": 6}), 0)])
print("generate_until:", gen)
