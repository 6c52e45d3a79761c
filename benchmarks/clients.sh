#!/usr/bin/env bash
# Real clients against `blockspec serve`, each bounded in time: the official openai client,
# lm-eval (local-chat-completions on a local copy of the bundled gsm8k prompts), lm-eval's
# loglikelihood scoring (local-completions with echo and logprobs, on a multiple-choice task made
# from gsm8k, checked against lm-eval's own hf backend on the same weights) and guidellm (a
# synchronous run and a concurrent run per STREAMS number). The clients are installed into
# .venv-clients, apart from the project's own environment; the server, logs and reports go to OUT.
#
#   benchmarks/clients.sh                                  # all three, the default target
#   CLIENTS="guidellm" DURATION=60 benchmarks/clients.sh   # guidellm alone, 60 s per run
#   SERVE_ARGS="--target DIR --method ar" benchmarks/clients.sh
#
# Run it on a quiet machine when the figures matter (guidellm's are throughput and latency).
set -euo pipefail
cd "$(dirname "$0")/.."

PORT=${PORT:-8123}
CLIENTS=${CLIENTS:-"openai lm-eval lm-eval-scoring guidellm"}
DURATION=${DURATION:-60}   # seconds of each guidellm run
STREAMS=${STREAMS:-"4 16"}  # requests in flight in guidellm's concurrent runs (one run per number)
LIMIT=${LIMIT:-20}         # gsm8k questions lm-eval asks
GEN_TOKENS=${GEN_TOKENS:-256}  # lm-eval's answer length
OUT=${OUT:-runs/clients}
SERVE_ARGS=${SERVE_ARGS:-}
CLIENT_VENV=.venv-clients
# These versions were checked; others may work.
CLIENT_PACKAGES=("torch==2.13.0" "lm-eval[api]==0.4.13" "accelerate==1.16.0" "guidellm==0.8.1" "openai==3.51.0")
export BLOCKSPEC_API_KEY=${BLOCKSPEC_API_KEY:-clients-check-key}
URL="http://127.0.0.1:$PORT"

install_clients() {
    if [ ! -x "$CLIENT_VENV/bin/guidellm" ] || [ ! -x "$CLIENT_VENV/bin/lm_eval" ] ||
            ! "$CLIENT_VENV/bin/python" -c "import accelerate" 2> /dev/null; then
        python3 -m venv "$CLIENT_VENV"
        "$CLIENT_VENV/bin/pip" install --quiet "${CLIENT_PACKAGES[0]}"  # the CPU build, before anything pulls another
        "$CLIENT_VENV/bin/pip" install --quiet "${CLIENT_PACKAGES[@]:1}"
    fi
}

start_server() {
    # shellcheck disable=SC2086  # SERVE_ARGS is a list of options
    .venv/bin/blockspec serve --port "$PORT" --log-level warning $SERVE_ARGS > "$OUT/serve.log" 2>&1 &
    SERVER=$!
    trap 'kill "$SERVER" 2>/dev/null || true' EXIT
    for _ in $(seq 600); do
        if curl -sf "$URL/health" > /dev/null; then
            MODEL=$(curl -sf -H "Authorization: Bearer $BLOCKSPEC_API_KEY" "$URL/v1/models" |
                    "$CLIENT_VENV/bin/python" -c "import json, sys; print(json.load(sys.stdin)['data'][0]['id'])")
            echo "serving $MODEL at $URL"
            return
        fi
        kill -0 "$SERVER" 2>/dev/null || { cat "$OUT/serve.log"; exit 1; }
        sleep 1
    done
    echo "the server did not start within 600 s" >&2
    exit 1
}

run_openai() {
    OPENAI_API_KEY=$BLOCKSPEC_API_KEY MODEL=$MODEL URL=$URL timeout 600 "$CLIENT_VENV/bin/python" - <<'EOF'
import os

import openai

client = openai.OpenAI(base_url=os.environ["URL"] + "/v1", api_key=os.environ["OPENAI_API_KEY"], max_retries=0)
model = os.environ["MODEL"]
chat = client.chat.completions.create(model=model, temperature=0, max_tokens=24,
                                      messages=[{"role": "user", "content": "What is 12 * 7?"}])
stream = client.chat.completions.create(model=model, temperature=0, max_tokens=24, stream=True,
                                        stream_options={"include_usage": True},
                                        messages=[{"role": "user", "content": "What is 12 * 7?"}])
chunks = list(stream)
streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
assert streamed == chat.choices[0].message.content, (streamed, chat.choices[0].message.content)
assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
text = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=8, temperature=0)
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], seed=2**70)
except openai.BadRequestError as error:
    refused = error.body["param"]
assert refused == "seed"
print(f"openai {openai.__version__}: chat, streamed chat (same text, usage), completions, a refused seed: ok; "
      f"{chat.usage.completion_tokens} tokens: {chat.choices[0].message.content!r}")
EOF
}

run_lm_eval() {
    local tasks="$OUT/lm-eval-tasks"
    mkdir -p "$tasks"
    # The bundled gsm8k prompts (each asks for the answer in \boxed{}) as an lm-eval task on a local file.
    "$CLIENT_VENV/bin/python" - "$tasks" "$GEN_TOKENS" <<'EOF'
import json, sys
from pathlib import Path

tasks, gen_tokens = Path(sys.argv[1]).resolve(), int(sys.argv[2])
rows = [json.loads(line) for line in Path("blockspec/data/prompts/gsm8k.jsonl").read_text().splitlines()]
(tasks / "gsm8k.jsonl").write_text("".join(json.dumps({"question": r["turns"][0], "answer": r["answer"]}) + "\n"
                                           for r in rows))
(tasks / "gsm8k_blockspec.yaml").write_text(f"""task: gsm8k_blockspec
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tasks / 'gsm8k.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: []
  max_gen_toks: {gen_tokens}
  temperature: 0
filter_list:
  - name: boxed
    filter:
      - function: regex
        regex_pattern: "boxed{{\\\\$?(-?[0-9.,]+)"
        group_select: -1
      - function: take_first
  - name: last-number
    filter:
      - function: regex
        regex_pattern: "(-?[0-9][0-9.,]*)"
        group_select: -1
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    regexes_to_ignore: [",", "\\\\$", "\\\\.$"]
""")
EOF
    OPENAI_API_KEY=$BLOCKSPEC_API_KEY timeout $((LIMIT * 60 + 300)) "$CLIENT_VENV/bin/lm_eval" \
        --model local-chat-completions \
        --model_args "model=$MODEL,base_url=$URL/v1/chat/completions,num_concurrent=4,max_retries=1,tokenized_requests=False" \
        --include_path "$tasks" --tasks gsm8k_blockspec --apply_chat_template --limit "$LIMIT" \
        --output_path "$OUT/lm-eval" 2>&1 | tail -8
}

run_lm_eval_scoring() {
    local tasks="$OUT/lm-eval-scoring-tasks" weights
    weights=$(.venv/bin/python -c "from blockspec.hub import resolve_model; print(resolve_model('$MODEL'))")
    mkdir -p "$tasks"
    # Multiple choice from the bundled gsm8k problems: the right answer among three wrong numbers near it.
    "$CLIENT_VENV/bin/python" - "$tasks" <<'EOF'
import json, random, sys
from pathlib import Path

tasks = Path(sys.argv[1]).resolve()
rng = random.Random(0)
rows = []
for line in Path("blockspec/data/prompts/gsm8k.jsonl").read_text().splitlines():
    row = json.loads(line)
    answer = int(float(str(row["answer"]).replace(",", "")))
    wrong = {answer + rng.randint(1, 9), answer * 2 + 1, max(0, answer - rng.randint(1, 9)), answer + 10} - {answer}
    choices = [answer] + sorted(wrong)[:3]
    rng.shuffle(choices)
    rows.append({"question": row["turns"][0], "choices": [str(c) for c in choices], "label": choices.index(answer)})
(tasks / "gsm8k_choice.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
(tasks / "gsm8k_choice_blockspec.yaml").write_text(f"""task: gsm8k_choice_blockspec
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tasks / 'gsm8k_choice.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
EOF
    local common=(--include_path "$tasks" --tasks gsm8k_choice_blockspec --limit "$LIMIT" --log_samples)
    OPENAI_API_KEY=$BLOCKSPEC_API_KEY timeout $((LIMIT * 30 + 300)) "$CLIENT_VENV/bin/lm_eval" \
        --model local-completions \
        --model_args "model=$MODEL,base_url=$URL/v1/completions,num_concurrent=1,max_retries=1,tokenized_requests=True,tokenizer_backend=huggingface,tokenizer=$weights" \
        "${common[@]}" --output_path "$OUT/lm-eval-scoring/server" 2>&1 | tail -6
    timeout $((LIMIT * 30 + 300)) "$CLIENT_VENV/bin/lm_eval" --model hf \
        --model_args "pretrained=$weights,dtype=float32" --device cpu --batch_size 1 \
        "${common[@]}" --output_path "$OUT/lm-eval-scoring/hf" 2>&1 | tail -6
    # The loglikelihood of every (question, choice) through the server against lm-eval's hf backend's.
    "$CLIENT_VENV/bin/python" - "$OUT/lm-eval-scoring" <<'EOF'
import json, sys
from pathlib import Path

def scores(folder):
    (samples,) = Path(folder).rglob("samples_*.jsonl")
    docs = [json.loads(line) for line in samples.read_text().splitlines()]
    return {d["doc_id"]: [float(r[0][0]) for r in d["resps"]] for d in docs}, {d["doc_id"]: d["acc"] for d in docs}

root = Path(sys.argv[1])
(served, served_acc), (hf, hf_acc) = scores(root / "server"), scores(root / "hf")
gap = max(abs(a - b) for doc in hf for a, b in zip(served[doc], hf[doc]))
same = sum(served_acc[doc] == hf_acc[doc] for doc in hf)
print(f"lm-eval scoring: {len(hf)} questions x 4 choices; accuracy server {sum(served_acc.values()) / len(hf):.3f}, "
      f"hf {sum(hf_acc.values()) / len(hf):.3f}; same verdict on {same}/{len(hf)}; largest loglikelihood gap {gap:.1e}")
assert same == len(hf) and gap < 1e-3, "the server's scores differ from lm-eval's hf backend"
EOF
}

run_guidellm() {
    local tokenizer
    tokenizer=$(.venv/bin/python -c "from blockspec.hub import resolve_model; print(resolve_model('$MODEL'))")
    local profiles=(synchronous)
    for streams in $STREAMS; do profiles+=("concurrent,streams=$streams"); done
    for profile in "${profiles[@]}"; do
        local name=${profile/,streams=/-}
        echo "guidellm $name, $DURATION s"
        timeout $((DURATION + 600)) "$CLIENT_VENV/bin/guidellm" run \
            --backend "kind=openai_http,target=$URL,model=$MODEL,api_key=$BLOCKSPEC_API_KEY" \
            --profile "kind=$profile" --constraint "kind=max_duration,seconds=$DURATION" \
            --data "kind=synthetic_text,prompt_tokens=128,output_tokens=64" \
            --tokenizer "kind=huggingface_auto,model=$tokenizer" \
            --output "kind=json,path=$OUT/guidellm-$name.json" --disable-console-interactive 2>&1 | tail -25
    done
}

mkdir -p "$OUT"
install_clients
start_server
failed=""
for client in $CLIENTS; do
    echo "== $client"
    "run_${client//-/_}" || failed="$failed $client"
done
if [ -n "$failed" ]; then
    echo "failed:$failed (the server's log: $OUT/serve.log)" >&2
    exit 1
fi
