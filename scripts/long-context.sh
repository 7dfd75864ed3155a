#!/usr/bin/env bash
# The 32k-token prompt of issue 42 on the tiny cards' 32k test configuration
# (tests/fixtures/longctx/mixtral-tiny-32k.ron: mixtral-tiny with 32,768 positions):
# `moec run` (the resident schedule, unchunked, as a run prefills) and the oracle
# (`moec generate`) continue the same prompt of WORDS words (one token each, plus BOS);
# their first GEN tokens must be equal. Prints both runs' reports and the attention time.
# Minutes in a release build on 2 cores (attention over every prompt position is O(n^2),
# both sides); the test suite runs 4,096 tokens
# (runtime_invariance::a_long_prompt_on_the_32k_card_gives_the_oracle_s_first_tokens).
#
#   scripts/long-context.sh            # WORDS=32760 GEN=4 MOEC=target/release/moec
set -euo pipefail
cd "$(dirname "$0")/.."
MOEC=${MOEC:-target/release/moec}
WORDS=${WORDS:-32760}
GEN=${GEN:-4}
CARD=tests/fixtures/longctx/mixtral-tiny-32k.ron
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
python3 -c "import json,sys; print(json.dumps({'prompt': 'one ' * int(sys.argv[1])}))" "$WORDS" >"$out/prompt.jsonl"
echo "== moec run (resident) on $WORDS words"
/usr/bin/time -f "wall %e s, peak RSS %M KB" "$MOEC" run schedules/baselines/resident.sched \
  --model "$CARD" --prompts "$out/prompt.jsonl" --gen-len "$GEN" --hw t4 --json >"$out/run.json"
echo "== oracle (moec generate)"
/usr/bin/time -f "wall %e s, peak RSS %M KB" "$MOEC" generate --model "$CARD" \
  --prompts "$out/prompt.jsonl" --max-new-tokens "$GEN" --json >"$out/oracle.json"
python3 - "$out/run.json" "$out/oracle.json" <<'PY'
import json, sys
run = json.load(open(sys.argv[1]))["outputs"][0]["token_ids"]
oracle = json.load(open(sys.argv[2]))["outputs"][0]["token_ids"]
print(f"moec run: {run}\noracle:   {oracle}")
sys.exit(0 if run == oracle[: len(run)] and run else 1)
PY
